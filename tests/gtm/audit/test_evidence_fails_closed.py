"""Evidence that fails closed (issue 31): the attacks an attacker holding the database
password (every table, triggers off on PostgreSQL; no key file, no write to the checkpoint
sink) ran with ``verify`` saying OK. Each test here failed on the code before the event chain
was keyed and verification read the whole sink."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.checkpoints import EVENTS_CHAIN, DirectorySink
from gtm.audit.event_chain import event_hash
from gtm.audit.record import GENESIS, row_hash
from gtm.audit.schema import audit_checkpoints, audit_store, decisions, event_chain, region_events
from gtm.audit.verify import Verification, read_checkpoints
from gtm.audit.watch import VerificationWatch
from gtm.decision.snapshot import Snapshot
from gtm.fleet.region_state import RegionEvent
from gtm.fleet.shared_state import append_events
from tests.gtm.audit.test_evidence import Node, Store, _problems, _rows, _traffic
from tests.gtm.audit.test_evidence import store as store
from tests.gtm.audit.test_watch import _round
from tests.support.tamper import triggers_off

ROOT = Path(__file__).resolve().parents[3]


def _drain(i: int) -> RegionEvent:
    return RegionEvent(1000.0 + i, "op", "eu-west", "override", "draining", "up",
                       f"drained by alice ({i})", actor="alice", reason="upgrade")  # fmt: skip


async def _events(engine: AsyncEngine) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        query = select(region_events).order_by(region_events.c.seq)
        return [dict(r._mapping) for r in await conn.execute(query)]


async def _wipe(engine: AsyncEngine) -> str:
    """Every decision, event and database checkpoint gone, the chain head reset, a new store id:
    a database that looks freshly migrated. Returns the new id."""
    new = str(uuid.uuid4())
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions))
        await conn.execute(delete(region_events))
        await conn.execute(delete(audit_checkpoints))
        await conn.execute(update(event_chain).values(seq=0, last_hash=GENESIS))
        await conn.execute(update(audit_store).values(id=new))
    return new


async def _with_history(store: Store, snapshot: Snapshot) -> tuple[Node, str]:
    a = await store.node("node-a")
    old = a.spool.bound_store()
    assert old is not None
    await append_events(store.engine, [_drain(1)])
    await _traffic(a, snapshot)
    clean = await store.verify()
    assert clean.breaks == [], _problems(clean)
    return a, old


async def test_a_wiped_store_under_a_new_id_is_a_break_naming_the_old_store(
    store: Store, snapshot: Snapshot, database_url: str, tmp_path: Path
) -> None:
    _, old = await _with_history(store, snapshot)
    new = await _wipe(store.engine)
    result = await store.verify()
    problems = _problems(result)
    assert result.rows == 0
    # The database's id is one the sink never vouched for...
    assert any(b.node == "store" and f"store id {new} is unknown" in b.problem
               for b in result.breaks), problems  # fmt: skip
    # ...and every chain the sink holds for the old store is named, with where it says so.
    named = {b.node for b in result.breaks if f"of store {old}" in b.problem}
    assert named == {"node-a", EVENTS_CHAIN}, problems
    assert str(store.sink.directory / "chains") in problems

    # The command says so and exits non-zero (it said "0 rows ... 0 checkpoints", exit 0).
    env = os.environ | {"GTM_DATABASE_URL": database_url,
                        "GTM_SPOOL_DIR": str(tmp_path / "verifier-spool")}  # fmt: skip
    args = [sys.executable, "-m", "gtm", "audit", "verify", "--checkpoints",
            str(store.sink.directory)]  # fmt: skip
    out = await asyncio.to_thread(
        subprocess.run, args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"BROKEN store#0: the database's store id {new} is unknown" in out.stdout
    assert f"BROKEN node-a#12: the checkpoint at {store.sink.directory}" in out.stdout


async def test_a_store_whose_id_row_was_deleted_is_not_an_empty_store(
    store: Store, snapshot: Snapshot
) -> None:
    _, old = await _with_history(store, snapshot)
    await _wipe(store.engine)
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(audit_store))
    result = await store.verify()
    assert any(b.node == "store" and "no audit store id" in b.problem and old in b.problem
               for b in result.breaks), _problems(result)  # fmt: skip


async def test_the_scheduled_verification_reports_an_erased_store_at_its_next_pass(
    database_url: str, engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    """The watch goes on from where its last pass ended; the erased store must show at the
    first pass after the wipe, resumed or full. Measured: the time from the wipe to the
    failed pass (printed; the bound is the watch's interval plus one pass)."""
    store = Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)
    a = await store.node("node-a")
    await _round(a, snapshot, 0)
    watch = VerificationWatch(database_url, store.sink, full_every_s=3600)
    # Each pass, and whether it began after the wipe had landed (one that began before may
    # still say ok; the first that began after must not).
    passes: asyncio.Queue[tuple[bool, Verification]] = asyncio.Queue()
    wiped = asyncio.Event()
    once = watch.once

    async def reporting() -> Verification:
        after = wiped.is_set()
        result = await once()
        passes.put_nowait((after, result))
        return result

    watch.once = reporting  # type: ignore[method-assign]
    stop = asyncio.Event()
    # GTM_TEST_VERIFY_INTERVAL_S=60 measures the default schedule (a minute a run).
    interval_s = float(os.environ.get("GTM_TEST_VERIFY_INTERVAL_S", "1"))
    running = asyncio.create_task(watch.run(stop, interval_s))
    try:
        assert (await passes.get())[1].breaks == []  # full
        await _round(a, snapshot, 1)
        _, resumed = await passes.get()
        assert resumed.breaks == [] and watch.starts["node-a"].seq == 6
        wiped_at = time.monotonic()
        new = await _wipe(engine)
        wiped.set()
        after, result = await passes.get()
        if not after:
            after, result = await passes.get()
        took = time.monotonic() - wiped_at
    finally:
        stop.set()
        await running
        await a.writer.stop()
        await a.anchor.stop()
    print(f"erased store reported {took:.2f} s after the wipe (interval {interval_s} s)")
    assert after and result.breaks, "the first pass after the wipe said ok"
    assert watch.last_pass is not None and not watch.last_pass.ok
    assert any(f"store id {new} is unknown" in b.problem for b in result.breaks)
    assert any(b.node == "node-a" and b.node_seq == 6 for b in result.breaks), _problems(result)


async def _forge_event(engine: AsyncEngine) -> int:
    """An event appended as GTM would, with the right prev_hash and row_hash, and the head
    moved to it."""
    async with engine.begin() as conn:
        await triggers_off(conn)
        head = (await conn.execute(select(event_chain.c.seq, event_chain.c.last_hash))).one()
        row: dict[str, Any] = {
            "at_us": 2_000_000_000, "node": "op", "region": "eu-west", "kind": "override",
            "state": "up", "previous": "draining", "detail": "cleared", "actor": "alice",
            "reason": "back", "seq": head.seq + 1, "prev_hash": head.last_hash,
        }  # fmt: skip
        row["row_hash"] = event_hash(head.last_hash, row)
        await conn.execute(region_events.insert(), row)
        await conn.execute(update(event_chain).values(seq=row["seq"], last_hash=row["row_hash"]))
    return int(row["seq"])


async def test_a_forged_event_with_the_right_hashes_is_named_at_its_row(
    store: Store, snapshot: Snapshot
) -> None:
    a = await store.node("node-a")
    await append_events(store.engine, [_drain(1)])
    await a.anchor.checkpoint("checkpoint")
    forged = await _forge_event(store.engine)
    # The node's next checkpoints (scheduled, and at stop) do not sign a head it did not write.
    await _traffic(a, snapshot)
    good, _ = read_checkpoints(store.sink, a.spool.bound_store())
    assert max(s.checkpoint.seq for s, _ in good if s.checkpoint.chain == EVENTS_CHAIN) == 1
    result = await store.verify()
    assert [(b.node, b.node_seq) for b in result.breaks] == [(EVENTS_CHAIN, forged)], _problems(
        result
    )
    assert "not signed by any writer's key" in result.breaks[0].problem


async def test_an_event_row_outside_the_chain_is_named(store: Store, snapshot: Snapshot) -> None:
    """No seq at all: the event log and the compliance report show it all the same."""
    a = await store.node("node-a")
    await append_events(store.engine, [_drain(1)])
    await _traffic(a, snapshot)
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        inserted = await conn.execute(
            region_events.insert().returning(region_events.c.id),
            {"at_us": 1, "node": "op", "region": "eu-west", "kind": "override",
             "detail": "cleared", "actor": "alice"},
        )  # fmt: skip
        row_id = inserted.scalar_one()
    result = await store.verify()
    assert [b.problem for b in result.breaks] == [
        f"event row id {row_id} is outside the chain (no seq): added outside GTM, or older "
        "than the chain"
    ]


async def _hide_newest_event(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await triggers_off(conn)
        rows = [dict(r._mapping) for r in await conn.execute(
            select(region_events).order_by(region_events.c.seq))]  # fmt: skip
        await conn.execute(delete(region_events).where(region_events.c.seq == rows[-1]["seq"]))
        await conn.execute(
            update(event_chain).values(seq=rows[-2]["seq"], last_hash=rows[-2]["row_hash"])
        )


async def test_an_operator_event_hidden_within_a_checkpoint_interval_is_named(
    store: Store, snapshot: Snapshot
) -> None:
    a = await store.node("node-a")
    await append_events(store.engine, [_drain(1)])
    await a.anchor.checkpoint("checkpoint")  # the chain anchored at 1
    await append_events(store.engine, [_drain(2)])  # the operator's action...
    await _hide_newest_event(store.engine)  # ...gone before the next checkpoint
    await _traffic(a, snapshot)
    result = await store.verify()
    assert [(b.node, b.node_seq) for b in result.breaks] == [(EVENTS_CHAIN, 2)], _problems(result)
    assert "the tail is gone" in result.breaks[0].problem


async def test_a_hidden_event_is_named_when_the_writer_appends_again_before_its_checkpoint(
    store: Store, snapshot: Snapshot
) -> None:
    """The same writer's next event takes the hidden one's place: its head at 2 is still
    signed, and contradicts the new row 2."""
    a = await store.node("node-a")
    await append_events(store.engine, [_drain(1)])
    await a.anchor.checkpoint("checkpoint")
    await append_events(store.engine, [_drain(2)])
    await _hide_newest_event(store.engine)
    await append_events(store.engine, [_drain(3)])
    await _traffic(a, snapshot)
    result = await store.verify()
    assert [(b.node, b.node_seq) for b in result.breaks] == [(EVENTS_CHAIN, 2)], _problems(result)
    assert "rewritten (and re-hashed)" in result.breaks[0].problem


async def test_a_rewritten_and_rehashed_event_is_named_at_that_row(
    store: Store, snapshot: Snapshot
) -> None:
    a = await store.node("node-a")
    await append_events(store.engine, [_drain(i) for i in range(1, 5)])
    await _traffic(a, snapshot)  # the chain anchored at 4
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        rows = [dict(r._mapping) for r in await conn.execute(
            select(region_events).order_by(region_events.c.seq))]  # fmt: skip
        rows[1]["detail"] = "probe failed"  # seq 2: the operator's drain made a probe's
        prev = rows[0]["row_hash"]
        for row in rows[1:]:
            row["prev_hash"] = prev
            prev = row["row_hash"] = event_hash(prev, row)
            await conn.execute(update(region_events).where(region_events.c.id == row["id"])
                               .values(detail=row["detail"], prev_hash=row["prev_hash"],
                                       row_hash=row["row_hash"]))  # fmt: skip
        await conn.execute(update(event_chain).values(seq=4, last_hash=prev))
    result = await store.verify()
    first = result.breaks[0]
    assert (first.node, first.node_seq) == (EVENTS_CHAIN, 2), _problems(result)
    assert "signature does not verify" in first.problem


async def test_a_rewritten_and_rehashed_decision_is_located_between_two_checkpoints(
    store: Store, snapshot: Snapshot
) -> None:
    """Decision rows carry no signature of their own (the writer's hot path); the break names
    the rows between the newest checkpoint that still matches and the first that does not."""
    a = await store.node("node-a")
    await _traffic(a, snapshot)  # checkpoints at 3, 6, 9, 12
    rows = await _rows(store.engine, "node-a")
    rows[7]["region"] = "us-east"  # seq 8
    prev = rows[6]["row_hash"]
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        for row in rows[7:]:
            row["prev_hash"] = prev
            prev = row["row_hash"] = row_hash(prev, row)
            await conn.execute(update(decisions).where(decisions.c.id == row["id"])
                               .values(region=row["region"], prev_hash=row["prev_hash"],
                                       row_hash=row["row_hash"]))  # fmt: skip
    result = await store.verify()
    assert [(b.node, b.node_seq) for b in result.breaks] == [("node-a", 9), ("node-a", 12)]
    assert "rewritten (and re-hashed) in rows 7..9 (row 6 still matches" in (
        result.breaks[0].problem
    )
