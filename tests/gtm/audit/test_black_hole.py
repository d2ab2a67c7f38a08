"""The audit writer across a black-hole cut of its database (issue 33): a proxy in front of
the real PostgreSQL that stops forwarding without closing anything, as a dropped route does.

On the old writer a drain waited on its silent connection with no deadline (the COPY open on
the server, every spool gauge at 0, no failure counted), and once the route was back it rested
six times as long as it had hung before it tried again: rows arrived minutes after the heal.
Here a drain that makes no progress within its deadline is abandoned and counted, the gauges
count every spooled row, and after the heal the rows catch up within a few retries: conditions
polled for, never a timing measured.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import event, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit import migrate, query
from gtm.audit.anchor import Anchor, read_store_id
from gtm.audit.checkpoints import DirectorySink
from gtm.audit.database import make_async_engine
from gtm.audit.schema import decisions
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.decision.snapshot import Snapshot
from tests.gtm.audit.test_audit import records
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import eventually

pytestmark = pytest.mark.postgres

WITHIN_S = 60.0  # generous: a condition polled for, not a timing the test measures
DEADLINE_S = 1.0  # the writer's deadline here (10 s by default): the test waits on it


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_black_hole_cut_is_caught_counted_and_caught_up_after_the_heal(
    postgres_url: str, tmp_path: Path, snapshot: Snapshot
) -> None:
    migrate.downgrade(postgres_url, "base")
    migrate.upgrade(postgres_url)
    proxy, direct, engine, spool = await _behind_a_proxy(postgres_url, tmp_path)
    writer = AuditWriter(engine, "node-a", spool, flush_interval=0.05, db_timeout_s=DEADLINE_S)
    await writer.start()
    try:

        def count_a_window(k: int) -> None:
            for n, record in enumerate(records(snapshot)):
                writer.count(record, n=k + n + 1)

        async def all_in() -> bool:
            return await query.total_count(direct) == writer.counted

        count_a_window(0)
        await eventually(all_in, WITHIN_S, "the first window in the database")

        failures = _metric("gtm_audit_flush_failures_total")
        # The cut lands in the middle of a drain: the table is locked so the drain's insert
        # waits on the server, the route goes silent, then the lock is let go (the server's
        # answer now goes into the hole).
        async with direct.connect() as locker:
            await locker.execute(text("LOCK TABLE decisions IN ACCESS EXCLUSIVE MODE"))
            count_a_window(1)
            await eventually(lambda: _waiting_on_the_lock(direct), WITHIN_S, "drain in flight")
            proxy.blackhole()
            await locker.rollback()
        # The drain in the hole is given up at its deadline, and said so (the old writer
        # waited there for ever: no failure counted, every gauge 0).
        await eventually(
            lambda: _metric("gtm_audit_flush_failures_total") > failures,
            WITHIN_S,
            "the hung drain given up and counted",
        )
        assert writer.last_error is not None and "no progress" in writer.last_error
        for k in range(2, 5):  # more windows while the cut lasts, each sealed on its own
            sealed = writer._seq
            count_a_window(k)
            await eventually(lambda s=sealed: writer._seq > s, WITHIN_S, f"window {k} sealed")

        async def gauge_counts_every_spooled_row() -> bool:
            sealed_not_in = writer._seq - await _max_seq(direct)
            return sealed_not_in >= 4 * len(records(snapshot)) and (
                _metric("gtm_audit_spooled_rows") == sealed_not_in
            )

        await eventually(gauge_counts_every_spooled_row, WITHIN_S, "every spooled row counted")
        assert _metric("gtm_audit_spool_bytes") > 0
        assert await query.total_count(direct) < writer.counted

        proxy.heal()
        healed_at = _metric("gtm_audit_flush_failures_total")
        await eventually(all_in, WITHIN_S, "every answer in the database after the heal")
        # Caught up within a few retries of the heal: the drain hung at the heal is given up
        # once; the next one, on a new connection, goes through (no rest grown from the hang).
        assert _metric("gtm_audit_flush_failures_total") - healed_at <= 2
        await eventually(lambda: _metric("gtm_audit_spooled_rows") == 0, WITHIN_S, "gauge 0")
        # Nothing the cut froze is still held open by the writer.
        await eventually(lambda: proxy.frozen_open() == 0, WITHIN_S, "frozen sockets closed")
    finally:
        await asyncio.wait_for(writer.stop(), WITHIN_S)
        await _let_go(proxy, direct, engine)


async def test_a_checkpoint_cut_off_mid_write_is_given_up_and_the_anchor_stops(
    postgres_url: str, tmp_path: Path
) -> None:
    """The anchor wrote a checkpoint's database copy with no deadline: a route gone silent
    while the insert waited for its answer held the anchor, and the node's stop with it, for
    good (the admin rollout test hung in ``b.stop()`` this way). The write is now watched: given
    up at its deadline and counted, the sink keeps the checkpoint, and the stop returns."""
    migrate.upgrade(postgres_url)
    proxy, direct, engine, spool = await _behind_a_proxy(postgres_url, tmp_path)
    writer = AuditWriter(engine, "node-a", spool, db_timeout_s=DEADLINE_S)
    sink = DirectorySink(tmp_path / "checkpoints")
    anchor = Anchor(engine, writer, spool, sink, interval_s=3600, db_deadline_s=DEADLINE_S)
    cut: list[str] = []

    def cut_as_the_insert_goes(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if "audit_checkpoints" in statement and not cut:
            cut.append(statement)
            proxy.blackhole()  # the insert is sent; its answer never comes

    await writer.start()
    await anchor.start()
    try:
        event.listen(engine.sync_engine, "before_cursor_execute", cut_as_the_insert_goes)
        failed = _metric("gtm_audit_checkpoint_failures_total", where="database")
        written = await asyncio.wait_for(anchor.checkpoint("checkpoint", force=True), WITHIN_S)
        assert cut, "the insert was cut off"
        assert written == 1  # in the sink, which verification trusts
        assert _metric("gtm_audit_checkpoint_failures_total", where="database") > failed
        # The stop's own last checkpoint meets the same silence, and gives up the same way.
        await asyncio.wait_for(anchor.stop(), WITHIN_S)
    finally:
        await asyncio.wait_for(writer.stop(), WITHIN_S)
        await _let_go(proxy, direct, engine)


async def _behind_a_proxy(
    postgres_url: str, tmp_path: Path
) -> tuple[TcpProxy, AsyncEngine, AsyncEngine, Spool]:
    """A proxy in front of the server; an engine straight to it, one through the proxy (as
    the writer's: unpooled, with the test's deadline), and a spool bound to the store."""
    server = make_url(postgres_url)
    proxy = TcpProxy(server.host or "127.0.0.1", server.port or 5432)
    await proxy.start()
    through = server.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    direct = make_async_engine(postgres_url)
    engine = make_async_engine(through, silence_s=DEADLINE_S, pooled=False)
    spool = Spool(tmp_path / "spool", "node-a")
    store = await read_store_id(direct)
    assert store is not None
    spool.bind(store)
    return proxy, direct, engine, spool


async def _let_go(proxy: TcpProxy, *engines: AsyncEngine) -> None:
    for engine in engines:
        await engine.dispose()
    await proxy.stop()


async def _waiting_on_the_lock(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        waiting = await conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        )
    return bool(waiting)


async def _max_seq(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        value = await conn.scalar(
            select(func.coalesce(func.max(decisions.c.node_seq), 0)).where(
                decisions.c.node == "node-a"
            )
        )
    return int(value or 0)
