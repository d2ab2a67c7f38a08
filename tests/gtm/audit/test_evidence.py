"""The audit trail against someone holding the database password: every attack below passed
unnoticed before chains were checkpointed outside the database (``verify`` reported 0 breaks)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.anchor import Anchor, read_store_id
from gtm.audit.checkpoints import DirectorySink, sign
from gtm.audit.database import make_async_engine
from gtm.audit.event_chain import chain_events
from gtm.audit.keys import ChainKey, load_or_create
from gtm.audit.record import GENESIS, row_hash
from gtm.audit.retention import retain
from gtm.audit.schema import audit_checkpoints, decisions, event_chain, region_events
from gtm.audit.spool import Spool
from gtm.audit.verify import Verification, read_checkpoints, verify
from gtm.audit.writer import AuditWriter
from gtm.decision.snapshot import Snapshot
from gtm.errors import ConfigError
from gtm.fleet.region_state import RegionEvent
from gtm.fleet.shared_state import append_events
from tests.gtm.audit.test_audit import records
from tests.support.tamper import triggers_off

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Node:
    writer: AuditWriter
    anchor: Anchor
    spool: Spool


@dataclass
class Store:
    engine: AsyncEngine
    sink: DirectorySink
    tmp: Path

    async def node(self, name: str) -> Node:
        spool = Spool(self.tmp / f"spool-{name}", name)
        store = await read_store_id(self.engine)
        assert store is not None
        spool.bind(store)
        writer = AuditWriter(self.engine, name, spool)
        anchor = Anchor(self.engine, writer, spool, self.sink, interval_s=3600)
        await writer.start()
        await anchor.start()
        return Node(writer, anchor, spool)

    async def verify(self) -> Verification:
        return await verify(self.engine, self.sink)


@pytest.fixture
def store(engine: AsyncEngine, tmp_path: Path) -> Store:
    return Store(engine, DirectorySink(tmp_path / "checkpoints"), tmp_path)


async def _traffic(node: Node, snapshot: Snapshot, flushes: int = 4) -> None:
    """Rows over several flushes, a checkpoint after each, a clean stop."""
    for i in range(flushes):
        for n, record in enumerate(records(snapshot)):
            node.writer.count(record, n=i + n + 1)
        await node.writer.flush()
        await node.anchor.checkpoint("checkpoint")
    await node.writer.stop()
    await node.anchor.stop()


def _problems(result: Verification) -> str:
    return "\n".join(f"{b.node}#{b.node_seq}: {b.problem}" for b in result.breaks)


async def _rows(engine: AsyncEngine, node: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        query = select(decisions).where(decisions.c.node == node).order_by(decisions.c.node_seq)
        return [dict(r._mapping) for r in await conn.execute(query)]


async def test_an_untouched_store_verifies_and_is_anchored_to_its_last_row(
    store: Store, snapshot: Snapshot
) -> None:
    a, b = await store.node("node-a"), await store.node("node-b")
    await append_events(store.engine, [RegionEvent(1.0, "node-a", "eu-west", "observed", "up",
                                                   None, "probe ok")])  # fmt: skip
    await _traffic(a, snapshot)
    await _traffic(b, snapshot)
    result = await store.verify()
    assert result.breaks == [], _problems(result)
    assert result.unanchored == {}
    assert result.rows == 24  # 3 records x 4 flushes x 2 nodes
    assert result.chains["node-a"].anchored_seq == 12
    assert result.chains["region_events"].anchored_seq == 1
    # Answers counted are vouched for too: the checkpoint's count is the rows' sum.
    assert result.chains["node-a"].answers == sum(
        r["count"] for r in await _rows(store.engine, "node-a")
    )


Attack = Callable[[AsyncEngine], Awaitable[None]]


async def _truncate_tail(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node == "node-a",
                                                   decisions.c.node_seq > 9))  # fmt: skip


async def _delete_chain(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node == "node-a"))


async def _rewrite_and_rehash(engine: AsyncEngine) -> None:
    """Row 2 to us-east, rows 5-7 dropped, the rest renumbered and every hash recomputed: a
    chain consistent with itself."""
    rows = [r for r in await _rows(engine, "node-a") if r["node_seq"] not in (5, 6, 7)]
    rows[1]["region"] = "us-east"
    prev = GENESIS
    for seq, row in enumerate(rows, 1):
        row["node_seq"], row["prev_hash"] = seq, prev
        prev = row["row_hash"] = row_hash(prev, row)
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node == "node-a"))
        await conn.execute(decisions.insert(), [{k: v for k, v in r.items() if k != "id"}
                                                for r in rows])  # fmt: skip


async def _reorder(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await triggers_off(conn)
        for seq, tmp in ((3, -3), (4, 3), (-3, 4)):
            await conn.execute(update(decisions).where(decisions.c.node == "node-a",
                               decisions.c.node_seq == seq).values(node_seq=tmp))  # fmt: skip


async def _edit_row(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(update(decisions).where(decisions.c.node == "node-a",
                           decisions.c.node_seq == 2).values(region="us-east"))  # fmt: skip


async def _add_a_chain(engine: AsyncEngine) -> None:
    """A whole chain of made-up decisions for a node that never existed, chained correctly."""
    rows = await _rows(engine, "node-a")
    prev = GENESIS
    for seq, row in enumerate(rows[:3], 1):
        row.update(node="node-z", node_seq=seq, prev_hash=prev, region="us-east")
        prev = row["row_hash"] = row_hash(prev, row)
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(decisions.insert(), [{k: v for k, v in r.items() if k != "id"}
                                                for r in rows[:3]])  # fmt: skip


async def _rewrite_events(engine: AsyncEngine) -> None:
    """The operator's drain rewritten as a probe's observation, the chain and its head re-hashed
    in the database."""
    async with engine.begin() as conn:
        await triggers_off(conn)
        rows = [dict(r._mapping) for r in await conn.execute(
            select(region_events).order_by(region_events.c.seq))]  # fmt: skip
        rows[0]["detail"] = "probe failed"
        seq, head = chain_events(rows, 0, GENESIS)
        for row in rows:
            await conn.execute(update(region_events).where(region_events.c.id == row["id"])
                               .values(detail=row["detail"], prev_hash=row["prev_hash"],
                                       row_hash=row["row_hash"]))  # fmt: skip
        await conn.execute(update(event_chain).values(seq=seq, last_hash=head))


@pytest.mark.parametrize(
    ("attack", "expected"),
    [
        (_truncate_tail, "the tail is gone"),
        (_delete_chain, "every row of the chain is gone"),
        (_rewrite_and_rehash, "rewritten (and re-hashed)"),
        (_reorder, "prev_hash does not match"),
        (_edit_row, "row content does not match its hash"),
        (_add_a_chain, "no checkpoint vouches for this chain"),
        (_rewrite_events, "rewritten (and re-hashed)"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else "",
)
async def test_a_database_writer_cannot_change_drop_or_add_without_verify_saying_where(
    store: Store, snapshot: Snapshot, attack: Attack, expected: str
) -> None:
    a = await store.node("node-a")
    await append_events(store.engine, [RegionEvent(1.0, "op", "eu-west", "override", "draining",
                                                   "up", "drained by alice")])  # fmt: skip
    await _traffic(a, snapshot)
    assert (await store.verify()).breaks == []
    await attack(store.engine)
    result = await store.verify()
    assert any(expected in b.problem for b in result.breaks), _problems(result)


async def test_a_forged_or_altered_checkpoint_is_reported_with_its_location(
    store: Store, snapshot: Snapshot
) -> None:
    a = await store.node("node-a")
    await _traffic(a, snapshot)
    good = await store.verify()
    # The attacker rewrote the chain and signs a checkpoint of it with a key of their own...
    await _rewrite_and_rehash(store.engine)
    rows = await _rows(store.engine, "node-a")
    own = ChainKey(Ed25519PrivateKey.generate())
    head = rows[-1]
    forged = next(iter(read_checkpoints(store.sink, good.store)[0]))[0].checkpoint
    forged = replace(forged, seq=head["node_seq"], head=head["row_hash"], key=a.spool.key.id)
    store.sink.append(sign(forged, own))
    # ...and edits the head in a real one.
    chain_file = next((store.sink.directory / "chains").glob("node-a.*.jsonl"))
    lines = chain_file.read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b'"seq":0', b'"seq":1')
    chain_file.write_bytes(b"".join(lines))
    result = await store.verify()
    problems = _problems(result)
    assert f"{chain_file}:1: signature does not verify" in problems
    assert "signature does not verify: forged or altered" in problems
    assert "rewritten (and re-hashed)" in problems  # the genuine checkpoints still catch it


async def test_an_edited_spool_line_is_refused_at_replay_and_kept_aside(
    store: Store, snapshot: Snapshot, tmp_path: Path
) -> None:
    """The database is away, the rows wait in the spool; someone edits one to chat.eu -> us-east
    with its hashes recomputed."""
    engine = store.engine
    spool = Spool(tmp_path / "spool-a", "node-a")
    away = make_async_engine("postgresql://postgres@127.0.0.1:1/nothing")  # nothing listens
    writer = AuditWriter(away, "node-a", spool)
    for record in records(snapshot):
        writer.count(record)
    await writer.flush()
    lines = spool.path.read_bytes().splitlines()
    assert len(lines) == 3
    assert oct(spool.path.stat().st_mode & 0o777) == "0o600"
    body = json.loads(lines[1].rpartition(b"\t")[0])
    body["region"] = "us-east"
    body["row_hash"] = row_hash(body["prev_hash"], body)
    forged_mac = hashlib.sha256(json.dumps(body).encode()).hexdigest()  # no key: a guess
    lines[1] = json.dumps(body).encode() + b"\t" + forged_mac.encode()
    spool.path.write_bytes(b"\n".join(lines) + b"\n")
    # Two more tries while the database is still away, then it is back.
    await writer.flush()
    await writer.flush()
    await away.dispose()
    writer = AuditWriter(engine, "node-a", Spool(tmp_path / "spool-a", "node-a"))
    await writer.start()
    await writer.stop()
    stored = await _rows(engine, "node-a")
    assert [r["node_seq"] for r in stored] == [1, 3]
    assert all(r["region"] != "us-east" for r in stored)
    rejected = [json.loads(x) for x in writer.spool.rejected_path.read_text().splitlines()]
    assert len(rejected) == 1  # set aside once, not at every retry
    assert rejected[0]["line"] == 2 and "MAC does not verify" in rejected[0]["reason"]
    # And verify says row 2 is missing from the chain.
    assert any(b.node_seq == 3 for b in (await store.verify()).breaks)


async def test_a_spool_of_one_store_is_refused_by_another(
    store: Store, tmp_path: Path, snapshot: Snapshot
) -> None:
    a = await store.node("node-a")
    await _traffic(a, snapshot, flushes=1)
    from gtm.audit import migrate

    other_url = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    migrate.upgrade(other_url)
    other = make_async_engine(other_url)
    try:
        other_id = await read_store_id(other)
        assert other_id is not None and other_id != a.spool.bound_store()
        with pytest.raises(ConfigError) as refused:
            Spool(tmp_path / "spool-node-a", "node-a").bind(other_id)
        assert "belongs to audit store" in str(refused.value)
    finally:
        await other.dispose()


def test_keys_and_spool_files_are_private(tmp_path: Path) -> None:
    key_path = tmp_path / "k" / "audit-signing.key"
    load_or_create(key_path)
    assert key_path.stat().st_mode & 0o777 == 0o600
    key_path.chmod(0o644)
    with pytest.raises(ConfigError) as loose:
        load_or_create(key_path)
    assert "must be 0600" in str(loose.value)


_KILLED = """
import asyncio, os, signal, sys
from ipaddress import ip_address
from gtm.settings import Settings
from gtm.runtime import Runtime
from gtm.audit.record import record_of
from gtm.decision.routing import DecisionRequest, Channel, decide

async def main():
    rt = Runtime(Settings())
    await rt.start()
    for i in range(50):
        req = DecisionRequest(Channel.HTTP, ip_address(f"198.51.100.{i}"), "chat", "c")
        rt.count(record_of(decide(req, rt.store.current, 0.0), channel="http", name="chat"))
    await rt.writer.flush()
    # Counted and never flushed: what a kill -9 loses.
    rt.count(record_of(decide(req, rt.store.current, 0.0), channel="http", name="chat"))
    print("flushed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_a_kill_9_leaves_a_signed_gap_that_verify_shows(tmp_path: Path, geoip_path: Path) -> None:
    env = {
        **os.environ,
        "GTM_DATABASE_URL": f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
        "GTM_SPOOL_DIR": str(tmp_path / "spool"),
        "GTM_GEOIP_PATH": str(geoip_path),
        "GTM_CONFIG": str(ROOT / "examples" / "demo.yaml"),
        "GTM_POLICIES": json.dumps([str(ROOT / "policies")]),
        "GTM_PROBES": "false",
        "GTM_NODE_ID": "node-k",
    }
    killed = subprocess.run([sys.executable, "-c", _KILLED], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "flushed" in killed.stdout
    again = "import asyncio\nfrom gtm.settings import Settings\nfrom gtm.runtime import Runtime\n" \
        "async def main():\n    rt = Runtime(Settings()); await rt.start(); await rt.stop()\n" \
        "asyncio.run(main())\n"  # fmt: skip
    subprocess.run([sys.executable, "-c", again], env=env, cwd=ROOT, check=True, timeout=120)
    verify = subprocess.run([sys.executable, "-m", "gtm", "audit", "verify"], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "GAP node-k#" in verify.stdout
    assert "unclean stop" in verify.stdout
    assert "1 gap(s)" in verify.stdout


async def test_retention_removes_old_rows_with_a_signed_cut_and_verify_tells_them_apart(
    store: Store, snapshot: Snapshot
) -> None:
    now = [1_000.0]
    spool = Spool(store.tmp / "spool-r", "node-r")
    store_id = await read_store_id(store.engine)
    assert store_id is not None
    spool.bind(store_id)
    writer = AuditWriter(store.engine, "node-r", spool, clock=lambda: now[0])
    anchor = Anchor(store.engine, writer, spool, store.sink, interval_s=3600)
    await writer.start()
    await anchor.start()
    for hour in range(6):  # six flushes an hour apart, three rows each
        now[0] = 1_000.0 + 3600 * hour
        for n, record in enumerate(records(snapshot)):
            writer.count(record, n=n + 1)
        await writer.flush()
    await writer.stop()
    await anchor.stop()
    before = (await store.verify()).chains["node-r"].answers
    cuts = (await retain(store.engine, int((1_000 + 3600 * 3) * 1e6), key=spool.key,
                         sink=store.sink, store=store_id)).cuts  # fmt: skip
    assert [(c.chain, c.seq, c.rows) for c in cuts] == [("node-r", 9, 9)]
    assert [r["node_seq"] for r in await _rows(store.engine, "node-r")] == list(range(10, 19))
    result = await store.verify()
    assert result.breaks == [], _problems(result)
    assert [c.seq for c in result.cuts] == [9]
    assert result.chains["node-r"].answers == before  # the cut carries what went
    # A second cut counts on from the first as the sink has it, whatever the database's copy
    # of the checkpoints says (here: gone).
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(audit_checkpoints))
    cuts = (await retain(store.engine, int((1_000 + 3600 * 4) * 1e6), key=spool.key,
                         sink=store.sink, store=store_id)).cuts  # fmt: skip
    assert [(c.seq, c.rows) for c in cuts] == [(12, 3)]
    result = await store.verify()
    assert result.breaks == [], _problems(result)
    assert result.chains["node-r"].answers == before
    # Rows removed by anyone else, after the cut, are still a break.
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node_seq == 13))
    assert "sequence jumps from 12 to 14" in _problems(await store.verify())


async def test_old_rows_deleted_without_a_cut_are_a_break(store: Store, snapshot: Snapshot) -> None:
    a = await store.node("node-a")
    await _traffic(a, snapshot)
    async with store.engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node_seq <= 3))
    assert "sequence jumps from 0 to 4" in _problems(await store.verify())


async def test_a_spool_over_its_cap_raises_the_alarm_and_keeps_every_row(
    snapshot: Snapshot, tmp_path: Path, engine: AsyncEngine
) -> None:
    away = make_async_engine("postgresql://postgres@127.0.0.1:1/nothing")  # nothing listens
    spool = Spool(tmp_path / "spool-cap", "node-c")
    writer = AuditWriter(away, "node-c", spool, spool_max_bytes=2000)
    writer.count(records(snapshot)[0])
    await writer.flush()
    assert REGISTRY.get_sample_value("gtm_audit_spool_over_cap") == 0
    for record in records(snapshot):
        writer.count(record)
    await writer.flush()
    assert REGISTRY.get_sample_value("gtm_audit_spool_over_cap") == 1
    assert (REGISTRY.get_sample_value("gtm_audit_spool_bytes") or 0) > 2000
    await away.dispose()
    back = AuditWriter(engine, "node-c", Spool(tmp_path / "spool-cap", "node-c"))
    await back.start()
    await back.stop()
    assert len(await _rows(engine, "node-c")) == 4  # nothing was dropped
    assert REGISTRY.get_sample_value("gtm_audit_spool_over_cap") == 0


async def test_an_anchor_started_before_its_store_was_known_binds_it_and_is_trusted(
    store: Store, snapshot: Snapshot
) -> None:
    """A node that started with the database away has a spool bound to no store yet: its
    checkpoints must name the store as soon as the database answers, or verify (which reads
    only this store's checkpoints) would find its rows vouched for by nobody."""
    spool = Spool(store.tmp / "spool-late", "node-late")
    assert spool.bound_store() is None
    writer = AuditWriter(store.engine, "node-late", spool)
    anchor = Anchor(store.engine, writer, spool, store.sink, interval_s=3600)
    await writer.start()
    await anchor.start()
    await _traffic(Node(writer, anchor, spool), snapshot, flushes=2)
    assert spool.bound_store() == await read_store_id(store.engine)
    result = await store.verify()
    assert result.breaks == [], _problems(result)
    assert result.chains["node-late"].anchored_seq == 6
