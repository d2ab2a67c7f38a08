"""Sealed windows reach the database in the order they were sealed, whoever drains them.

The writer's loop seals a window and then starts a task to drain it; a flush called meanwhile
(the node's stop, a test, an operator's command) seals the next window and drains it at once.
The database skips rows at or below the newest sequence it holds (a replay after a crash
repeats rows it committed), so when the later window went in first, the earlier one's rows
were skipped: missing from the database, with the spool emptied of them and the chain's next
row pointing at a row nobody would ever insert. Found as a decision id whose audit row never
appeared (tests/gtm/front/test_affinity.py, about one run in twenty on a loaded machine)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit import query
from gtm.audit.pacing import Slices
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.decision.snapshot import Snapshot
from tests.gtm.audit.test_audit import records
from tests.support.waiting import eventually


async def test_a_window_whose_drain_starts_after_the_next_ones_still_lands_first(
    engine: AsyncEngine, snapshot: Snapshot, tmp_path: Path
) -> None:
    # The loop's own sealing out of the way: this test makes the interleaving itself.
    writer = AuditWriter(engine, "node-a", Spool(tmp_path / "spool", "node-a"), flush_interval=3600)
    await writer.start()
    a, b, _ = records(snapshot)
    try:
        writer.count(a, n=3)
        first = await writer._seal_window(Slices(0.0))  # as the loop does, before its drain
        async with writer._drain_lock:
            # A flush seals the next window and waits to drain it ...
            writer.count(b, n=2)
            flush = asyncio.create_task(writer.flush())
            lock = writer._drain_lock
            await eventually(lambda: bool(getattr(lock, "_waiters", None)), 30.0, "flush waiting")
            # ... ahead of the loop's drain of the first window, started only now.
            behind = asyncio.create_task(writer._drain_behind(first))
        await flush
        await behind
    finally:
        await writer.stop()
    rows = await query.tail(engine, 10)
    assert [(r["node_seq"], r["count"]) for r in rows] == [(1, 3), (2, 2)]
    assert await query.total_count(engine) == writer.counted == 5
    checked, breaks = await query.verify(engine)
    assert (checked, breaks) == (2, [])
