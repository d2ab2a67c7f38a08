"""Decisions partitioned by day on the real PostgreSQL (migration 0009): rows from before the
migration kept, partitions made ahead by an answering node with nothing more than its role,
least privilege on every partition, and retention that drops whole partitions while ``verify``
knows which rows went on purpose."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit import migrate, partitions
from gtm.audit.anchor import Anchor, read_store_id
from gtm.audit.checkpoints import DirectorySink
from gtm.audit.database import make_async_engine
from gtm.audit.retention import retain
from gtm.audit.schema import decisions
from gtm.audit.spool import Spool
from gtm.audit.verify import Verification, verify
from gtm.audit.writer import AuditWriter
from gtm.decision.snapshot import Snapshot
from tests.gtm.audit.test_audit import records

pytestmark = pytest.mark.postgres

DAY = 86_400.0
# Ten days ago at noon UTC: days whose partitions the migration did not make.
DAY0 = (time.time() // DAY - 10) * DAY + DAY / 2


def _day(t: float) -> str:
    return "decisions_p" + time.strftime("%Y%m%d", time.gmtime(t))


@dataclass
class Chain:
    writer: AuditWriter
    anchor: Anchor
    clock: list[float]

    async def answer(self, snapshot: Snapshot, at: float) -> None:
        """Three rows answered at ``at``, flushed and checkpointed."""
        self.clock[0] = at
        for n, record in enumerate(records(snapshot)):
            self.writer.count(record, n=n + 1)
        await self.writer.flush()
        await self.anchor.checkpoint("checkpoint")

    async def stop(self) -> None:
        await self.writer.stop()
        await self.anchor.stop()


async def _chain(engine: AsyncEngine, sink: DirectorySink, tmp: Path, node: str) -> Chain:
    clock = [DAY0]
    spool = Spool(tmp / f"spool-{node}", node)
    store = await read_store_id(engine)
    assert store is not None
    spool.bind(store)
    writer = AuditWriter(engine, node, spool, clock=lambda: clock[0])
    anchor = Anchor(engine, writer, spool, sink, interval_s=3600, events=False)
    await writer.start()
    await anchor.start()
    return Chain(writer, anchor, clock)


def _problems(result: Verification) -> str:
    return "\n".join(f"{b.node}#{b.node_seq}: {b.problem}" for b in result.breaks)


async def _where(engine: AsyncEngine) -> dict[str, list[tuple[str, int]]]:
    """Each partition's rows, as (node, node_seq)."""
    out: dict[str, list[tuple[str, int]]] = {}
    async with engine.connect() as conn:
        query = text("SELECT tableoid::regclass::text, node, node_seq FROM decisions")
        for part, node, seq in await conn.execute(query):
            out.setdefault(part, []).append((node, seq))
    return {part: sorted(rows) for part, rows in out.items()}


@pytest.fixture
async def owner(postgres_url: str) -> AsyncIterator[AsyncEngine]:
    """A migrated store, as the tables' owner (who runs retention)."""
    migrate.downgrade(postgres_url, "base")
    migrate.upgrade(postgres_url)
    engine = make_async_engine(postgres_url)
    yield engine
    await engine.dispose()


def _sql(url: str, statement: str) -> str | None:
    """None when ``statement`` succeeded, else the server's error message."""
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(False)
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(statement)
    except psycopg.Error as exc:
        return str(exc).splitlines()[0]
    return None


async def test_rows_from_before_the_migration_stay_and_the_chain_goes_on(
    postgres_url: str, tmp_path: Path, snapshot: Snapshot
) -> None:
    migrate.downgrade(postgres_url, "base")
    migrate.upgrade(postgres_url, "0008")  # one table
    engine = make_async_engine(postgres_url)
    sink = DirectorySink(tmp_path / "checkpoints")
    try:
        a = await _chain(engine, sink, tmp_path, "node-a")
        for day in range(2):
            await a.answer(snapshot, DAY0 + day * DAY)
        await a.stop()
        before = await _where(engine)
        assert list(before) == ["decisions"]
        await engine.dispose()

        migrate.upgrade(postgres_url)
        assert migrate.current_revision(postgres_url) == migrate.head_revision(postgres_url)
        # Kept where they were: the old table is the history partition, up to the day after
        # its newest row; daily partitions from there on.
        assert await _where(engine) == {"decisions_p_history": before["decisions"]}
        async with engine.connect() as conn:
            parts = await partitions.partitions(conn)
        history = parts[0]
        assert (history.name, history.lo_us) == ("decisions_p_history", None)
        assert history.hi_us == int((DAY0 // DAY + 2) * DAY * 1e6)
        assert parts[-1].default and _day(time.time() + 3 * DAY) in {p.name for p in parts}

        a = await _chain(engine, sink, tmp_path, "node-a")  # the same chain goes on
        await a.answer(snapshot, DAY0 + 5 * DAY)  # a day the writer made a partition for
        await a.stop()
        where = await _where(engine)
        assert where[_day(DAY0 + 5 * DAY)] == [("node-a", 7), ("node-a", 8), ("node-a", 9)]
        result = await verify(engine, sink)
        assert result.breaks == [], _problems(result)
        assert result.chains["node-a"].rows == 9

        # Down to one table and up again: every row kept, the chain intact.
        await engine.dispose()
        migrate.downgrade(postgres_url, "0008")
        assert list(await _where(engine)) == ["decisions"]
        # (Verified once back up: this code reads columns added after 0008.)
        assert _sql(postgres_url, "DELETE FROM decisions") is not None  # 0007's guard is back
        migrate.upgrade(postgres_url)
        assert (await verify(engine, sink)).breaks == []
    finally:
        await engine.dispose()


async def test_a_node_makes_partitions_ahead_on_its_role_and_cannot_touch_them(
    postgres_logins: dict[str, str], postgres_url: str, tmp_path: Path, snapshot: Snapshot
) -> None:
    node = make_async_engine(postgres_logins["gtm_node"])
    later = time.time() + 40 * DAY  # beyond the days the migration made
    try:
        a = await _chain(node, DirectorySink(tmp_path / "checkpoints"), tmp_path, "node-a")
        await a.answer(snapshot, later)
        await a.stop()
        assert a.writer.last_error is None
        part = _day(later)
        assert list(await _where(node)) == [part]  # made by the node's own writer
        async with node.connect() as conn:
            names = {p.name for p in await partitions.partitions(conn)}
        assert {_day(later + k * DAY) for k in range(-1, 8)} <= names
    finally:
        await node.dispose()
    node_url, reader = postgres_logins["gtm_node"], postgres_logins["gtm_reader"]
    for statement in (
        f"UPDATE {part} SET region = 'us-east'",
        f"DELETE FROM {part}",
        f"TRUNCATE {part}",
        f"INSERT INTO {part} SELECT * FROM decisions",
        "CREATE TABLE decisions_p99990101 PARTITION OF decisions FOR VALUES FROM (1) TO (2)",
    ):
        refused = _sql(node_url, statement)
        assert refused is not None and "permission denied" in refused, (statement, refused)
    assert "must be owner" in (_sql(node_url, f"DROP TABLE {part}") or "")
    # The owner holds every privilege; the triggers refuse on the new partition too.
    for statement in (f"UPDATE {part} SET region = 'us-east'", f"DELETE FROM {part}",
                      f"TRUNCATE {part}", "TRUNCATE decisions"):  # fmt: skip
        refused = _sql(postgres_url, statement)
        assert refused is not None and "append-only" in refused, (statement, refused)
    assert _sql(reader, f"SELECT count(*) FROM {part}") is None
    assert "permission denied" in (_sql(reader, "SELECT gtm_decisions_partitions(0, 1)") or "")


async def test_retention_drops_whole_partitions_and_verify_knows(
    owner: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    sink = DirectorySink(tmp_path / "checkpoints")
    a = await _chain(owner, sink, tmp_path, "node-a")
    b = await _chain(owner, sink, tmp_path, "node-b")
    for day in range(4):
        await a.answer(snapshot, DAY0 + day * DAY)
        await b.answer(snapshot, DAY0 + day * DAY)
    # node-b's clock steps back: its rows 13-15 follow day 3's in its chain but sit in day 1.
    await b.answer(snapshot, DAY0 + DAY)
    await a.stop()
    await b.stop()
    where = await _where(owner)
    assert [seq for _, seq in where[_day(DAY0 + DAY)] if _ == "node-b"] == [4, 5, 6, 13, 14, 15]
    answers = {c: r.answers for c, r in (await verify(owner, sink)).chains.items()}
    store = await read_store_id(owner)
    assert store is not None
    key = a.anchor.key

    async def retain_before(day: int) -> Any:
        before_us = int((DAY0 - DAY / 2 + day * DAY) * 1e6)  # midnight starting that day
        return await retain(owner, before_us, key=key, sink=sink, store=store)

    # Before day 2: day 0 goes whole (and the empty day before it, which the writer made);
    # day 1 keeps node-b's rows 13-15, so its rows of the cut prefixes are deleted one by one.
    first = await retain_before(2)
    assert [(c.chain, c.seq) for c in first.cuts] == [("node-a", 6), ("node-b", 6)]
    assert first.dropped == [_day(DAY0 - DAY), _day(DAY0)]
    assert first.deleted == 6  # rows 4-6 of both chains, in day 1
    where = await _where(owner)
    assert _day(DAY0) not in where
    assert where[_day(DAY0 + DAY)] == [("node-b", 13), ("node-b", 14), ("node-b", 15)]
    result = await verify(owner, sink)
    assert result.breaks == [], _problems(result)
    assert {c: r.answers for c, r in result.chains.items()} == answers
    assert [c.seq for c in result.cuts] == [6, 6]

    # Before day 4: everything of node-a up to day 3 and all of node-b (13-15 ended on day 1)
    # are cut; days 1 to 3 hold nothing else and go whole.
    second = await retain_before(4)
    assert [(c.chain, c.seq) for c in second.cuts] == [("node-a", 12), ("node-b", 15)]
    assert second.dropped == [_day(DAY0 + k * DAY) for k in (1, 2, 3)]
    assert second.deleted == 0
    assert await _where(owner) == {}
    result = await verify(owner, sink)
    assert result.breaks == [], _problems(result)
    assert {c: r.answers for c, r in result.chains.items()} == answers
    async with owner.connect() as conn:
        names = {p.name for p in await partitions.partitions(conn)}
        assert await conn.scalar(select(func.count()).select_from(decisions)) == 0
    # Partitions of days not over by the cut time stay, empty or not.
    assert _day(DAY0 + 4 * DAY) in names and _day(time.time() + 3 * DAY) in names
