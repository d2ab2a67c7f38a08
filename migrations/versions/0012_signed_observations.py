"""Health observations signed by their node: ``key_id`` and ``signature`` on each row.

A node signs each of its observations with its own Ed25519 key over every other column
(gtm.fleet.observation_seal); a reader counts a peer's row only when it verifies with the key
the fleet's membership names for that node (the signed topology's ``fleet.members``). Rows
written before this revision have neither column and are refused until their node, upgraded,
writes them again (every state sync, half a second by default).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("health_observations") as batch:
        batch.add_column(sa.Column("key_id", sa.String(16), nullable=True))
        batch.add_column(sa.Column("signature", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("health_observations") as batch:
        batch.drop_column("signature")
        batch.drop_column("key_id")
