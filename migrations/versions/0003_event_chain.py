"""Hash chain over region events: seq, prev_hash, row_hash and the one-row chain head.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

GENESIS = "0" * 64


def upgrade() -> None:
    with op.batch_alter_table("region_events") as batch:
        batch.add_column(sa.Column("seq", sa.BigInteger))
        batch.add_column(sa.Column("prev_hash", sa.String(64)))
        batch.add_column(sa.Column("row_hash", sa.String(64)))
        batch.create_unique_constraint("uq_region_events_seq", ["seq"])
    head = op.create_table(
        "event_chain",
        sa.Column("id", sa.Integer, autoincrement=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("last_hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_event_chain"),
    )
    op.bulk_insert(head, [{"id": 1, "seq": 0, "last_hash": GENESIS}])


def downgrade() -> None:
    op.drop_table("event_chain")
    with op.batch_alter_table("region_events") as batch:
        batch.drop_constraint("uq_region_events_seq", type_="unique")
        batch.drop_column("row_hash")
        batch.drop_column("prev_hash")
        batch.drop_column("seq")
