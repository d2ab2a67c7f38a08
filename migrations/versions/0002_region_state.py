"""Shared region state: region events, health observations, operator overrides, documents.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "region_events",
        sa.Column("id", _BigId, primary_key=True, autoincrement=True),
        sa.Column("at_us", sa.BigInteger, nullable=False),
        sa.Column("node", sa.String(64), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16)),
        sa.Column("previous", sa.String(16)),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("actor", sa.String(128)),
        sa.Column("reason", sa.Text),
        sa.PrimaryKeyConstraint("id", name="pk_region_events"),
    )
    op.create_index("ix_region_events_at_us", "region_events", ["at_us"])
    op.create_index("ix_region_events_region", "region_events", ["region"])
    op.create_table(
        "health_observations",
        sa.Column("node", sa.String(64), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("since_us", sa.BigInteger, nullable=False),
        sa.Column("observed_at_us", sa.BigInteger, nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("node", "region", name="pk_health_observations"),
    )
    op.create_table(
        "region_overrides",
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("drain", sa.Boolean, nullable=False),
        sa.Column("weight", sa.Float),
        sa.Column("force", sa.String(8)),
        sa.Column("force_until_us", sa.BigInteger),
        sa.Column("expires_at_us", sa.BigInteger),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("set_at_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("region", name="pk_region_overrides"),
    )
    op.create_table(
        "documents",
        sa.Column("id", _BigId, primary_key=True, autoincrement=True),
        sa.Column("published_at_us", sa.BigInteger, nullable=False),
        sa.Column("topology", sa.Text, nullable=False),
        sa.Column("policies", sa.JSON, nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_documents"),
    )


def downgrade() -> None:
    op.drop_table("documents")
    op.drop_table("region_overrides")
    op.drop_table("health_observations")
    op.drop_index("ix_region_events_region", table_name="region_events")
    op.drop_index("ix_region_events_at_us", table_name="region_events")
    op.drop_table("region_events")
