"""Checkpoint lookups that do not grow with the store: each chain's newest checkpoint by
(chain, id), and the gaps and cuts by kind (``GET /v1/audit/chains`` reads both on every poll;
a node writes a checkpoint per chain every ten seconds, millions a year).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_audit_checkpoints_chain_id", "audit_checkpoints", ["chain", "id"])
    op.create_index("ix_audit_checkpoints_kind", "audit_checkpoints", ["kind", "chain"])
    # (chain, id) serves every lookup by chain the old index did.
    op.drop_index("ix_audit_checkpoints_chain", table_name="audit_checkpoints")


def downgrade() -> None:
    op.create_index("ix_audit_checkpoints_chain", "audit_checkpoints", ["chain"])
    op.drop_index("ix_audit_checkpoints_kind", table_name="audit_checkpoints")
    op.drop_index("ix_audit_checkpoints_chain_id", table_name="audit_checkpoints")
