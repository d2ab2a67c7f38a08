"""A database slower than the flush interval: every window still reaches the spool on time, and
the windows that queued up are inserted from memory once it lets them in.

Before sealing and draining took separate locks, a flush whose insert waited held every later
window's tallies in memory: a kill -9 then lost all of them (bench/crash_loss.py: 97% of four
seconds of answers at 50,000 a second). Here a PostgreSQL lock holds the inserts for as long as
the test likes, deterministically; on the old writer the second window never reached the spool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from gtm.audit import migrate, query
from gtm.audit.anchor import read_store_id
from gtm.audit.database import make_async_engine
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.decision.snapshot import Snapshot
from tests.gtm.audit.test_audit import records
from tests.support.waiting import eventually

WITHIN_S = 60.0  # generous: a condition polled for, not a timing the test measures


def _spooled(spool: Spool) -> int:
    head = spool.chain_head()  # saved after each append's fsync
    return 0 if head is None else head.answers


async def _windows_under_a_locked_table(
    postgres_url: str,
    tmp_path: Path,
    snapshot: Snapshot,
    windows: int,
    after_each: Callable[[AuditWriter], None] = lambda writer: None,
    **writer_kw: Any,
) -> list[int]:
    """Count ``windows`` windows while a PostgreSQL lock holds every insert, each on disk
    before the next (``after_each`` checks the writer then); let the inserts through, wait for
    every answer in the database and the spool emptied. Returns one entry per read of the
    spool."""
    migrate.downgrade(postgres_url, "base")
    migrate.upgrade(postgres_url)
    engine = make_async_engine(postgres_url)
    blocker = make_async_engine(postgres_url)
    spool = Spool(tmp_path / "spool", "node-a")
    store = await read_store_id(engine)
    assert store is not None
    spool.bind(store)
    writer = AuditWriter(engine, "node-a", spool, flush_interval=0.05, **writer_kw)
    await writer.start()
    reads: list[int] = []
    read_spool = spool.pending_through

    def counted(limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
        reads.append(1)
        return read_spool() if limit is None else read_spool(limit)

    spool.pending_through = counted  # type: ignore[method-assign]
    try:
        async with blocker.connect() as conn:
            await conn.execute(text("LOCK TABLE decisions IN ACCESS EXCLUSIVE MODE"))
            try:
                for window in range(windows):
                    for n, record in enumerate(records(snapshot)):
                        writer.count(record, n=window + n + 1)
                    await eventually(
                        lambda: _spooled(spool) == writer.counted,
                        WITHIN_S,
                        f"window {window} on disk while the database is locked",
                    )
                    after_each(writer)
            finally:
                await conn.rollback()  # the inserts go through now

        async def all_in() -> bool:
            return await query.total_count(engine) == writer.counted

        await eventually(all_in, WITHIN_S, "every answer in the database")
        await eventually(lambda: spool.size() == 0, WITHIN_S, "the spool emptied")
        return reads
    finally:
        await asyncio.wait_for(writer.stop(), WITHIN_S)
        await engine.dispose()
        await blocker.dispose()


@pytest.mark.postgres
async def test_windows_reach_the_spool_while_inserts_wait(
    postgres_url: str, tmp_path: Path, snapshot: Snapshot
) -> None:
    # Windows sealed while the drain waits are drained from memory after it, not read back
    # from the spool (parsing every row again made a writer that fell behind fall further).
    reads = await _windows_under_a_locked_table(postgres_url, tmp_path, snapshot, windows=4)
    assert reads == []


@pytest.mark.postgres
async def test_the_rows_queued_for_a_slow_database_stay_within_their_bound(
    postgres_url: str, tmp_path: Path, snapshot: Snapshot
) -> None:
    """Windows sealed while the database holds the drain wait in memory only up to the
    writer's bound (a share of the node's memory budget, gtm.audit.rows.queued_rows); past
    it they wait in the spool alone, and are read back from it once the database lets them in:
    every answer still lands."""
    bound = 2 * len(records(snapshot))

    def within_bound(writer: AuditWriter) -> None:
        assert sum(map(len, writer._queued)) <= bound

    reads = await _windows_under_a_locked_table(
        postgres_url, tmp_path, snapshot, windows=6, after_each=within_bound, max_queued_rows=bound
    )
    assert reads  # what the queue could not hold came back from the spool
