"""How long `gtm` takes for commands whose work is small: start-up is most of what they cost.

    python bench/cli_startup.py [--baseline REV] [--runs 15]

Runs each command below ``--runs`` times (after one warm-up, so the file cache is warm for both)
with this tree's code and with the code of ``--baseline`` (a git revision, default the commit
before lazy command groups; its code, migrations and example documents are exported to a
temporary directory and run with the same interpreter and packages), alternating the two so a
busy machine slows both alike. The commands that read a database read the same fresh SQLite
file. Prints the median and the fastest wall time of each, and the ratio baseline / this tree
(of the medians). The target for ``gtm --help`` is under 0.3 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "9b881d5"  # main before `gtm` imported its command groups lazily

# What a command reads beside the code: run from the exported tree, as from a checkout.
TREE = ["gtm", "regional_lb", "migrations", "examples", "policies"]

COMMANDS = [
    ["--help"],
    ["region", "--help"],
    ["proposal", "show", "--help"],
    ["policy", "validate", "--help"],
    # These read a database (a fresh SQLite file, migrated once before the runs): start-up and
    # the few queries they make.
    ["audit", "tail"],
    ["region", "status"],
]


def export(revision: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision, *TREE],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def once(code: Path, args: list[str], database_url: str) -> float:
    env = os.environ | {"PYTHONPATH": str(code), "GTM_DATABASE_URL": database_url}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "gtm", *args],
        cwd=code,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "baseline"
        export(args.baseline, old)
        url = f"sqlite:///{Path(tmp) / 'gtm.sqlite3'}"
        once(ROOT, ["db", "upgrade"], url)
        print(f"gtm start-up, {args.runs} runs each; baseline {args.baseline} vs this tree")
        print(
            f"{'command':<32} {'baseline med':>12} {'min':>7} {'now med':>9} {'min':>7} "
            f"{'ratio':>6}"
        )
        for command in COMMANDS:
            once(old, command, url), once(ROOT, command, url)  # warm the file and bytecode caches
            before: list[float] = []
            after: list[float] = []
            for _ in range(args.runs):
                before.append(once(old, command, url))
                after.append(once(ROOT, command, url))
            b, a = statistics.median(before), statistics.median(after)
            label = "gtm " + " ".join(command)
            print(
                f"{label:<32} {b:>11.3f}s {min(before):>6.3f}s {a:>8.3f}s {min(after):>6.3f}s "
                f"{b / a:>5.1f}x"
            )


if __name__ == "__main__":
    main()
