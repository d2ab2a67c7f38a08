"""Answers lost to a ``kill -9`` under load: what the audit store holds against what clients got.

    python bench/crash_loss.py [--rounds 3] [--rate 50000] [--before-kill 4] [--baseline DIR]

Each round starts ``gtm serve --dns`` (this checkout, and with ``--baseline DIR`` the checkout
in DIR too, one after the other in alternating order), sends it ``--rate`` queries a second with
dnsperf (thousands of distinct client subnets, so a flush window holds thousands of rows), kills
it with SIGKILL after ``--before-kill`` seconds while the load goes on, restarts it on the same
store and spool with no load (its spool and journal are replayed at start) and stops it cleanly.
Lost answers are those dnsperf received minus those the store counts: the answers counted in
memory and not yet on disk when the process died. Figures from one round compare side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dns.run import (
    CLIENT_CPU,
    ROOT,
    TIMEOUT_S,
    Server,
    audited,
    gtm_server,
    pinned,
    write_sets,
)
from gtm.decision.geoip import default_database_path


def _start(server: Server) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        pinned(server.cpus, server.argv),
        env=server.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=server.cwd,
    )


def _ready(server: Server, proc: subprocess.Popen[bytes]) -> None:
    """Ready when its metrics answer: no DNS query of ours is counted in the store."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=1
            ) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} did not start")
        time.sleep(0.2)


def one(server: Server, data: Path, rate: int, before_kill: float, out: Path) -> tuple[int, int]:
    """(answers received by dnsperf, answers in the store after the restart)."""
    proc = _start(server)
    _ready(server, proc)
    seconds = before_kill + 2
    argv = [
        "dnsperf",
        *("-s", "127.0.0.1", "-p", str(server.port), "-d", str(data), "-B"),
        *("-l", str(seconds), "-T", "1", "-c", "16", "-q", "200", "-t", str(TIMEOUT_S)),
        *("-Q", str(rate)),
    ]
    with out.open("w") as f:
        perf = subprocess.Popen(pinned(CLIENT_CPU, argv), stdout=f)
        time.sleep(before_kill)  # a benchmark's schedule: the kill lands under load
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        perf.wait(timeout=seconds + 30)
    match = re.search(r"Queries completed:\s+(\d+)", out.read_text())
    if match is None:
        raise RuntimeError(f"dnsperf printed no completed count:\n{out.read_text()[-2000:]}")
    received = int(match.group(1))
    again = _start(server)  # replays the spool (and journal) at start
    _ready(server, again)
    again.send_signal(signal.SIGTERM)
    again.wait(timeout=60)
    database = Path(server.env["GTM_DATABASE_URL"].removeprefix("sqlite:///"))
    return received, audited(database)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=50_000)
    parser.add_argument("--before-kill", type=float, default=4.0)
    parser.add_argument("--subnets", type=int, default=5000)
    parser.add_argument("--baseline", type=Path, help="another checkout, run as gtm-baseline")
    args = parser.parse_args()
    geoip = default_database_path()
    assert geoip is not None, "the bundled GeoLite2 database is missing"
    results: dict[str, list[tuple[int, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, _ = write_sets(work, geoip, args.subnets)["ecs"]
        for r in range(args.rounds):
            names = [("gtm", ROOT)]
            if args.baseline is not None:
                names.append(("gtm-baseline", args.baseline.resolve()))
            if r % 2:
                names.reverse()
            for name, root in names:
                server = gtm_server(work / f"round{r}", geoip, name, root=root)
                got = one(server, data, args.rate, args.before_kill, work / f"{name}-{r}.txt")
                results.setdefault(name, []).append(got)
                print(f"round {r + 1} {name}: received {got[0]}, stored {got[1]}", flush=True)
    print()
    print(f"{'server':<14} {'received/s':>10} {'lost (median)':>14} {'lost per round':>28}")
    for name, rows in results.items():
        lost = [max(0, received - stored) for received, stored in rows]
        rate = statistics.median(received / args.before_kill for received, _ in rows)
        print(
            f"{name:<14} {rate:>10.0f} {statistics.median(lost):>14.0f} "
            f"{', '.join(str(n) for n in lost):>28}"
        )


if __name__ == "__main__":
    main()
