"""The control plane: principals, API tokens, document versions, proposals and approvals; the
signed approval record on published documents; what each node has in force.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("documents") as batch:
        batch.add_column(sa.Column("version_id", sa.String(64)))
        batch.add_column(sa.Column("sequence", sa.BigInteger))
        batch.add_column(sa.Column("manifest", sa.Text))
        batch.add_column(sa.Column("signature", sa.String(128)))
    op.create_table(
        "node_status",
        sa.Column("node", sa.String(64)),
        sa.Column("observer", sa.String(64), nullable=False),
        sa.Column("updated_at_us", sa.BigInteger, nullable=False),
        sa.Column("document_sequence", sa.BigInteger),
        sa.Column("snapshot_version", sa.BigInteger, nullable=False),
        sa.Column("topology_version", sa.String(32), nullable=False),
        sa.Column("policy_version", sa.String(32), nullable=False),
        sa.Column("regions", sa.JSON, nullable=False),
        sa.PrimaryKeyConstraint("node", name="pk_node_status"),
    )
    op.create_table(
        "principals",
        sa.Column("id", sa.String(32)),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("roles", sa.JSON, nullable=False),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("disabled", sa.Boolean, nullable=False),
        sa.Column("seal", sa.String(160)),
        sa.PrimaryKeyConstraint("id", name="pk_principals"),
        sa.UniqueConstraint("name", name="uq_principals_name"),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(32)),
        sa.Column("principal_id", sa.String(32), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("expires_at_us", sa.BigInteger),
        sa.Column("revoked_at_us", sa.BigInteger),
        sa.Column("last_used_at_us", sa.BigInteger),
        sa.Column("seal", sa.String(160)),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
    )
    op.create_index("ix_api_tokens_principal_id", "api_tokens", ["principal_id"])
    op.create_table(
        "document_versions",
        sa.Column("id", sa.String(64)),
        sa.Column("topology", sa.Text, nullable=False),
        sa.Column("policies", sa.JSON, nullable=False),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_document_versions"),
    )
    op.create_table(
        "proposals",
        sa.Column("id", _BigId, autoincrement=True),
        sa.Column("version_id", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("author_id", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("base_version_id", sa.String(64)),
        sa.Column("required_approvals", sa.Integer, nullable=False),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.Column("updated_at_us", sa.BigInteger, nullable=False),
        sa.Column("activate_at_us", sa.BigInteger),
        sa.Column("activate_by", sa.String(32)),
        sa.Column("activated_at_us", sa.BigInteger),
        sa.Column("sequence", sa.BigInteger),
        sa.Column("seal", sa.String(160)),
        sa.PrimaryKeyConstraint("id", name="pk_proposals"),
        sa.UniqueConstraint("sequence", name="uq_proposals_sequence"),
    )
    op.create_table(
        "approvals",
        sa.Column("proposal_id", sa.BigInteger),
        sa.Column("principal_id", sa.String(32)),
        sa.Column("version_id", sa.String(64), nullable=False),
        sa.Column("at_us", sa.BigInteger, nullable=False),
        sa.Column("comment", sa.Text, nullable=False),
        sa.Column("seal", sa.String(160)),
        sa.PrimaryKeyConstraint("proposal_id", "principal_id", name="pk_approvals"),
    )


def downgrade() -> None:
    op.drop_table("approvals")
    op.drop_table("proposals")
    op.drop_table("document_versions")
    op.drop_index("ix_api_tokens_principal_id", table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_table("principals")
    op.drop_table("node_status")
    with op.batch_alter_table("documents") as batch:
        batch.drop_column("signature")
        batch.drop_column("manifest")
        batch.drop_column("sequence")
        batch.drop_column("version_id")
