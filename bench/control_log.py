"""What the signed control log costs, and how fast an entry is in force on every node.

    python bench/control_log.py [--entries 5000] [--rounds 10] [--database-url URL]

Two tables, every variant in the same run on the same store (quote the ratios: this machine is
shared and noisy):

* **reading**: a fresh reader's first read (every entry's signature checked and folded) and a
  running reader's refresh with nothing new and with one new entry (what every admin request
  and every node's state sync pay), against reading the same rows with no check at all (the
  baseline: what the tables cost before the log).
* **propagation**: two nodes on the store, each syncing every ``--sync`` seconds; a drain is
  appended as a signed entry and timed until both nodes answer with it, then undone. The
  baseline is the sync interval itself, the bound a version poll sets.

SQLite by default (a file in a temporary directory); ``--database-url`` for PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gtm.admin.signer import PRIVATE_NAME, PUBLIC_NAME, generate, load_signer  # noqa: E402
from gtm.audit import migrate  # noqa: E402
from gtm.audit.database import make_async_engine  # noqa: E402
from gtm.audit.schema import control_log  # noqa: E402
from gtm.control.entry import BOOTSTRAP  # noqa: E402
from gtm.control.log import ControlLog  # noqa: E402
from gtm.decision.snapshot import HealthState  # noqa: E402
from gtm.fleet import operator  # noqa: E402
from gtm.fleet.signed_documents import load_public_keys  # noqa: E402
from gtm.runtime import Runtime  # noqa: E402
from gtm.settings import Settings  # noqa: E402


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


async def reading(url: str, keys_dir: Path, entries: int) -> None:
    engine = make_async_engine(url)
    key = load_signer(keys_dir / PRIVATE_NAME)
    writer = ControlLog({}, key, public=key.public_key())
    await writer.refresh(engine)
    now = time.time()
    async with engine.begin() as conn:
        await writer.append(
            conn,
            "principal.create",
            BOOTSTRAP,
            {"id": "ops", "name": "ops", "roles": ["operator"]},
            now,
        )
        for i in range(entries - 1):
            region = ("eu-west", "us-east", "ap-south")[i % 3]
            await writer.append(
                conn, "override.set", "ops",
                {"region": region, "drain": i % 2 == 0, "weight": None, "force": None,
                 "force_until_us": None, "expires_at_us": None, "reason": f"r{i}", "broke": []},
                now,
            )  # fmt: skip
    keys = load_public_keys((keys_dir / PUBLIC_NAME,))

    async def plain() -> None:
        async with engine.connect() as conn:
            rows = (await conn.execute(select(control_log).order_by(control_log.c.seq))).all()
        assert len(rows) == entries

    async def cold() -> None:
        assert (await ControlLog(keys).refresh(engine)).seq == entries

    running = ControlLog(keys)
    await running.refresh(engine)

    async def idle() -> None:
        await running.refresh(engine)

    async def one_new() -> None:
        async with engine.begin() as conn:
            await writer.append(
                conn, "override.clear", "ops", {"region": "eu-west", "reason": "x"}, now
            )
            await writer.append(
                conn, "override.set", "ops",
                {"region": "eu-west", "drain": True, "weight": None, "force": None,
                 "force_until_us": None, "expires_at_us": None, "reason": "y", "broke": []},
                now,
            )  # fmt: skip
        await running.refresh(engine)

    rows = []
    base = None
    for name, fn, n in (
        ("read the rows, no check (baseline)", plain, 5),
        ("fresh reader: verify and fold all", cold, 5),
        ("running reader: refresh, nothing new", idle, 50),
        ("running reader: refresh, 2 new entries", one_new, 20),
    ):
        times = []
        for _ in range(n):
            started = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - started)
        median = statistics.median(times)
        base = base or median
        rows.append((name, median, median / base))
    await engine.dispose()
    print(f"\nreading a control log of {entries} entries ({url.split(':')[0]})\n")
    print("| variant | median ms | vs baseline |\n| --- | --- | --- |")
    for name, median, ratio in rows:
        print(f"| {name} | {_ms(median)} | {ratio:.2f}x |")


def _draining(node: Runtime) -> bool:
    health = node.store.current.health.get("ap-south")
    return health is not None and health.state is HealthState.DRAINING


async def _until(check: Callable[[], bool]) -> None:
    """Poll the nodes' snapshots: when they swap one in is what is timed."""
    while True:
        if check():
            return
        await asyncio.sleep(0.005)


async def propagation(url: str, keys_dir: Path, tmp: Path, rounds: int, sync_s: float) -> None:
    def settings(node: str) -> Settings:
        return Settings(
            config=ROOT / "examples" / "demo.yaml",
            policies=(ROOT / "policies",),
            database_url=url,
            spool_dir=tmp / f"spool-{node}",
            node_id=node,
            probes=False,
            document_keys=(keys_dir / PUBLIC_NAME,),
            state_sync_interval_s=sync_s,
        )

    nodes = [Runtime(settings(n)) for n in ("node-a", "node-b")]
    for n in nodes:
        await n.start()
    key = load_signer(keys_dir / PRIVATE_NAME)
    holder = ControlLog({}, key, public=key.public_key())
    took: list[float] = []
    try:
        for i in range(rounds):
            await holder.refresh(nodes[0].engine)
            started = time.monotonic()
            await operator.amend(
                nodes[0].engine, "ap-south", control=holder, by=BOOTSTRAP, actor="bench",
                reason=f"round {i}", now=time.time(), drain=True,
            )  # fmt: skip
            await _until(lambda: all(_draining(n) for n in nodes))
            took.append(time.monotonic() - started)
            await operator.clear(
                nodes[0].engine, "ap-south", control=holder, by=BOOTSTRAP, actor="bench",
                reason="undo", now=time.time(),
            )  # fmt: skip
            await _until(lambda: not any(_draining(n) for n in nodes))
    finally:
        for n in nodes:
            await n.stop()
    took.sort()
    print(f"\na drain in force on both of 2 nodes, {rounds} rounds ({url.split(':')[0]})\n")
    print("| measure | seconds | vs the sync interval |\n| --- | --- | --- |")
    print(f"| sync interval (baseline) | {sync_s:.3f} | 1.00x |")
    for name, value in (
        ("median", statistics.median(took)),
        ("p90", took[int(0.9 * (len(took) - 1))]),
        ("max", took[-1]),
    ):
        print(f"| {name} | {value:.3f} | {value / sync_s:.2f}x |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sync", type=float, default=0.5, help="the nodes' sync interval")
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        generate(tmp / "keys")
        url = args.database_url or f"sqlite:///{tmp / 'bench.sqlite3'}"
        if args.database_url:
            migrate.downgrade(url, "base")
        migrate.upgrade(url)
        await reading(url, tmp / "keys", args.entries)
        await propagation(url, tmp / "keys", tmp, args.rounds, args.sync)


if __name__ == "__main__":
    asyncio.run(main())
