"""Audit ingest and verification, each beside its baseline in the same run.

    python bench/audit.py [--rows 200000] [--postgres URL] [--verify-rows 100000 1000000]

Ingest (target: 50,000 rows/s or more on PostgreSQL): decisions counted into the batched writer
and flushed in windows of 5,000 rows (one row per distinct decision in a window), as a busy node
does: chained, MAC'd into the fsynced spool, inserted, spool cleared. Two mixes: ``cold``, every
row a decision never seen before (its row template rendered on first sight), and ``warm``, rows
of decisions the node has answered before (a pool of 20,000 client networks recurring window
after window, the steady state of resolver traffic). Baseline: the same rows' parameters
written the way the writer writes them (SQLite: the same executemany and batch size; PostgreSQL:
one COPY per window), with no chain, no spool and no yielding to the loop between slices: the
driver's ceiling.

Verify (target: memory flat in the number of rows): ``gtm audit verify``'s streaming check
against the checkpoints outside the database, beside the old whole-table ``query.verify`` (links
only, every row in memory), over stores of each size in --verify-rows. Peak memory is
tracemalloc's peak of Python allocations during the call.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import replace
from ipaddress import ip_address
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, select  # noqa: E402

from gtm.audit import migrate, query  # noqa: E402
from gtm.audit.anchor import Anchor, read_store_id  # noqa: E402
from gtm.audit.checkpoints import DirectorySink  # noqa: E402
from gtm.audit.database import make_async_engine  # noqa: E402
from gtm.audit.record import AuditRecord, record_of  # noqa: E402
from gtm.audit.schema import decisions  # noqa: E402
from gtm.audit.spool import Spool  # noqa: E402
from gtm.audit.verify import verify  # noqa: E402
from gtm.audit.writer import _COPY_SQL, AuditWriter, _insert_sql, _params  # noqa: E402
from gtm.decision.routing import Channel, DecisionRequest, decide  # noqa: E402
from gtm.runtime import build_snapshot  # noqa: E402
from gtm.settings import Settings  # noqa: E402

WINDOW = 5000


def _records(n: int) -> list[AuditRecord]:
    settings = Settings(config=ROOT / "examples" / "demo.yaml", policies=(ROOT / "policies",))
    snapshot = build_snapshot(settings, time.time())
    request = DecisionRequest(Channel.DNS, ip_address("198.51.100.7"), "chat-eu", "chat-eu")
    template = record_of(decide(request, snapshot, time.time()), channel="dns", name="chat-eu")
    # Distinct client networks: one row per record per flush, the writer's worst case.
    return [
        replace(template, client_network=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/32")
        for i in range(n)
    ]


async def _fresh(url: str) -> None:
    if url.startswith("postgresql"):
        await asyncio.to_thread(migrate.downgrade, url, "base")
    else:
        for suffix in ("", "-wal", "-shm"):
            path = Path(url.removeprefix("sqlite:///") + suffix)
            await asyncio.to_thread(path.unlink, missing_ok=True)
    await asyncio.to_thread(migrate.upgrade, url)


async def ingest(url: str, rows: int, work: Path, warm: bool) -> tuple[float, float]:
    """(GTM writer rows/s, baseline rows/s)."""
    pool = _records(20_000 if warm else rows)
    await _fresh(url)
    engine = make_async_engine(url)
    spool = Spool(work / f"spool-ingest-{url.split(':')[0]}-{warm}", "bench")
    store = await read_store_id(engine)
    assert store is not None
    spool.bind(store)
    writer = AuditWriter(engine, "bench", spool, max_pending=10**9)
    await writer.start()
    if warm:  # the node has answered each of these before
        for record in pool:
            writer.count(record)
        await writer.flush()
    async with engine.connect() as conn:
        before = await conn.scalar(select(func.count()).select_from(decisions))
    started = time.perf_counter()
    for i in range(0, rows, WINDOW):
        for k in range(i, min(rows, i + WINDOW)):
            writer.count(pool[k % len(pool)])
        await writer.flush()
    gtm_rate = rows / (time.perf_counter() - started)
    await writer.stop()
    # Baseline: the same rows' parameters, the same statement and batches, straight in.
    async with engine.connect() as conn:
        query = select(decisions).where(decisions.c.node_seq > before)
        stored = [dict(r._mapping) for r in await conn.execute(query)]
    assert len(stored) == rows, (len(stored), rows)
    await engine.dispose()
    await _fresh(url)
    engine = make_async_engine(url)
    params = [_params(r) for r in stored]
    async with engine.connect() as conn:
        sql = _insert_sql(conn.dialect.paramstyle)
        started = time.perf_counter()
        if conn.dialect.name == "postgresql":  # the writer's mechanism there: COPY per window
            pg = (await conn.get_raw_connection()).driver_connection
            for i in range(0, len(params), WINDOW):
                async with pg.cursor() as cursor, cursor.copy(_COPY_SQL) as copy:
                    for row in params[i : i + WINDOW]:
                        await copy.write_row(row)
                await pg.commit()
        else:
            for j in range(0, len(params), 64):  # the writer's insert batch
                await conn.exec_driver_sql(sql, params[j : j + 64])
                await conn.commit()
        base_rate = rows / (time.perf_counter() - started)
    await engine.dispose()
    return gtm_rate, base_rate


async def _measure(fn: Callable[[], Awaitable[Any]]) -> tuple[float, float, Any]:
    tracemalloc.start()
    started = time.perf_counter()
    result = await fn()
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return elapsed, peak / 2**20, result


async def verification(url: str, rows: int, work: Path) -> list[tuple[str, float, float]]:
    records = _records(min(rows, 100_000))
    await _fresh(url)
    engine = make_async_engine(url)
    spool = Spool(work / f"spool-verify-{url.split(':')[0]}-{rows}", "bench")
    store = await read_store_id(engine)
    assert store is not None
    spool.bind(store)
    sink = DirectorySink(work / f"checkpoints-{rows}")
    writer = AuditWriter(engine, "bench", spool, max_pending=10**9)
    anchor = Anchor(engine, writer, spool, sink, interval_s=3600, events=False)
    await writer.start()
    await anchor.start()
    done = 0
    while done < rows:
        n = min(WINDOW, rows - done)
        for k in range(n):
            writer.count(records[(done + k) % len(records)])
        await writer.flush()
        done += n
        if done % 100_000 == 0:
            await anchor.checkpoint("checkpoint")
    await writer.stop()
    await anchor.stop()

    async def streamed() -> int:
        result = await verify(engine, sink)
        assert not result.breaks, result.breaks[:3]
        return result.rows

    async def whole_table() -> int:
        checked, breaks = await query.verify(engine)
        assert not breaks
        return checked

    out = []
    for name, fn in (("whole table (old verify, links only)", whole_table),
                     ("streamed, against checkpoints", streamed)):  # fmt: skip
        elapsed, peak, checked = await _measure(fn)
        assert checked == rows, (checked, rows)
        out.append((name, elapsed, peak))
    await engine.dispose()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--verify-rows", type=int, nargs="+", default=[100_000, 1_000_000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stores = {"SQLite": f"sqlite:///{work / 'bench.sqlite3'}", "PostgreSQL": args.postgres}
        print(f"\ningest, {args.rows:,} rows in windows of {WINDOW:,}\n")
        print("| store | mix | GTM writer (chain, MAC'd spool, insert) | baseline | ratio |")
        print("| --- | --- | --- | --- | --- |")
        for name, url in stores.items():
            for warm in (True, False):
                rate, base = await ingest(url, args.rows, work, warm)
                mix = "warm" if warm else "cold"
                row = f"| {name} | {mix} | {rate:,.0f} rows/s | {base:,.0f} rows/s"
                print(f"{row} | {rate / base:.2f}x |")
        print("\nverify (PostgreSQL)\n")
        print("| rows | verifier | seconds | peak MiB |")
        print("| --- | --- | --- | --- |")
        for rows in args.verify_rows:
            for name, elapsed, peak in await verification(stores["PostgreSQL"], rows, work):
                print(f"| {rows:,} | {name} | {elapsed:.1f} | {peak:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
