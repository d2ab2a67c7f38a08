"""``gtm audit verify`` over large stores: time and peak memory, 10^5 to 10^7 rows.

    python bench/audit_verify.py [--sizes 100000 1000000 10000000] [--stores postgres sqlite]
                                 [--postgres URL] [--whole-up-to 1000000]

One store per database grows through the sizes (written by the real writer and anchor: a chain
of distinct decisions in windows of 5,000, a signed checkpoint every 100,000 rows; on PostgreSQL
the rows are spread over one day partition per million). At each size, each verifier runs in a
process of its own, so its peak resident set (``ru_maxrss`` of that process, from ``wait4``) is
its own:

* ``gtm audit verify``: every row streamed in pages and checked against its links and the
  signed checkpoints outside the database (what an auditor runs);
* ``read only`` (baseline, time): the same pages read with no check at all, the floor;
* ``whole table`` (baseline, memory): the verify before this one, every row in memory at once
  (links only); run up to ``--whole-up-to`` rows, as it needs memory in proportion.

PostgreSQL runs in a database made on the server at ``--postgres`` and dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.audit import postgres_database, records  # noqa: E402
from gtm.audit import migrate, query  # noqa: E402
from gtm.audit.anchor import Anchor, read_store_id  # noqa: E402
from gtm.audit.checkpoints import DirectorySink  # noqa: E402
from gtm.audit.database import make_async_engine  # noqa: E402
from gtm.audit.record import row_form  # noqa: E402
from gtm.audit.rows import static_params  # noqa: E402
from gtm.audit.schema import decisions  # noqa: E402
from gtm.audit.spool import Spool  # noqa: E402
from gtm.audit.verify import _pages, verify  # noqa: E402
from gtm.audit.writer import AuditWriter  # noqa: E402

WINDOW = 5000
CHECKPOINT_EVERY = 100_000
DAY = 86_400.0


class Grower:
    """One chain in one store, written up to each size in turn."""

    def __init__(self, url: str, work: Path) -> None:
        self.url, self.work = url, work
        self.sink = DirectorySink(work / "checkpoints")
        self.done = 0
        self.pool = records(100_000)
        for record in self.pool:
            row_form(record, static_params)  # templates once: the writer is not what is timed
        # A day per million rows, all of them past (PostgreSQL: a partition each).
        self.start = (time.time() // DAY - 12) * DAY

    async def grow(self, rows: int) -> float:
        """Write up to ``rows`` rows; the seconds it took."""
        engine = make_async_engine(self.url)
        spool = Spool(self.work / "spool", "bench")
        store = await read_store_id(engine)
        assert store is not None
        spool.bind(store)
        writer = AuditWriter(engine, "bench", spool, max_pending=10**9,
                             clock=lambda: self.start + self.done / 1e6 * DAY)  # fmt: skip
        anchor = Anchor(engine, writer, spool, self.sink, interval_s=1e9, events=False)
        started = time.perf_counter()
        await writer.start()
        await anchor.start()
        while self.done < rows:
            n = min(WINDOW, rows - self.done)
            for k in range(self.done, self.done + n):
                writer.count(self.pool[k % len(self.pool)])
            await writer.flush()
            self.done += n
            if self.done % CHECKPOINT_EVERY == 0:
                await anchor.checkpoint("checkpoint")
        await writer.stop()
        await anchor.stop()
        await engine.dispose()
        return time.perf_counter() - started


async def _child(url: str, sink: str, how: str) -> dict[str, Any]:
    engine = make_async_engine(url)
    started = time.perf_counter()
    if how == "verify":
        result = await verify(engine, DirectorySink(Path(sink)))
        rows, breaks = result.rows, len(result.breaks)
    elif how == "read":
        rows, breaks = 0, 0
        async for _ in _pages(engine, decisions, decisions.c.node_seq, decisions.c.node == "bench"):
            rows += 1
    else:
        rows, found = await query.verify(engine)
        breaks = len(found)
    elapsed = time.perf_counter() - started
    await engine.dispose()
    return {"rows": rows, "breaks": breaks, "seconds": elapsed, "peak_kib": _peak_kib()}


def _peak_kib() -> int:
    """This process's peak resident set since its exec (Linux: VmHWM). Not ``ru_maxrss``: that
    carries the high-water mark of the forked parent over into the exec'd child."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(url: str, sink: Path, how: str) -> tuple[dict[str, Any], float]:
    """Run one verifier in a process of its own; its result and peak RSS (MiB)."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", how, url, str(sink)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        check=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    return result, result["peak_kib"] / 1024


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--stores", nargs="+", default=["postgres", "sqlite"])
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--whole-up-to", type=int, default=1_000_000)
    args = parser.parse_args()
    lines = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("GTM_BENCH_DIR")) as tmp:
        for store in args.stores:
            work = Path(tmp) / store
            work.mkdir()
            with (
                postgres_database(args.postgres)
                if store == "postgres"
                else _nothing(f"sqlite:///{work / 'store.sqlite3'}")
            ) as url:
                await asyncio.to_thread(migrate.upgrade, url)
                grower = Grower(url, work)
                for size in sorted(args.sizes):
                    wrote = await grower.grow(size)
                    print(f"{store}: {size:,} rows written ({wrote:.0f} s)", file=sys.stderr)
                    hows = ["verify", "read"] + (["whole"] if size <= args.whole_up_to else [])
                    for how in hows:
                        result, rss = measure(url, grower.sink.directory, how)
                        assert result["rows"] == size, result
                        assert result["breaks"] == 0, result
                        seconds = result["seconds"]
                        lines.append(
                            f"| {store} | {size:,} | {_NAMES[how]} | {seconds:.1f} | "
                            f"{size / seconds:,.0f} | {rss:,.0f} |"
                        )
                        print(lines[-1], file=sys.stderr)
    print("\n| store | rows | verifier | seconds | rows/s | peak RSS MiB |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    print("\n".join(lines))


_NAMES = {
    "verify": "gtm audit verify (streamed, checkpoints)",
    "read": "read only, same pages (baseline: time)",
    "whole": "whole table in memory (baseline: memory)",
}


class _nothing:
    def __init__(self, value: str) -> None:
        self.value = value

    def __enter__(self) -> str:
        return self.value

    def __exit__(self, *_: object) -> None:
        return None


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(asyncio.run(_child(sys.argv[3], sys.argv[4], sys.argv[2]))))
    else:
        asyncio.run(main())
