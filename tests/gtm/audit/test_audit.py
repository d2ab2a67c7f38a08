from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import delete, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit import migrate, query
from gtm.audit.database import make_async_engine, make_sync_engine
from gtm.audit.record import AuditRecord, record_of, row_form
from gtm.audit.schema import decisions, include_object, metadata
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import Snapshot
from tests.support.tamper import triggers_off

DEAD_DB = "postgresql://postgres@127.0.0.1:1/nothing"  # nothing listens on port 1


def records(snapshot: Snapshot) -> list[AuditRecord]:
    out = []
    for client, service in (
        ("198.51.100.9", "chat"),
        ("203.0.113.5", "chat-eu"),
        ("100.99.1.1", "chat"),
    ):
        req = DecisionRequest(Channel.DNS, ip_address(client), service, service)
        out.append(
            record_of(
                decide(req, snapshot, 1000.0),
                channel="dns",
                name=service,
                query_type="A",
                response="NOERROR",
            )
        )
    return out


async def test_identical_decisions_share_a_row_and_the_chain_verifies(
    engine: AsyncEngine,
    snapshot: Snapshot,
    tmp_path: Path,
) -> None:
    writer = AuditWriter(engine, "node-a", Spool(tmp_path / "spool", "node-a"))
    await writer.start()
    a, b, c = records(snapshot)
    for _ in range(5):
        writer.count(a)
    writer.count(b, n=2)
    assert await writer.flush() == 2
    writer.count(a)
    writer.count(c)
    await writer.stop()
    rows = await query.tail(engine, 10)
    assert [(r["node_seq"], r["count"]) for r in rows] == [(1, 5), (2, 2), (3, 1), (4, 1)]
    assert await query.total_count(engine) == writer.counted == 9
    first = rows[0]
    assert first["name"] == "chat"
    assert first["region"] == "eu-central"
    assert first["client_network"] == "198.51.100.0/24"
    assert first["country"] == "DE"
    assert first["policy_version"] == snapshot.policy.version
    assert first["candidates"][0]["region"] == "us-east"
    assert rows[1]["matched_rules"] == ["eu-personal-stays-in-eu"]
    checked, breaks = await query.verify(engine)
    assert checked == 4
    assert breaks == []


async def test_tampering_is_detected(
    engine: AsyncEngine, snapshot: Snapshot, tmp_path: Path
) -> None:
    writer = AuditWriter(engine, "node-a", Spool(tmp_path / "spool", "node-a"))
    await writer.start()
    for rec in records(snapshot):
        writer.count(rec)
        await writer.flush()
    await writer.stop()
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(update(decisions).where(decisions.c.node_seq == 1).values(count=99))
    _, breaks = await query.verify(engine)
    assert [(b.node_seq, b.problem) for b in breaks] == [(1, "row content does not match its hash")]
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(delete(decisions).where(decisions.c.node_seq == 2))
    _, breaks = await query.verify(engine)
    assert any(b.node_seq == 3 and "sequence jumps" in b.problem for b in breaks)


async def test_database_outage_spools_and_a_restart_replays_everything(
    engine: AsyncEngine,
    snapshot: Snapshot,
    tmp_path: Path,
) -> None:
    spool_dir = tmp_path / "spool"
    dead = make_async_engine(DEAD_DB)
    down = AuditWriter(dead, "node-a", Spool(spool_dir, "node-a"))
    await down.start()  # no database: starts anyway, chain from genesis
    a, b, c = records(snapshot)
    down.count(a, 3)
    assert await down.flush() == 0
    assert down.last_error is not None
    down.count(b)
    down.count(c, 2)
    await down.stop()  # shutdown with the database away: rows stay in the spool
    await dead.dispose()
    assert len(Spool(spool_dir, "node-a").pending()) == 3

    up = AuditWriter(engine, "node-a", Spool(spool_dir, "node-a"))
    await up.start()  # replays the spool before anything else
    assert Spool(spool_dir, "node-a").pending() == []
    up.count(a)
    await up.stop()
    assert await query.total_count(engine) == down.counted + up.counted == 7
    rows = await query.tail(engine, 10)
    assert [r["node_seq"] for r in rows] == [1, 2, 3, 4]
    assert (await query.verify(engine))[1] == []


def tear(spool: Spool) -> None:
    with open(spool.path, "a", encoding="utf-8") as f:
        f.write('{"torn": ')


async def test_replay_after_a_crash_does_not_duplicate(
    engine: AsyncEngine,
    snapshot: Snapshot,
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "spool", "node-a")
    writer = AuditWriter(engine, "node-a", spool)
    await writer.start()
    writer.count(records(snapshot)[0], 4)
    await writer.flush()
    committed = await query.tail(engine, 10)
    # A crash between the commit and emptying the spool leaves the rows in both places.
    spool.append([{k: v for k, v in r.items() if k != "id"} for r in committed])
    tear(spool)  # and a torn final line from the crash
    restarted = AuditWriter(engine, "node-a", Spool(tmp_path / "spool", "node-a"))
    await restarted.start()
    await restarted.stop()
    assert await query.total_count(engine) == 4
    assert (await query.verify(engine))[1] == []


class CountingSpool(Spool):
    """A real spool that counts how often the writer reads it back."""

    reads = 0

    def pending(self) -> list[dict[str, Any]]:
        self.reads += 1
        return super().pending()


async def test_a_quiet_interval_does_not_make_the_next_flush_replay_the_spool(
    engine: AsyncEngine,
    snapshot: Snapshot,
    tmp_path: Path,
) -> None:
    # Reading the spool back parses every row from JSON: it is for after an outage or a crash,
    # not for the flush that follows a second without answers.
    spool = CountingSpool(tmp_path / "spool", "node-a")
    writer = AuditWriter(engine, "node-a", spool)
    await writer.start()  # the first flush after a start does read it
    started_reads = spool.reads
    a, b, c = records(snapshot)
    writer.count(a)
    assert await writer.flush() == 1
    assert await writer.flush() == 0  # a quiet interval
    writer.count(b, 2)
    writer.count(c)
    assert await writer.flush() == 2
    assert spool.reads == started_reads
    await writer.stop()
    assert await query.total_count(engine) == 4
    assert (await query.verify(engine))[1] == []


def test_a_torn_spool_line_costs_only_itself(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", "node-a")
    spool.append([{"node_seq": 1, "row_hash": "a"}])
    tear(spool)  # a write cut short by a crash
    spool.append([{"node_seq": 2, "row_hash": "b"}, {"node_seq": 3, "row_hash": "c"}])
    assert [r["node_seq"] for r in spool.pending()] == [1, 2, 3]
    head = spool.chain_head()
    assert head is not None and (head.seq, head.hash) == (3, "c")


def test_an_append_that_fails_part_way_leaves_no_rows_past_the_chain_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's lines are rendered as the spool writes them: a failure part way (a full
    disk, a line that would not render) must not leave the rows written so far behind the
    chain's saved end, where a later append would chain a second row of the same sequence."""
    from gtm.audit import spool as spool_module

    monkeypatch.setattr(spool_module, "_COPY_CHUNK", 64)  # written in many chunks
    spool = Spool(tmp_path / "spool", "node-a")
    spool.append([{"node_seq": 1, "row_hash": "a"}])
    size = spool.size()

    def lines() -> Iterator[bytes]:
        for n in range(2, 40):
            yield b'{"node_seq":%d,"row_hash":"%d"}\n' % (n, n)
        raise OSError("no space left on device")

    with pytest.raises(OSError, match="no space"):
        spool.append_lines(lines(), 39, "39")
    assert spool.size() == size
    assert [r["node_seq"] for r in spool.pending()] == [1]
    head = spool.chain_head()
    assert head is not None and (head.seq, head.hash) == (1, "a")
    spool.append([{"node_seq": 2, "row_hash": "b"}])
    assert [r["node_seq"] for r in spool.pending()] == [1, 2]


def test_the_spool_read_back_in_parts_loses_no_row_around_a_refused_line(tmp_path: Path) -> None:
    """A writer far behind reads its spool a part at a time (pending_through(max_rows)); a
    refused line inside the first part is set aside and every row after the part's end is
    still there for the next read (review: the line read past the part's end was lost)."""
    spool = Spool(tmp_path / "spool", "node-a")
    spool.append([{"node_seq": 1, "row_hash": "a"}])
    tear(spool)
    spool.append([{"node_seq": n, "row_hash": str(n)} for n in range(2, 8)])
    taken: list[int] = []
    while True:
        rows, end = spool.pending_through(3)
        taken += [r["node_seq"] for r in rows]
        spool.discard_through(end)
        if len(rows) < 3:
            break
    assert taken == [1, 2, 3, 4, 5, 6, 7]
    assert spool.pending() == []


def test_a_spool_drained_in_parts_is_cut_off_rarely_and_loses_nothing_to_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cut of the spool rewrites what follows it: a long spool drained a part at a time
    was rewritten after every part (quadratic). Parts done with are skipped until at least
    half the file is, then cut off at once. Skipping is in memory: a restart reads the skipped
    rows again (the writer skips what the database has by sequence number), never fewer."""
    from gtm.audit import spool as spool_module

    rewrites: list[int] = []  # bytes rewritten into the spool file, per cut
    real_cut = spool_module._cut_private

    def counted(path: Path, offset: int) -> int:
        kept = real_cut(path, offset)
        rewrites.append(kept)
        return kept

    monkeypatch.setattr(spool_module, "_cut_private", counted)
    spool = Spool(tmp_path / "spool", "node-a")
    # Forty rows of one length: a part of four is a tenth of the file.
    spool.append([{"node_seq": n, "row_hash": str(n)} for n in range(10, 50)])
    size = spool.size()
    taken: list[int] = []

    def part() -> int:
        rows, end = spool.pending_through(4)
        taken.extend(r["node_seq"] for r in rows)
        spool.discard_through(end)
        return len(rows)

    for _ in range(4):  # four parts: under half the file
        part()
    assert taken == list(range(10, 26)) and rewrites == []
    # A restart (a crash) reads the skipped rows again, and loses none after them.
    restarted = Spool(tmp_path / "spool", "node-a")
    assert [r["node_seq"] for r in restarted.pending()] == list(range(10, 50))
    part()  # the fifth: half the file done with, cut off at once
    assert len(rewrites) == 1 and spool.size() == size // 2
    while part() == 4:
        pass
    assert taken == list(range(10, 50))
    assert spool.pending() == []
    # Each cut halves what is left: all of them rewrite less than the spool held (before:
    # after each of the ten parts, what followed it, four and a half times the spool).
    assert sum(rewrites) < size


async def test_rows_spooled_after_a_torn_line_are_not_lost(
    engine: AsyncEngine,
    snapshot: Snapshot,
    tmp_path: Path,
) -> None:
    # A crash left half a line; then the database was away for a while, then back.
    spool_dir = tmp_path / "spool"
    tear(Spool(spool_dir, "node-a"))
    dead = make_async_engine(DEAD_DB)
    down = AuditWriter(dead, "node-a", Spool(spool_dir, "node-a"))
    await down.start()
    a, b, _ = records(snapshot)
    down.count(a, 5)
    assert await down.flush() == 0
    await down.stop()
    await dead.dispose()
    assert [r["count"] for r in Spool(spool_dir, "node-a").pending()] == [5]

    up = AuditWriter(engine, "node-a", Spool(spool_dir, "node-a"))
    await up.start()  # replays the five
    assert await up.flush() == 0  # a quiet interval
    up.count(b)
    await up.stop()
    assert await query.total_count(engine) == down.counted + up.counted == 6
    assert (await query.verify(engine))[1] == []


async def test_two_nodes_keep_separate_chains(
    engine: AsyncEngine, snapshot: Snapshot, tmp_path: Path
) -> None:
    w1 = AuditWriter(engine, "node-1", Spool(tmp_path / "s1", "node-1"))
    w2 = AuditWriter(engine, "node-2", Spool(tmp_path / "s2", "node-2"))
    await w1.start()
    await w2.start()
    for rec in records(snapshot):
        w1.count(rec)
        w2.count(replace(rec, channel="http"))
        await w1.flush()
        await w2.flush()
    await w1.stop()
    await w2.stop()
    checked, breaks = await query.verify(engine)
    assert checked == 6
    assert breaks == []
    exported = [r async for r in query.export(engine)]
    assert len(exported) == 6
    assert json.loads(json.dumps(exported)) == exported  # exported rows survive JSON unchanged
    assert {r["node"] for r in exported} == {"node-1", "node-2"}
    assert {r["channel"] for r in exported} == {"dns", "http"}


def test_migrations_match_the_models_and_go_down_and_up(database_url: str) -> None:
    engine = make_sync_engine(database_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"include_object": include_object})
            diff = compare_metadata(context, metadata)
        assert diff == []
        migrate.downgrade(database_url, "base")
        with engine.connect() as conn:
            tables = (
                conn.execute(
                    text(
                        "SELECT name FROM sqlite_master WHERE type='table'"
                        if engine.dialect.name == "sqlite"
                        else "SELECT tablename FROM pg_tables WHERE schemaname='public'"
                    )
                )
                .scalars()
                .all()
            )
        assert "decisions" not in tables
        assert migrate.current_revision(database_url) is None
        migrate.upgrade(database_url)
        assert migrate.current_revision(database_url) == migrate.head_revision(database_url)
    finally:
        engine.dispose()


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'wal.sqlite3'}"
    migrate.upgrade(url)
    engine = make_sync_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    engine.dispose()


def test_row_templates_render_the_canonical_row_byte_for_byte(snapshot: Snapshot) -> None:
    # The writer renders rows from per-record templates; the chain is verified with row_hash
    # over the whole row. Both must hash the same bytes, whatever the per-row values are.
    import hashlib

    import orjson

    from gtm.audit.record import HASHED_COLUMNS, row_body, row_form, row_hash, row_of

    for record in records(snapshot):
        form = row_form(record, lambda row: ())
        for count, first, last, node, seq in (
            (1, 0, 0, "a", 1),
            (7, 10**15, 2 * 10**15, "n/w1", 99),
        ):
            row = row_of(
                record, node=node, node_seq=seq, first_at_us=first, last_at_us=last, count=count
            )
            body = row_body(form, count, first, last, orjson.dumps(node), seq)
            canonical = orjson.dumps(
                {k: row[k] for k in HASHED_COLUMNS}, option=orjson.OPT_SORT_KEYS
            )
            assert body == canonical
            assert hashlib.sha256(b"prev" + body).hexdigest() == row_hash("prev", row)


def test_row_forms_of_one_answer_for_many_client_networks_share_its_text(
    snapshot: Snapshot,
) -> None:
    """A row form lives as long as its record: thousands under a flood of client networks, each
    given one of a few answers. The answer's part of the canonical JSON (answer, candidates)
    and its tail (outcome, versions), and the candidates' database text, are one object for
    all of them, not a copy each (memray: 20 MiB of a node's heap under a flood were forms)."""
    import dataclasses

    from gtm.audit.rows import static_params

    base = records(snapshot)[0]
    forms = [
        row_form(dataclasses.replace(base, client_network=f"10.0.{i}.0/24"), static_params)
        for i in range(3)
    ]
    for a, b in itertools.pairwise(forms):
        assert a.segments[1] != b.segments[1]  # the client network: each its own
        assert a.segments[0] is b.segments[0] and a.segments[-1] is b.segments[-1]
        shared_columns = [x for x, y in zip(a.columns, b.columns, strict=True) if x is y]
        assert any(isinstance(x, str) and '"region"' in x for x in shared_columns)


async def test_paced_work_rests_less_while_new_decisions_pile_up(
    engine: AsyncEngine, tmp_path: Path, snapshot: Snapshot
) -> None:
    """Paced flushes rest ``rest`` times as long as they worked; with the open window past half
    of max_pending they rest no longer than they worked, so the writer keeps up with a flood of
    new decisions instead of the DNS responder shedding them."""
    writer = AuditWriter(engine, "node-a", Spool(tmp_path / "spool", "node-a"), max_pending=4)
    assert writer._pace() == writer.rest > 1.0
    a, b, _ = records(snapshot)
    writer.count(a, n=5)  # many answers, one decision: no pressure
    assert writer._pace() == writer.rest
    writer.count(b)
    assert writer._pace() == 1.0
    await writer.flush()  # sealed and written: back to the usual pace
    assert writer._pace() == writer.rest
