"""Tables of the shared store: the audit log of decisions and the fleet's shared region state.

Alembic migrations in ``migrations/`` create them; this module is their ``target_metadata`` and
the single place queries take column names from."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
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

# On PostgreSQL the table is range-partitioned by ``first_at_us`` (a partition per UTC day, made
# ahead of time: migration 0009, gtm.audit.partitions), and (node, node_seq) is unique within each
# partition, since a unique index over all partitions must contain the partition key. On SQLite
# it is one table and the constraint below holds whole.
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


def include_object(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    """What alembic compares with these tables (``include_object``): not the decisions table's
    time partitions on PostgreSQL (made by the database, day by day), nor the (node, node_seq)
    constraint there, which holds per partition instead (see ``decisions``)."""
    if type_ == "table" and reflected and (name or "").startswith("decisions_p"):
        return False
    return not (
        type_ == "unique_constraint" and name == "uq_decisions_node_seq" and compare_to is None
    )


# Every change of a region's state: what a node's probes concluded ("observed"), what came into
# force on a node after the quorum and the operator's overrides ("in_force"), and every
# operator action ("override", with who and why). Append-only; probes themselves are metrics.
region_events = Table(
    "region_events",
    metadata,
    Column("id", _BigId, primary_key=True, autoincrement=True),
    Column("at_us", BigInteger, nullable=False),
    Column("node", String(64), nullable=False),
    Column("region", String(64), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("state", String(16)),
    Column("previous", String(16)),
    Column("detail", Text, nullable=False),
    Column("actor", String(128)),
    Column("reason", Text),
    # The fleet-wide hash chain (gtm.audit.event_chain); NULL on rows from before it existed.
    Column("seq", BigInteger, unique=True),
    Column("prev_hash", String(64)),
    Column("row_hash", String(64)),
    # Who wrote it (0011): the writer's audit key id and its Ed25519 signature over row_hash,
    # checked against the keys published in the checkpoint sink. NULL: nobody vouches for it.
    Column("key_id", String(16)),
    Column("signature", String(128)),
    Index("ix_region_events_at_us", "at_us"),
    Index("ix_region_events_region", "region"),
)

# The head of the region events' chain: one row, updated in every transaction that appends
# events, which serialises appenders (a row lock on PostgreSQL, the write lock on SQLite).
event_chain = Table(
    "event_chain",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("seq", BigInteger, nullable=False),
    Column("last_hash", String(64), nullable=False),
)

# The latest health observation of each (node, region): refreshed while the node probes, so a
# quorum counts only fresh rows and a dead node's view ages out by itself. Each row is signed by
# its node's own key over every other column (gtm.fleet.observation_seal; key_id only names the
# key it claims): readers count it only when it verifies with that member's key.
health_observations = Table(
    "health_observations",
    metadata,
    Column("node", String(64), primary_key=True),
    Column("region", String(64), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("since_us", BigInteger, nullable=False),
    Column("observed_at_us", BigInteger, nullable=False),
    Column("detail", Text, nullable=False),
    Column("key_id", String(16), nullable=True),
    Column("signature", String(128), nullable=True),
)

# Operator overrides in force, one row per region (history lives in region_events).
region_overrides = Table(
    "region_overrides",
    metadata,
    Column("region", String(64), primary_key=True),
    Column("drain", Boolean, nullable=False),
    Column("weight", Float),
    Column("force", String(8)),  # "up" | "down" | NULL
    Column("force_until_us", BigInteger),  # a forced state always lapses
    Column("expires_at_us", BigInteger),  # when drain and weight lapse; NULL: until cleared
    Column("actor", String(128), nullable=False),
    Column("reason", Text, nullable=False),
    Column("set_at_us", BigInteger, nullable=False),
)

# Topology and policy documents published for the whole fleet; the newest row is in force.
documents = Table(
    "documents",
    metadata,
    Column("id", _BigId, primary_key=True, autoincrement=True),
    Column("published_at_us", BigInteger, nullable=False),
    Column("topology", Text, nullable=False),  # YAML text
    Column("policies", JSON, nullable=False),  # {file name: YAML text}
    Column("fingerprint", String(64), nullable=False),
    Column("actor", String(128), nullable=False),
    Column("reason", Text, nullable=False),
    # The approval record (canonical JSON) and the admin service's Ed25519 signature over it:
    # nodes apply a row only when both verify (gtm.fleet.signed_documents). Rows without them
    # (written before the control plane, or straight into the database) are refused.
    Column("version_id", String(64)),
    Column("sequence", BigInteger),
    Column("manifest", Text),
    Column("signature", String(128)),
)

# What each node has in force, written at every state sync: an activation is in force
# everywhere when every live node reports its sequence; region state as the serving nodes hold it.
node_status = Table(
    "node_status",
    metadata,
    Column("node", String(64), primary_key=True),
    Column("observer", String(64), nullable=False),
    Column("updated_at_us", BigInteger, nullable=False),
    Column("document_sequence", BigInteger),
    Column("snapshot_version", BigInteger, nullable=False),
    Column("topology_version", String(32), nullable=False),
    Column("policy_version", String(32), nullable=False),
    Column("regions", JSON, nullable=False),  # {region: state in force}
    # The node's audit spool: the newest decision row it sealed, and the newest it knows the
    # database holds (rows between are still on its disk; gtm.audit.verify). NULL: no report.
    Column("audit_sealed_seq", BigInteger),
    Column("audit_drained_seq", BigInteger),
)

# The control plane (gtm.admin): principals, their API tokens, document versions and the
# proposals that take a version through approval to activation.
principals = Table(
    "principals",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("roles", JSON, nullable=False),  # [role, ...]
    Column("created_at_us", BigInteger, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("disabled", Boolean, nullable=False),
    Column("seal", String(160)),  # gtm.admin.seals: the admin service's signature on the row
    # The OIDC subject (the identity provider's `sub`) an admin bound to it (gtm.admin.oidc).
    Column("oidc_subject", String(255), unique=True),
)

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", String(32), primary_key=True),  # the public part of the token
    Column("principal_id", String(32), nullable=False),
    Column("secret_hash", String(64), nullable=False),  # SHA-256 of the secret part
    Column("created_at_us", BigInteger, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("expires_at_us", BigInteger),
    Column("revoked_at_us", BigInteger),
    Column("last_used_at_us", BigInteger),
    Column("seal", String(160)),
    Index("ix_api_tokens_principal_id", "principal_id"),
)

# Content-addressed: id = SHA-256 of the topology and policies (gtm.fleet.signed_documents).
document_versions = Table(
    "document_versions",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("topology", Text, nullable=False),
    Column("policies", JSON, nullable=False),
    Column("created_at_us", BigInteger, nullable=False),
    Column("created_by", String(128), nullable=False),
)

proposals = Table(
    "proposals",
    metadata,
    Column("id", _BigId, primary_key=True, autoincrement=True),
    Column("version_id", String(64), nullable=False),
    # draft | proposed | approved | active | superseded | withdrawn
    Column("state", String(16), nullable=False),
    Column("author_id", String(32), nullable=False),
    Column("reason", Text, nullable=False),
    Column("base_version_id", String(64)),  # what was active when it was written (the diff)
    Column("required_approvals", Integer, nullable=False),
    Column("created_at_us", BigInteger, nullable=False),
    Column("updated_at_us", BigInteger, nullable=False),
    Column("activate_at_us", BigInteger),  # scheduled activation, when asked for
    Column("activate_by", String(32)),  # the approver who scheduled it
    Column("activated_at_us", BigInteger),
    Column("sequence", BigInteger, unique=True),  # the activation serial, once active
    Column("seal", String(160)),  # over its id and author
)

approvals = Table(
    "approvals",
    metadata,
    Column("proposal_id", BigInteger, primary_key=True),
    Column("principal_id", String(32), primary_key=True),
    Column("version_id", String(64), nullable=False),  # the version the approver reviewed
    Column("at_us", BigInteger, nullable=False),
    Column("comment", Text, nullable=False),
    Column("seal", String(160)),
)

# The evidence outside the rows (gtm.audit.checkpoints): which store this is (spools and
# checkpoints name it, so one store's never land in another), and the signed checkpoints of
# every chain, a copy of what each node also writes to its sink outside the database.
audit_store = Table(
    "audit_store",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("created_at_us", BigInteger, nullable=False),
)

audit_checkpoints = Table(
    "audit_checkpoints",
    metadata,
    Column("id", _BigId, primary_key=True, autoincrement=True),
    Column("chain", String(80), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("head", String(64), nullable=False),
    Column("answers", BigInteger, nullable=False),
    Column("at_us", BigInteger, nullable=False),
    Column("store", String(36), nullable=False),
    Column("key_id", String(16), nullable=False),
    Column("detail", Text, nullable=False),
    Column("signature", String(128), nullable=False),
    Index("ix_audit_checkpoints_chain_id", "chain", "id"),  # each chain's newest
    Index("ix_audit_checkpoints_kind", "kind", "chain"),  # the gaps and cuts
)

# The newest capacity report each node accepted from each region (gtm.fleet.report_marks):
# replay protection that survives restarts and holds across nodes.
capacity_marks = Table(
    "capacity_marks",
    metadata,
    Column("node", String(64), primary_key=True),
    Column("region", String(64), primary_key=True),
    Column("ts", Float, nullable=False),
    Column("seq", BigInteger, nullable=False),
)

# The control log (gtm.control): every fact that moves traffic, grants power or counts as
# evidence, one signed entry each, chained by hash. Append-only; the control plane's tables
# above (principals, api_tokens, proposals, approvals, region_overrides) are caches of its fold.
control_log = Table(
    "control_log",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("prev_hash", String(64), nullable=False),
    Column("at_us", BigInteger, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("principal", String(128), nullable=False),
    Column("body", Text, nullable=False),  # canonical JSON
    Column("key_id", String(16), nullable=False),
    Column("signature", String(128), nullable=False),
    Column("entry_hash", String(64), nullable=False),
)

# The control log's head: one row, updated first in every appending transaction.
control_head = Table(
    "control_head",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("seq", BigInteger, nullable=False),
    Column("last_hash", String(64), nullable=False),
)
