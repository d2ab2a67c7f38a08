"""Least privilege on PostgreSQL: roles for answering nodes, admin nodes and readers; the
evidence tables append-only, enforced by privileges and by triggers.

Roles (NOLOGIN; give each node its own login that is a member of one):

* ``gtm_node`` (answering nodes): reads everything; may only INSERT into the evidence tables
  (``decisions``, ``region_events``, ``audit_checkpoints``); writes the shared state it owns
  (the event chain's head, health observations, node status, capacity-report marks).
* ``gtm_admin`` (nodes serving the admin API): ``gtm_node`` and the control plane's tables
  (principals, tokens, versions, proposals, approvals, published documents, overrides).
* ``gtm_reader`` (auditors, reports): SELECT only.

Triggers refuse UPDATE, DELETE and TRUNCATE on the evidence tables whoever asks, the tables'
owner included: the one exception is DELETE inside ``gtm audit retain`` (the session sets
``gtm.retention``, which only a role with DELETE can use, and the cut is signed and recorded
outside the database first). A superuser can still switch triggers off; what it then changes
is found by ``gtm audit verify`` against the checkpoints outside the database.

Nothing here on SQLite: an embedded file has no roles; the checkpoints are its protection.
Migrations (this one included) run as the tables' owner (``gtm db upgrade``); nodes with these
roles set ``GTM_MIGRATE_ON_START=false``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

EVIDENCE = ("decisions", "region_events", "audit_checkpoints")
NODE_STATE = {
    "event_chain": "UPDATE",
    "health_observations": "INSERT, UPDATE",
    "node_status": "INSERT, UPDATE",
    "capacity_marks": "INSERT, UPDATE",
}
ADMIN_STATE = {
    "principals": "INSERT, UPDATE",
    "api_tokens": "INSERT, UPDATE",
    "document_versions": "INSERT",
    "proposals": "INSERT, UPDATE",
    "approvals": "INSERT, DELETE",
    "documents": "INSERT",
    "region_overrides": "INSERT, UPDATE, DELETE",
}
ROLES = ("gtm_node", "gtm_admin", "gtm_reader")

_GUARD = """
CREATE OR REPLACE FUNCTION gtm_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('gtm.retention', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'gtm: % on % refused: audit evidence is append-only', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'old rows leave only through gtm audit retain, which signs the cut';
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # Roles and memberships are the cluster's, shared by its databases: two databases migrated
    # at once both find a role missing and both create it, and the later insert fails on the
    # catalog's unique index once the first commits. That one's role is the role wanted.
    for role in ROLES:
        op.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') "
            f"THEN CREATE ROLE {role} NOLOGIN; END IF; "
            "EXCEPTION WHEN unique_violation OR duplicate_object THEN NULL; END $$"
        )
    op.execute(
        "DO $$ BEGIN GRANT gtm_node TO gtm_admin; EXCEPTION WHEN unique_violation THEN NULL; END $$"
    )
    for role in ROLES:
        op.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    op.execute("GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO gtm_node")
    for table in EVIDENCE:
        op.execute(f"GRANT INSERT ON {table} TO gtm_node")
    for table, rights in NODE_STATE.items():
        op.execute(f"GRANT {rights} ON {table} TO gtm_node")
    for table, rights in ADMIN_STATE.items():
        op.execute(f"GRANT {rights} ON {table} TO gtm_admin")
    op.execute(_GUARD)
    for table in EVIDENCE:
        op.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION gtm_append_only()"
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION gtm_append_only()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in EVIDENCE:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table}")
        op.execute(f"DROP TRIGGER IF EXISTS {table}_append_only ON {table}")
    op.execute("DROP FUNCTION IF EXISTS gtm_append_only()")
    # The roles are the cluster's (other databases may use them): their rights on this
    # schema's tables go, the roles stay.
    for role in ROLES:
        op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
        op.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {role}")
        op.execute(f"REVOKE ALL ON SCHEMA public FROM {role}")
