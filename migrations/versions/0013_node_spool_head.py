"""Each node's audit spool in its status report: ``audit_sealed_seq`` and ``audit_drained_seq``.

A node seals its decision rows into its local spool before the database takes them (during an
outage or a black-holed connection, for minutes). Its checkpoints vouch for what it sealed, so
until the spool drains ``gtm audit verify`` saw a tail that only the node still holds. The node
now reports the newest sequence it sealed and the newest it knows the database holds; verify
calls the rows between them spooled, not gone (gtm.audit.verify). Rows written before this
revision have neither column: such a node reports no spool, and a missing tail stays a break.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_status") as batch:
        batch.add_column(sa.Column("audit_sealed_seq", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("audit_drained_seq", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_status") as batch:
        batch.drop_column("audit_drained_seq")
        batch.drop_column("audit_sealed_seq")
