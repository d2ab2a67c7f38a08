"""Evidence outside the rows: the store's identity and the chains' signed checkpoints; the
capacity reports' marks (replay protection across restarts and nodes).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

import time
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    store = op.create_table(
        "audit_store",
        sa.Column("id", sa.String(36)),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_store"),
    )
    # Made once, here: every spool and checkpoint of this store names it.
    op.bulk_insert(store, [{"id": str(uuid.uuid4()), "created_at_us": int(time.time() * 1e6)}])
    op.create_table(
        "audit_checkpoints",
        sa.Column("id", _BigId, autoincrement=True),
        sa.Column("chain", sa.String(80), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("head", sa.String(64), nullable=False),
        sa.Column("answers", sa.BigInteger, nullable=False),
        sa.Column("at_us", sa.BigInteger, nullable=False),
        sa.Column("store", sa.String(36), nullable=False),
        sa.Column("key_id", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_checkpoints"),
    )
    op.create_index("ix_audit_checkpoints_chain", "audit_checkpoints", ["chain"])
    op.create_table(
        "capacity_marks",
        sa.Column("node", sa.String(64)),
        sa.Column("region", sa.String(64)),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("node", "region", name="pk_capacity_marks"),
    )


def downgrade() -> None:
    op.drop_table("capacity_marks")
    op.drop_index("ix_audit_checkpoints_chain", table_name="audit_checkpoints")
    op.drop_table("audit_checkpoints")
    op.drop_table("audit_store")
