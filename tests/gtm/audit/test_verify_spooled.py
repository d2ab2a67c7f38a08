"""``gtm audit verify`` tells rows still in a live node's spool from rows that are gone (issue
33). A node's checkpoints vouch for what it sealed; while its writer cannot reach the database
those rows are only in its spool, and verify used to call them ``BROKEN ... the tail is gone``.
Now the node reports its spool (sealed through, drained through) with its status, and a tail a
recent report still holds is SPOOLED (exit 3); a tail the node says it drained, or a report too
old, is still a break."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import REGISTRY
from sqlalchemy import delete
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.anchor import Anchor
from gtm.audit.database import make_async_engine
from gtm.audit.schema import decisions
from gtm.audit.verify import Verification, verify
from gtm.audit.watch import VerificationWatch
from gtm.audit.writer import AuditWriter
from gtm.decision.snapshot import Snapshot
from gtm.fleet.shared_state import NodeStatus, write_node_status
from tests.gtm.audit.test_audit import records
from tests.gtm.audit.test_evidence import ROOT, Node, Store
from tests.gtm.audit.test_evidence import store as store
from tests.support.tamper import triggers_off

LIVE = 600.0  # the liveness bound here: generous, the test measures no time


def _unreachable(database_url: str, tmp_path: Path) -> str:
    """A URL of the same kind where every drain fails: the writer's database is away (on
    SQLite, a new file without the schema; on PostgreSQL, a port nothing listens on)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        return f"sqlite:///{tmp_path / 'absent' / 'store.sqlite3'}"
    with socket.socket() as s:  # a port nothing listens on (bound, then let go)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


async def _window(node: Node, snapshot: Snapshot, k: int) -> None:
    for n, record in enumerate(records(snapshot)):
        node.writer.count(record, n=k + n + 1)
    await node.writer.flush()
    await node.anchor.checkpoint("checkpoint")


async def _report(engine: AsyncEngine, writer: AuditWriter, at: float) -> None:
    """The node's status as the runtime writes it (gtm.runtime.Runtime._own_status)."""
    spool = writer.spool_range()
    assert spool is not None
    await write_node_status(
        engine,
        NodeStatus(writer.node, writer.node, at, None, 1, "t", "p", {},
                   audit_sealed=spool[1], audit_drained=spool[0]),
    )  # fmt: skip


async def _sealed_while_away(store: Store, snapshot: Snapshot, database_url: str) -> Node:
    """node-a: two windows in the database, then a restart whose writer cannot reach it; a
    third window sealed, spooled and checkpointed, not in the database."""
    a = await store.node("node-a")
    for k in range(2):
        await _window(a, snapshot, k)
    await a.writer.stop()
    await a.anchor.stop()
    away = make_async_engine(_unreachable(database_url, store.tmp))
    writer = AuditWriter(away, "node-a", a.spool)
    anchor = Anchor(store.engine, writer, a.spool, store.sink, interval_s=3600)
    await writer.start()
    await anchor.start()
    b = Node(writer, anchor, a.spool)
    await _window(b, snapshot, 2)
    assert writer.spool_range() == (6, 9)  # 3 records a window: rows 7..9 only spooled
    return b


async def _stop(node: Node) -> None:
    await node.writer.stop()
    await node.anchor.stop()
    await node.writer.engine.dispose()  # the unreachable one: its failed connections too


def _problems(result: Verification) -> str:
    return "\n".join(f"{b.node}#{b.node_seq}: {b.problem}" for b in result.breaks)


async def test_a_tail_still_in_a_live_nodes_spool_is_spooled_not_broken(
    store: Store, snapshot: Snapshot, database_url: str
) -> None:
    node = await _sealed_while_away(store, snapshot, database_url)
    await _report(store.engine, node.writer, time.time())

    result = await verify(store.engine, store.sink, spools_since=time.time() - LIVE)
    assert result.breaks == [], _problems(result)
    spooled = result.spooled["node-a"]
    assert (spooled.last_seq, spooled.spooled) == (6, 3)
    assert spooled.spool is not None and spooled.spool.node == "node-a"

    # The command says so and exits 3: incomplete, not broken (it said BROKEN, exit 1).
    env = os.environ | {"GTM_DATABASE_URL": database_url, "GTM_NODE_LIVE_WITHIN_S": str(LIVE),
                        "GTM_SPOOL_DIR": str(store.tmp / "verifier-spool")}  # fmt: skip
    args = [sys.executable, "-m", "gtm", "audit", "verify", "--checkpoints",
            str(store.sink.directory)]  # fmt: skip
    out = await asyncio.to_thread(
        subprocess.run, args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert "SPOOLED node-a#7: 3 row(s) still spooled on node node-a (reported at" in out.stdout
    assert "BROKEN" not in out.stdout
    await _stop(node)


async def test_a_missing_tail_no_recent_report_holds_is_still_broken(
    store: Store, snapshot: Snapshot, database_url: str
) -> None:
    node = await _sealed_while_away(store, snapshot, database_url)
    # No report at all, then one older than the liveness bound: nobody vouches for the rows.
    for result in [
        await verify(store.engine, store.sink, spools_since=time.time() - LIVE),
        await _after_report(store, node, time.time() - 2 * LIVE),
    ]:
        assert result.spooled == {}
        assert "node-a#7: the tail is gone" in _problems(result)
    await _stop(node)


async def test_a_report_from_before_the_checkpoint_holds_a_lost_spool_does_not(
    store: Store, snapshot: Snapshot, database_url: str
) -> None:
    """The node reports every state-sync round and checkpoints every few seconds: its last
    report may predate the checkpoint of rows it sealed since, and still holds them. A report
    after the checkpoint that sealed less is a node whose spool was lost: broken."""
    node = await _sealed_while_away(store, snapshot, database_url)
    behind = NodeStatus("node-a", "node-a", time.time() - LIVE / 2, None, 1, "t", "p", {},
                        audit_sealed=6, audit_drained=6)  # fmt: skip
    await write_node_status(store.engine, behind)
    result = await verify(store.engine, store.sink, spools_since=time.time() - LIVE)
    assert result.breaks == [], _problems(result)
    assert result.spooled["node-a"].spooled == 3
    lost = NodeStatus("node-a", "node-a", time.time(), None, 1, "t", "p", {},
                      audit_sealed=6, audit_drained=6)  # fmt: skip
    await write_node_status(store.engine, lost)
    result = await verify(store.engine, store.sink, spools_since=time.time() - LIVE)
    assert result.spooled == {}
    assert "node-a#7: the tail is gone" in _problems(result)
    await _stop(node)


async def _after_report(store: Store, node: Node, at: float) -> Verification:
    await _report(store.engine, node.writer, at)
    return await verify(store.engine, store.sink, spools_since=time.time() - LIVE)


async def test_rows_the_node_drained_and_the_database_lost_are_broken(
    store: Store, snapshot: Snapshot
) -> None:
    a = await store.node("node-a")
    for k in range(3):
        await _window(a, snapshot, k)
    await _report(store.engine, a.writer, time.time())  # drained through 9, nothing spooled
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node_seq > 6))
    result = await verify(store.engine, store.sink, spools_since=time.time() - LIVE)
    assert result.spooled == {}
    assert "node-a#7: the tail is gone" in _problems(result)
    await a.writer.stop()
    await a.anchor.stop()


async def test_the_scheduled_pass_counts_a_spooled_tail_as_late_not_broken(
    store: Store, snapshot: Snapshot, database_url: str
) -> None:
    """The admin node's scheduled verification (gtm.audit.watch) sets gtm_audit_verify_breaks,
    which a critical alert reads: a drain that lags must not raise it. It does not move its
    verified-through time past a tail it could not read either."""
    node = await _sealed_while_away(store, snapshot, database_url)
    await _report(store.engine, node.writer, time.time())
    blind = VerificationWatch(database_url, store.sink)
    assert (await blind.once()).breaks != [] and blind.failures == 1  # as before: "gone"
    watch = VerificationWatch(database_url, store.sink, live_within_s=LIVE)
    result = await watch.once()
    assert result.breaks == [] and watch.failures == 0
    assert result.spooled["node-a"].spooled == 3
    assert REGISTRY.get_sample_value("gtm_audit_verify_breaks") == 0
    assert watch.verified_through is None and watch.full_at is None
    await _stop(node)
