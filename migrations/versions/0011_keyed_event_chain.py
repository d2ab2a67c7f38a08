"""The region events' chain keyed by its writers: each row's key id and signature.

Every region event is signed by the audit key of the process that wrote it (Ed25519 over its
``row_hash``, :mod:`gtm.audit.event_chain`): the database is untrusted storage, and an unkeyed
chain can be extended or cut back by anyone who holds its password. Rows written before this
revision have neither column; ``gtm audit verify`` reports them as unsigned (nobody can vouch
for them now), with their sequence numbers.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("region_events") as batch:
        batch.add_column(sa.Column("key_id", sa.String(16)))
        batch.add_column(sa.Column("signature", sa.String(128)))


def downgrade() -> None:
    with op.batch_alter_table("region_events") as batch:
        batch.drop_column("signature")
        batch.drop_column("key_id")
