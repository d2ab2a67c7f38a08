"""Verification that goes on from a checkpoint: ``gtm audit verify --since`` and the scheduled
passes of the admin node, with the metrics an alert reads."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.anchor import Anchor
from gtm.audit.checkpoints import DirectorySink
from gtm.audit.schema import decisions
from gtm.audit.verify import read_checkpoints, starts_at, verify
from gtm.audit.watch import VerificationWatch
from gtm.decision.snapshot import Snapshot
from tests.gtm.audit.test_audit import records
from tests.gtm.audit.test_evidence import Node, Store
from tests.support.tamper import triggers_off


def _metric(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    return 0.0 if value is None else value


async def _round(node: Node, snapshot: Snapshot, n: int) -> None:
    for k, record in enumerate(records(snapshot)):
        node.writer.count(record, n=n + k + 1)
    await node.writer.flush()
    await node.anchor.checkpoint("checkpoint")


async def _edit_row(engine: AsyncEngine, node: str, seq: int) -> None:
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(
            update(decisions)
            .where(decisions.c.node == node, decisions.c.node_seq == seq)
            .values(region="us-east")
        )


async def test_verify_since_a_checkpoint_reads_only_what_came_after_it(
    engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    clock = [1000.0]
    store = Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)
    a = await store.node("node-a")
    a.anchor.clock = lambda: clock[0]
    for i in range(4):
        clock[0] += 10
        await _round(a, snapshot, i)
    full = await store.verify()
    assert full.breaks == [] and full.rows == 12
    # From the checkpoint written at 1020 (after the second round, row 6): rows 7..12 read.
    since = await verify(engine, store.sink, since=1025.0)
    assert since.breaks == []
    started = since.chains["node-a"].started
    assert started is not None and started.seq == 6
    assert since.rows == 6
    assert since.chains["node-a"].answers == full.chains["node-a"].answers
    # An edit after the start point is found; the first row after it must follow its hash.
    await _edit_row(engine, "node-a", 7)
    again = await verify(engine, store.sink, since=1025.0)
    assert [(b.node, b.node_seq) for b in again.breaks] == [("node-a", 7)]


async def test_starts_at_picks_each_chains_newest_checkpoint_by_then(
    engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    clock = [500.0]
    store = Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)
    a = await store.node("node-a")
    a.anchor.clock = lambda: clock[0]
    for i in range(3):
        clock[0] += 10
        await _round(a, snapshot, i)
    good, bad = read_checkpoints(store.sink, None)
    assert bad == []
    assert starts_at(good, 400.0) == {}
    assert starts_at(good, 515.0)["node-a"].seq == 3
    assert starts_at(good, 10_000.0)["node-a"].seq == 9


async def test_scheduled_passes_go_on_from_the_last_and_hold_at_a_break(
    database_url: str, engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    store = Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)
    a = await store.node("node-a")
    await _round(a, snapshot, 0)
    watch = VerificationWatch(database_url, store.sink)
    failures = _metric("gtm_audit_verify_failures_total")

    first = await watch.once()
    assert first.breaks == [] and first.rows == 3
    through = _metric("gtm_audit_verified_through_seconds")
    assert through == first.newest_at and through > 0
    assert watch.starts["node-a"].seq == 3

    await _round(a, snapshot, 1)
    second = await watch.once()
    assert second.breaks == []
    assert second.rows == 3  # only the rows written since the first pass
    assert watch.starts["node-a"].seq == 6
    through = _metric("gtm_audit_verified_through_seconds")
    assert second.newest_at is not None and through == second.newest_at

    await _round(a, snapshot, 2)
    await _edit_row(engine, "node-a", 8)
    third = await watch.once()
    assert [(b.node, b.node_seq) for b in third.breaks] == [("node-a", 8)]
    assert _metric("gtm_audit_verify_failures_total") == failures + 1
    assert _metric("gtm_audit_verify_breaks") == 1
    # Held where it was: the next pass checks the same rows again, the time does not move.
    assert _metric("gtm_audit_verified_through_seconds") == through
    assert watch.starts["node-a"].seq == 6
    fourth = await watch.once()
    assert [(b.node, b.node_seq) for b in fourth.breaks] == [("node-a", 8)]
    await a.writer.stop()
    await a.anchor.stop()


async def test_a_pass_sees_a_tail_cut_back_behind_where_it_resumes(
    database_url: str, engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    """A later pass does not read the rows an earlier one verified, but the row it resumes at
    must still be there as its checkpoint says: otherwise deleting the newest rows (back to or
    behind the last verified checkpoint) would go unseen until a full verification. The last
    pass is kept for the admin API, breaks and all."""
    store = Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)
    a = await store.node("node-a")
    await _round(a, snapshot, 0)
    await _round(a, snapshot, 1)
    watch = VerificationWatch(database_url, store.sink)
    assert (await watch.once()).breaks == []
    assert watch.starts["node-a"].seq == 6
    assert watch.last_pass is not None and watch.last_pass.ok and watch.last_pass.rows == 6
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node_seq > 4))
    cut_back = await watch.once()
    assert [(b.node, b.node_seq) for b in cut_back.breaks] == [("node-a", 6)]
    assert "is gone" in cut_back.breaks[0].problem
    last = watch.last_pass
    assert last is not None and not last.ok and last.break_count == 1 and last.error is None
    assert last.breaks == tuple(cut_back.breaks)
    await a.writer.stop()
    await a.anchor.stop()


async def test_an_edit_behind_the_resume_points_is_found_by_the_next_full_pass(
    database_url: str, engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    """A row edited after a pass verified it is behind where the next passes start: they do
    not see it. The periodic pass from every chain's start does, and only a clean full pass
    moves gtm_audit_full_verified_at_seconds."""
    store = Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)
    a = await store.node("node-a")
    await _round(a, snapshot, 0)
    await _round(a, snapshot, 1)
    clock = [10_000.0]
    watch = VerificationWatch(database_url, store.sink, clock=lambda: clock[0], full_every_s=3600)
    first = await watch.once()
    assert first.breaks == [] and first.rows == 6
    assert watch.last_pass is not None and watch.last_pass.full and watch.full_at == 10_000.0
    assert _metric("gtm_audit_full_verified_at_seconds") == 10_000.0
    await _edit_row(engine, "node-a", 2)  # verified already: behind the resume point (seq 6)
    await _round(a, snapshot, 2)
    clock[0] += 60
    resumed = await watch.once()
    assert resumed.breaks == [] and resumed.rows == 3  # only what came after: blind to row 2
    assert watch.last_pass is not None and not watch.last_pass.full
    clock[0] += 3600
    full = await watch.once()
    assert [(b.node, b.node_seq) for b in full.breaks] == [("node-a", 2)]
    assert watch.last_pass is not None and watch.last_pass.full and not watch.last_pass.ok
    assert watch.full_at == 10_000.0  # a failed full pass is not a verification
    assert _metric("gtm_audit_full_verified_at_seconds") == 10_000.0
    # Until someone looks, every pass is a full one (none has run clean since).
    clock[0] += 60
    assert watch.full_due()
    await a.writer.stop()
    await a.anchor.stop()


async def test_an_idle_chain_is_signed_again_after_the_heartbeat(
    engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    store = Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)
    a = await store.node("node-a")
    clock = [2000.0]
    anchor: Anchor = a.anchor
    anchor.clock = lambda: clock[0]
    anchor.heartbeat_s = 60.0
    await _round(a, snapshot, 0)
    clock[0] += 30
    assert await anchor.checkpoint("checkpoint") == 0  # nothing moved, heartbeat not due
    clock[0] += 31
    assert await anchor.checkpoint("checkpoint") >= 1  # signed again though idle
    async with engine.connect() as conn:
        newest = await conn.scalar(
            select(decisions.c.node_seq).order_by(decisions.c.node_seq.desc())
        )
    good, _ = read_checkpoints(store.sink, None)
    mine = [s.checkpoint for s, _ in good if s.checkpoint.chain == "node-a"]
    assert any(cp.at == clock[0] and cp.seq == newest for cp in mine)
