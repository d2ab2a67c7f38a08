"""The decisions table: one row per distinct decision per flush window, hash-chained per node.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "decisions",
        sa.Column("id", _BigId, primary_key=True, autoincrement=True),
        sa.Column("node", sa.String(64), nullable=False),
        sa.Column("node_seq", sa.BigInteger, nullable=False),
        sa.Column("first_at_us", sa.BigInteger, nullable=False),
        sa.Column("last_at_us", sa.BigInteger, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("channel", sa.String(8), nullable=False),
        sa.Column("query_type", sa.String(16)),
        sa.Column("response", sa.String(16)),
        sa.Column("client_network", sa.String(43), nullable=False),
        sa.Column("ecs_prefix", sa.String(43)),
        sa.Column("country", sa.String(2)),
        sa.Column("continent", sa.String(2)),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("service", sa.String(64)),
        sa.Column("residency_classes", sa.JSON, nullable=False),
        sa.Column("tenant", sa.String(128)),
        sa.Column("matched_rules", sa.JSON, nullable=False),
        sa.Column("snapshot_version", sa.BigInteger, nullable=False),
        sa.Column("topology_version", sa.String(32), nullable=False),
        sa.Column("policy_version", sa.String(32), nullable=False),
        sa.Column("geoip_build", sa.String(80), nullable=False),
        sa.Column("candidates", sa.JSON, nullable=False),
        sa.Column("region", sa.String(64)),
        sa.Column("answer", sa.JSON, nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("ttl", sa.Integer, nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("row_hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_decisions"),
        sa.UniqueConstraint("node", "node_seq", name="uq_decisions_node_seq"),
    )
    op.create_index("ix_decisions_first_at_us", "decisions", ["first_at_us"])
    op.create_index("ix_decisions_region", "decisions", ["region"])
    op.create_index("ix_decisions_outcome", "decisions", ["outcome"])


def downgrade() -> None:
    op.drop_index("ix_decisions_outcome", table_name="decisions")
    op.drop_index("ix_decisions_region", table_name="decisions")
    op.drop_index("ix_decisions_first_at_us", table_name="decisions")
    op.drop_table("decisions")
