"""Tables of the audit store. Alembic migrations in ``migrations/`` create them; this module is
their ``target_metadata`` and the single place queries take column names from."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
)

# Deterministic constraint names: alembic batch mode on SQLite needs them to alter tables.
metadata = MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# SQLite only auto-increments an INTEGER PRIMARY KEY.
_BigId = BigInteger().with_variant(Integer(), "sqlite")

decisions = Table(
    "decisions",
    metadata,
    Column("id", _BigId, primary_key=True, autoincrement=True),
    Column("node", String(64), nullable=False),
    Column("node_seq", BigInteger, nullable=False),  # per-node order, and the chain's order
    Column("first_at_us", BigInteger, nullable=False),  # unix microseconds
    Column("last_at_us", BigInteger, nullable=False),
    Column("count", Integer, nullable=False),
    Column("channel", String(8), nullable=False),
    Column("query_type", String(16)),  # DNS qtype or HTTP method
    Column("response", String(16)),  # DNS rcode or HTTP status
    Column("client_network", String(43), nullable=False),
    Column("ecs_prefix", String(43)),
    Column("country", String(2)),
    Column("continent", String(2)),
    Column("name", String(255), nullable=False),
    Column("service", String(64)),
    Column("residency_classes", JSON, nullable=False),
    Column("tenant", String(128)),
    Column("matched_rules", JSON, nullable=False),
    Column("snapshot_version", BigInteger, nullable=False),
    Column("topology_version", String(32), nullable=False),
    Column("policy_version", String(32), nullable=False),
    Column("geoip_build", String(80), nullable=False),
    Column("candidates", JSON, nullable=False),
    Column("region", String(64)),
    Column("answer", JSON, nullable=False),
    Column("outcome", String(16), nullable=False),
    Column("ttl", Integer, nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("row_hash", String(64), nullable=False),
    UniqueConstraint("node", "node_seq", name="uq_decisions_node_seq"),
    Index("ix_decisions_first_at_us", "first_at_us"),
    Index("ix_decisions_region", "region"),
    Index("ix_decisions_outcome", "outcome"),
)
