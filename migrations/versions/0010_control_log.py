"""The control log: one append-only, signed, hash-chained log of everything that moves
traffic, grants power or counts as evidence (gtm.control). The control plane's tables
(principals, tokens, proposals, approvals, overrides) become caches folded from it.

``control_log`` holds the entries; ``control_head`` is its one-row head, updated first in every
appending transaction so concurrent admin nodes queue on it and never fork the log. On
PostgreSQL the log is append-only by trigger, like the other evidence tables (migration 0007).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "control_log",
        sa.Column("seq", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("at_us", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("principal", sa.String(128), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("key_id", sa.String(16), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.Column("entry_hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_control_log"),
    )
    op.create_table(
        "control_head",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("last_hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_control_head"),
    )
    op.execute(
        "INSERT INTO control_head (id, seq, last_hash) VALUES "
        "(1, 0, '0000000000000000000000000000000000000000000000000000000000000000')"
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("GRANT SELECT ON control_log, control_head TO gtm_node, gtm_reader")
        op.execute("GRANT INSERT ON control_log TO gtm_admin")
        op.execute("GRANT UPDATE ON control_head TO gtm_admin")
        op.execute(
            "CREATE TRIGGER control_log_append_only BEFORE UPDATE OR DELETE ON control_log "
            "FOR EACH ROW EXECUTE FUNCTION gtm_append_only()"
        )
        op.execute(
            "CREATE TRIGGER control_log_no_truncate BEFORE TRUNCATE ON control_log "
            "FOR EACH STATEMENT EXECUTE FUNCTION gtm_append_only()"
        )


def downgrade() -> None:
    op.drop_table("control_head")
    op.drop_table("control_log")
