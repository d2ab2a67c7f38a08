"""The decisions table's time partitions on PostgreSQL (migration 0009); nothing on SQLite.

A partition per UTC day of ``first_at_us`` (``decisions_pYYYYMMDD``), the rows from before the
migration in ``decisions_p_history``, and ``decisions_p_default`` for a row no daily partition
takes yet. Days are made ahead by the database function ``gtm_decisions_partitions``, which an
answering node's role may execute (it runs as the tables' owner); every writer calls it through
:func:`ensure` at start and about once an hour for the week ahead, so no single maintenance job
has to stay alive for inserts to land in their day.

Retention (:mod:`gtm.audit.retention`) drops a partition whole when every row in it belongs to
the prefix its chain's signed cut removed (:func:`covered`); rows of a partition it cannot drop
are deleted one by one instead. Whether a partition can go is read from its rows, never assumed
from its bounds: a chain's rows follow its sequence, and their times only nearly so (a window
sealed late), so a row of a kept part of a chain can sit in an old day.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

DAY_US = 86_400 * 1_000_000
AHEAD_DAYS = 7

_BOUNDS = re.compile(r"FROM \((.+?)\) TO \((.+?)\)")


@dataclass(frozen=True, slots=True)
class Partition:
    name: str
    lo_us: int | None  # None: no lower bound (the history partition)
    hi_us: int | None  # None: the default partition (no bounds)

    @property
    def default(self) -> bool:
        return self.hi_us is None and self.lo_us is None


def _bound(value: str) -> int | None:
    value = value.strip().strip("'")
    return None if value in ("MINVALUE", "MAXVALUE") else int(value)


def partitioned(conn: AsyncConnection) -> bool:
    return conn.dialect.name == "postgresql"


async def ensure(conn: AsyncConnection, now: float, ahead_days: int = AHEAD_DAYS) -> int:
    """Make the daily partitions from yesterday to ``ahead_days`` on, where missing; returns
    how many were made. Commits. A no-op on SQLite."""
    if not partitioned(conn):
        return 0
    today = int(now * 1_000_000) // DAY_US * DAY_US
    made = await conn.scalar(
        text("SELECT gtm_decisions_partitions(:lo, :hi)"),
        {"lo": today - DAY_US, "hi": today + (ahead_days + 1) * DAY_US},
    )
    await conn.commit()
    return int(made or 0)


async def partitions(conn: AsyncConnection) -> list[Partition]:
    """The decisions table's partitions, oldest first (the default partition last)."""
    if not partitioned(conn):
        return []
    rows = await conn.execute(
        text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass('decisions')"
        )
    )
    out = []
    for name, bound in rows:
        found = _BOUNDS.search(bound or "")
        if found is None:  # DEFAULT
            out.append(Partition(str(name), None, None))
        else:
            out.append(Partition(str(name), _bound(found.group(1)), _bound(found.group(2))))
    far = 2**63
    return sorted(out, key=lambda p: (p.default, far if p.hi_us is None else p.hi_us))


def _quote(conn: AsyncConnection, name: str) -> str:
    return conn.dialect.identifier_preparer.quote(name)


async def covered(conn: AsyncConnection, partition: str, through: Mapping[str, int]) -> bool:
    """Whether every row of ``partition`` is in its chain's removed prefix: ``node_seq`` at
    most ``through[node]``. Reads the partition's (node, node_seq) index, a few lookups per
    chain, however many rows it holds."""
    table = _quote(conn, partition)
    last: str | None = None
    while True:
        if last is None:
            node = await conn.scalar(text(f"SELECT min(node) FROM {table}"))
        else:
            node = await conn.scalar(
                text(f"SELECT min(node) FROM {table} WHERE node > :last"), {"last": last}
            )
        if node is None:
            return True
        newest = await conn.scalar(
            text(f"SELECT max(node_seq) FROM {table} WHERE node = :node"), {"node": node}
        )
        if newest is None or int(newest) > through.get(str(node), 0):
            return False
        last = str(node)


async def drop_if_covered(
    conn: AsyncConnection, partition: str, through: Mapping[str, int]
) -> bool:
    """Drop ``partition`` if every row in it is :func:`covered` (the caller has recorded the
    cuts), checked under the table's lock: a row a node replays from its spool into an old day
    cannot land between the check and the drop. The lock is waited for at most five seconds
    (inserts queue behind it meanwhile) and held for a few index lookups."""
    await conn.execute(text("SET LOCAL lock_timeout = '5s'"))
    await conn.execute(text("LOCK TABLE decisions IN ACCESS EXCLUSIVE MODE"))
    if not await covered(conn, partition, through):
        return False
    await conn.execute(text(f"DROP TABLE {_quote(conn, partition)}"))
    return True


__all__ = [
    "AHEAD_DAYS",
    "DAY_US",
    "Partition",
    "covered",
    "drop_if_covered",
    "ensure",
    "partitioned",
    "partitions",
]
