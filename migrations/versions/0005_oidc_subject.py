"""Principals may be bound to an OIDC subject (gtm.admin.oidc).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("principals") as batch:
        batch.add_column(sa.Column("oidc_subject", sa.String(255)))
        batch.create_unique_constraint("uq_principals_oidc_subject", ["oidc_subject"])


def downgrade() -> None:
    with op.batch_alter_table("principals") as batch:
        batch.drop_constraint("uq_principals_oidc_subject", type_="unique")
        batch.drop_column("oidc_subject")
