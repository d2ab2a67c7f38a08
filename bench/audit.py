"""Audit ingest: rows a second into SQLite and PostgreSQL, beside raw inserts in the same run.

    python bench/audit.py [--rows 200000] [--rounds 3] [--postgres URL]

Every row is a distinct decision (a client network of its own), counted into the batched writer,
which makes each window's tallies rows, chains them (SHA-256), appends them MAC'd to the fsynced
spool, inserts them (PostgreSQL: one COPY per window into the day's partition; SQLite:
executemany batches of 64) and clears the spool. Two ways of driving it:

* ``flush``: count a window of 5,000, ``flush()``, repeat: each step waits for the one before;
* ``background``: the node's own loop (:meth:`AuditWriter.start`), a window sealed as soon as
  5,000 decisions are pending, while earlier windows are still being written; unpaced
  (``rest=0``). A node paces its writer (it rests six times as long as each slice of work took,
  to stay out of the answering paths' way), so these are the writer's ceiling, not what a node
  lets it spend.

Two mixes: ``warm``, decisions whose row templates are rendered (answered before: the steady
state of resolver traffic), and ``cold``, every row a decision never seen before.

Baselines, the same rows' parameters straight into a fresh table with the driver, no chain, no
spool, no event loop turns in between: SQLite executemany with the writer's statement and batch
(a commit each); PostgreSQL COPY per window of 5,000, in text format (the writer's) and in
binary (faster for the server; it did nothing for the writer, whose own CPU is its bound).
PostgreSQL runs in a database made on the server at ``--postgres`` and dropped afterwards.
Variants interleave in each round; the table gives medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from ipaddress import ip_address
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from sqlalchemy import BigInteger, Integer, func, select  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from gtm.audit import migrate  # noqa: E402
from gtm.audit.anchor import read_store_id  # noqa: E402
from gtm.audit.database import make_async_engine  # noqa: E402
from gtm.audit.record import AuditRecord, record_of, row_form  # noqa: E402
from gtm.audit.rows import (  # noqa: E402
    COLUMNS,
    COPY_SQL,
    insert_sql,
    spooled_params,
    static_params,
)
from gtm.audit.schema import decisions  # noqa: E402
from gtm.audit.spool import Spool  # noqa: E402
from gtm.audit.writer import AuditWriter  # noqa: E402
from gtm.decision.routing import Channel, DecisionRequest, decide  # noqa: E402
from gtm.runtime import build_snapshot  # noqa: E402
from gtm.settings import Settings  # noqa: E402

WINDOW = 5000
# Binary COPY's types, JSON as text (the server's json input reads the bytes as they are).
_BINARY_TYPES = [
    "int8" if isinstance(decisions.c[c].type, BigInteger)
    else "int4" if isinstance(decisions.c[c].type, Integer)
    else "text"
    for c in COLUMNS
]  # fmt: skip


def records(n: int, salt: int = 0) -> list[AuditRecord]:
    """``n`` distinct decisions (one client network each); ``salt`` makes another set."""
    settings = Settings(config=ROOT / "examples" / "demo.yaml", policies=(ROOT / "policies",))
    snapshot = build_snapshot(settings, time.time())
    request = DecisionRequest(Channel.DNS, ip_address("198.51.100.7"), "chat-eu", "chat-eu")
    template = record_of(decide(request, snapshot, time.time()), channel="dns", name="chat-eu")
    return [
        replace(template, client_network=f"{10 + salt}.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/32")
        for i in range(n)
    ]


@contextlib.contextmanager
def postgres_database(server: str) -> Iterator[str]:
    """A database of its own on ``server`` (never another's), dropped afterwards."""
    name = f"gtm_bench_{secrets.token_hex(4)}"
    admin = make_url(server).set(drivername="postgresql")
    conninfo = admin.render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def fresh(url: str) -> None:
    if url.startswith("postgresql"):
        await asyncio.to_thread(migrate.downgrade, url, "base")
    else:
        for suffix in ("", "-wal", "-shm"):
            path = Path(url.removeprefix("sqlite:///") + suffix)
            await asyncio.to_thread(path.unlink, missing_ok=True)
    await asyncio.to_thread(migrate.upgrade, url)


async def _writer(url: str, work: Path, **options: Any) -> AuditWriter:
    await fresh(url)
    engine = make_async_engine(url)
    spool = Spool(work / f"spool-{secrets.token_hex(4)}", "bench")
    store = await read_store_id(engine)
    assert store is not None
    spool.bind(store)
    writer = AuditWriter(engine, "bench", spool, **options)
    await writer.start()
    return writer


async def _stored(writer: AuditWriter, rows: int) -> list[dict[str, Any]]:
    async with writer.engine.connect() as conn:
        stored = [dict(r._mapping) for r in await conn.execute(select(decisions))]
    assert len(stored) == rows, (len(stored), rows)
    assert sum(r["count"] for r in stored) == rows  # no two decisions shared a row
    return stored


async def by_flush(url: str, pool: list[AuditRecord], work: Path) -> tuple[float, Any]:
    writer = await _writer(url, work, max_pending=10**9)
    started = time.perf_counter()
    for i in range(0, len(pool), WINDOW):
        for record in pool[i : i + WINDOW]:
            writer.count(record)
        await writer.flush()
    rate = len(pool) / (time.perf_counter() - started)
    await writer.stop()
    stored = await _stored(writer, len(pool))
    await writer.engine.dispose()
    return rate, stored


async def in_background(url: str, pool: list[AuditRecord], work: Path) -> float:
    writer = await _writer(url, work, max_pending=WINDOW, flush_interval=0.05, rest=0.0)
    started = time.perf_counter()
    for i in range(0, len(pool), 500):
        for record in pool[i : i + 500]:
            writer.count(record)
        await asyncio.sleep(0)  # the answering path's turn ends; the writer's slices run
    await writer.stop()  # the last window flushed: every row committed
    rate = len(pool) / (time.perf_counter() - started)
    await _stored(writer, len(pool))
    await writer.engine.dispose()
    return rate


async def baseline(url: str, params: list[tuple[Any, ...]], binary: bool = False) -> float:
    await fresh(url)
    engine = make_async_engine(url)
    async with engine.connect() as conn:
        started = time.perf_counter()
        if conn.dialect.name == "postgresql":
            pg = (await conn.get_raw_connection()).driver_connection
            assert pg is not None
            sql = f"{COPY_SQL} (FORMAT BINARY)" if binary else COPY_SQL
            for i in range(0, len(params), WINDOW):
                async with pg.cursor() as cursor, cursor.copy(sql) as copy:
                    if binary:
                        copy.set_types(_BINARY_TYPES)
                    for row in params[i : i + WINDOW]:
                        await copy.write_row(row)
                await pg.commit()
        else:
            sql = insert_sql(conn.dialect.paramstyle)
            for j in range(0, len(params), 64):  # the writer's insert batch
                await conn.exec_driver_sql(sql, params[j : j + 64])
                await conn.commit()
        rate = len(params) / (time.perf_counter() - started)
        count = await conn.scalar(select(func.count()).select_from(decisions))
        assert count == len(params), (count, len(params))
    await engine.dispose()
    return rate


async def round_of(
    stores: dict[str, str], rows: int, work: Path, salt: int
) -> dict[tuple[str, str], float]:
    """One round: every (store, variant) once; rates in rows a second."""
    out: dict[tuple[str, str], float] = {}
    for name, url in stores.items():
        for mix in ("warm", "cold"):
            for how in ("flush", "background"):
                pool = records(rows, salt=salt)
                if mix == "warm":
                    for record in pool:
                        row_form(record, static_params)
                if how == "flush":
                    rate, stored = await by_flush(url, pool, work)
                    params = [spooled_params(r) for r in stored]
                else:
                    rate = await in_background(url, pool, work)
                out[(name, f"GTM writer, {mix}, {how}")] = rate
        if name == "PostgreSQL":
            out[(name, "raw COPY per window, text")] = await baseline(url, params)
            out[(name, "raw COPY per window, binary")] = await baseline(url, params, binary=True)
        else:
            out[(name, "raw executemany, batches of 64")] = await baseline(url, params)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="a server where the bench may create and drop a database")  # fmt: skip
    args = parser.parse_args()
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, postgres_database(args.postgres) as pg_url:
        work = Path(tmp)
        stores = {"SQLite": f"sqlite:///{work / 'bench.sqlite3'}", "PostgreSQL": pg_url}
        for n in range(args.rounds):
            for key, rate in (await round_of(stores, args.rows, work, n)).items():
                results.setdefault(key, []).append(rate)
            print(f"round {n + 1} of {args.rounds} done", file=sys.stderr)
    print(f"\ningest, {args.rows:,} distinct decisions, windows of {WINDOW:,}, "
          f"median of {args.rounds} round(s)\n")  # fmt: skip
    print("| store | variant | rows/s | vs raw | rounds |")
    print("| --- | --- | ---: | ---: | --- |")
    for store in ("SQLite", "PostgreSQL"):
        raw = (
            "raw COPY per window, text" if store == "PostgreSQL"
            else "raw executemany, batches of 64"
        )  # fmt: skip
        base = statistics.median(results[(store, raw)])
        for (name, variant), rates in results.items():
            if name != store:
                continue
            median = statistics.median(rates)
            each = ", ".join(f"{r / 1000:.1f}k" for r in rates)
            print(f"| {store} | {variant} | {median:,.0f} | {median / base:.2f}x | {each} |")


if __name__ == "__main__":
    asyncio.run(main())
