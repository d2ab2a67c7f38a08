"""Decisions partitioned by time on PostgreSQL: a partition per UTC day of ``first_at_us``, so
retention drops whole partitions instead of deleting rows (gtm.audit.retention).

The existing table is not copied: it becomes the first partition, ``decisions_p_history``,
holding everything before the day after its newest row (an empty table is dropped instead).
Then come daily partitions ``decisions_pYYYYMMDD``, and ``decisions_p_default`` for any row no
daily partition takes yet, so an insert never fails for want of a partition.

Daily partitions are made ahead of time by ``gtm_decisions_partitions(from_us, to_us)``: the
migration calls it for the days around now, and every node's writer calls it about once an hour
for the week ahead (gtm.audit.partitions). It is ``SECURITY DEFINER`` (it runs as the tables'
owner, with a fixed search path), because creating a partition needs ownership of the table and
answering nodes (``gtm_node``, migration 0007) own nothing; ``gtm_node`` may execute it, nothing
more. It waits at most a second for its lock (an insert stalled behind it waits no longer) and
skips a day whose rows already went to the default partition.

Least privilege holds on every partition, present and future (0007): the row trigger refusing
UPDATE and DELETE is defined on the partitioned table, which PostgreSQL clones onto each
partition; the TRUNCATE trigger is per table in PostgreSQL, so each partition gets its own;
partitions grant SELECT to the three roles and INSERT to no one (rows go in through
``decisions``, whose grants are 0007's). Dropping a partition needs ownership, as dropping the
table did; what an owner drops outside ``gtm audit retain`` is a break in ``gtm audit verify``.

A unique index over all partitions must contain the partition key, so (node, node_seq) is
unique within each partition (the writer never repeats a sequence; ``verify`` reports a
repeated one as a break wherever it lands).

Nothing here on SQLite: the embedded store stays one table.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

DAY_US = 86_400 * 1_000_000
AHEAD_DAYS = 8
ROLES = "gtm_node, gtm_admin, gtm_reader"
INDEXES = {"first_at_us": "first_at_us", "region": "region", "outcome": "outcome"}

# What every partition gets (the history partition has its own from 0001 and 0007).
_SETUP = """
CREATE OR REPLACE FUNCTION gtm_decisions_partition_setup(part text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('CREATE UNIQUE INDEX %I ON %I (node, node_seq)', part || '_node_seq', part);
    EXECUTE format('CREATE TRIGGER decisions_no_truncate BEFORE TRUNCATE ON %I '
                   'FOR EACH STATEMENT EXECUTE FUNCTION gtm_append_only()', part);
    EXECUTE format('GRANT SELECT ON %I TO gtm_node, gtm_admin, gtm_reader', part);
END
$$
"""

_AHEAD = """
CREATE OR REPLACE FUNCTION gtm_decisions_partitions(from_us bigint, to_us bigint)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
DECLARE
    day_us constant bigint := 86400000000;
    lo bigint := floor(from_us::numeric / day_us)::bigint * day_us;
    part text;
    made integer := 0;
BEGIN
    -- An insert queued behind this lock waits at most this long; the day is tried next time.
    PERFORM set_config('lock_timeout', '1000', true);
    WHILE lo < to_us LOOP
        part := 'decisions_p' || to_char(to_timestamp(lo / 1000000.0) AT TIME ZONE 'UTC',
                                         'YYYYMMDD');
        IF to_regclass(quote_ident(part)) IS NULL THEN
            BEGIN
                EXECUTE format('CREATE TABLE %I PARTITION OF decisions '
                               'FOR VALUES FROM (%s) TO (%s)', part, lo, lo + day_us);
                PERFORM gtm_decisions_partition_setup(part);
                made := made + 1;
            EXCEPTION
                -- The day is inside the history partition: nothing to make.
                WHEN invalid_object_definition THEN NULL;
                -- Rows of that day already went to the default partition: they stay there.
                WHEN check_violation THEN NULL;
                WHEN lock_not_available THEN RETURN made;
            END;
        END IF;
        lo := lo + day_us;
    END LOOP;
    RETURN made;
END
$$
"""

_GUARDS = (
    "CREATE TRIGGER decisions_append_only BEFORE UPDATE OR DELETE ON decisions "
    "FOR EACH ROW EXECUTE FUNCTION gtm_append_only()",
    "CREATE TRIGGER decisions_no_truncate BEFORE TRUNCATE ON decisions "
    "FOR EACH STATEMENT EXECUTE FUNCTION gtm_append_only()",
    f"GRANT SELECT ON decisions TO {ROLES}",
    "GRANT INSERT ON decisions TO gtm_node",
)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    schema = bind.execute(sa.text("SELECT current_schema()")).scalar_one()
    newest = bind.execute(sa.text("SELECT max(first_at_us) FROM decisions")).scalar()
    history = "decisions_p_history"
    op.execute(f"ALTER TABLE decisions RENAME TO {history}")
    # Its primary key (id) would be a second one beside the partitioned table's (id, time);
    # its other indexes keep their work under partition names, and become the partition's
    # part of the partitioned table's indexes below.
    op.execute(f"ALTER TABLE {history} DROP CONSTRAINT pk_decisions")
    op.execute(
        f"ALTER TABLE {history} RENAME CONSTRAINT uq_decisions_node_seq TO {history}_node_seq"
    )
    for name in INDEXES:
        op.execute(f"ALTER INDEX ix_decisions_{name} RENAME TO {history}_{name}")
    # The partitioned table's row trigger is cloned onto each partition, under the same name.
    op.execute(f"DROP TRIGGER decisions_append_only ON {history}")
    op.execute(
        f"CREATE TABLE decisions (LIKE {history} INCLUDING DEFAULTS) "
        "PARTITION BY RANGE (first_at_us)"
    )
    op.execute("ALTER SEQUENCE decisions_id_seq OWNED BY decisions.id")
    op.execute(f"ALTER TABLE {history} ALTER COLUMN id DROP DEFAULT")
    if newest is None:
        op.execute(f"DROP TABLE {history}")
    else:
        bound = (int(newest) // DAY_US + 1) * DAY_US
        op.execute(
            f"ALTER TABLE decisions ATTACH PARTITION {history} "
            f"FOR VALUES FROM (MINVALUE) TO ({bound})"
        )
        op.execute(f"REVOKE INSERT ON {history} FROM gtm_node")  # rows go in through decisions
    op.execute("ALTER TABLE decisions ADD CONSTRAINT pk_decisions PRIMARY KEY (id, first_at_us)")
    for name, column in INDEXES.items():
        op.execute(f"CREATE INDEX ix_decisions_{name} ON decisions ({column})")
    for statement in _GUARDS:
        op.execute(statement)
    op.execute(_SETUP)
    op.execute(_AHEAD.format(schema=f'"{schema}"'))
    op.execute("REVOKE ALL ON FUNCTION gtm_decisions_partition_setup(text) FROM PUBLIC")
    op.execute("REVOKE ALL ON FUNCTION gtm_decisions_partitions(bigint, bigint) FROM PUBLIC")
    op.execute("GRANT EXECUTE ON FUNCTION gtm_decisions_partitions(bigint, bigint) TO gtm_node")
    op.execute("CREATE TABLE decisions_p_default PARTITION OF decisions DEFAULT")
    op.execute("SELECT gtm_decisions_partition_setup('decisions_p_default')")
    today = int(time.time()) * 1_000_000 // DAY_US * DAY_US
    op.execute(f"SELECT gtm_decisions_partitions({today - DAY_US}, {today + AHEAD_DAYS * DAY_US})")


def downgrade() -> None:
    """One table again, every row kept (partitions dropped only after their rows are copied)."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION gtm_decisions_partitions(bigint, bigint)")
    op.execute("DROP FUNCTION gtm_decisions_partition_setup(text)")
    op.execute("CREATE TABLE decisions_flat (LIKE decisions INCLUDING DEFAULTS)")
    op.execute("INSERT INTO decisions_flat SELECT * FROM decisions")
    op.execute("ALTER SEQUENCE decisions_id_seq OWNED BY decisions_flat.id")
    op.execute("DROP TABLE decisions")  # and every partition
    op.execute("ALTER TABLE decisions_flat RENAME TO decisions")
    op.execute("ALTER TABLE decisions ADD CONSTRAINT pk_decisions PRIMARY KEY (id)")
    op.execute("ALTER TABLE decisions ADD CONSTRAINT uq_decisions_node_seq UNIQUE (node, node_seq)")
    for name, column in INDEXES.items():
        op.execute(f"CREATE INDEX ix_decisions_{name} ON decisions ({column})")
    for statement in _GUARDS:
        op.execute(statement)
