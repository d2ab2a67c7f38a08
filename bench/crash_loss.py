"""Answers lost to a ``kill -9`` under load, with the tally journal off and on, side by side.

    python bench/crash_loss.py [--rounds 3] [--rate 50000] [--before-kill 4] [--subnets 5000]
                               [--journal-interval 0.1] [--peak-seconds 5] [--baseline DIR]

Each round runs, in alternating order, GTM from this checkout with the tally journal off
(``GTM_AUDIT_JOURNAL_INTERVAL_S=0``: the counts of the open flush window live only in memory)
and on (``--journal-interval``, the default 100 ms), and with ``--baseline DIR`` the checkout in
DIR too. For each: ``gtm serve --dns`` is sent ``--rate`` queries a second with dnsperf
(thousands of distinct client subnets, so a flush window holds thousands of rows), killed with
SIGKILL after ``--before-kill`` seconds while the load goes on, restarted on the same store and
spool with no load (its spool and journal are replayed at start) and stopped cleanly. Lost
answers are those dnsperf received minus those the store counts: the answers counted in memory
and not yet on disk when the process died.

Then, unless ``--peak-seconds 0``, the cost of the journal on the answering path: each server
is started fresh, warmed for three seconds, and sent queries as fast as dnsperf can (closed loop)
for ``--peak-seconds``; its answers a second and its CPU per answer, and per round the ratio to
the journal-off server's, are printed beside the losses.
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
    TIMEOUT_S,
    Server,
    audited,
    cpu_seconds,
    dnsperf,
    field,
    gtm_server,
    pinned,
    running,
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


def peak(server: Server, data: Path, seconds: float, out: Path) -> tuple[float, float]:
    """(answers a second, CPU microseconds per answer) at the most dnsperf can send."""
    with running(server):
        dnsperf(server.port, data, True, 3.0, out)  # warm: every subnet decided and cached
        cpu = cpu_seconds(server.pid)
        output = dnsperf(server.port, data, True, seconds, out)
        cpu = cpu_seconds(server.pid) - cpu
    completed = field(output, "Queries completed")
    return field(output, "Queries per second"), cpu / max(1.0, completed) * 1e6


def servers(work: Path, geoip: Path, args: argparse.Namespace, r: int) -> list[Server]:
    """This round's servers, in this round's order."""
    made = []
    for name, interval in (("journal-off", 0.0), ("journal-on", args.journal_interval)):
        server = gtm_server(work, geoip, name)
        assert server.env is not None
        server.env["GTM_AUDIT_JOURNAL_INTERVAL_S"] = str(interval)
        made.append(server)
    if args.baseline is not None:
        made.append(gtm_server(work, geoip, "gtm-baseline", root=args.baseline.resolve()))
    return made[r % len(made) :] + made[: r % len(made)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=50_000)
    parser.add_argument("--before-kill", type=float, default=4.0)
    parser.add_argument("--subnets", type=int, default=5000)
    parser.add_argument("--journal-interval", type=float, default=0.1)
    parser.add_argument("--peak-seconds", type=float, default=5.0)
    parser.add_argument("--baseline", type=Path, help="another checkout, run as gtm-baseline")
    args = parser.parse_args()
    geoip = default_database_path()
    assert geoip is not None, "the bundled GeoLite2 database is missing"
    results: dict[str, list[tuple[int, int]]] = {}
    peaks: dict[str, list[tuple[float, float]]] = {}
    ratios: dict[str, list[tuple[float, float]]] = {}  # per round, to journal-off: rate, CPU
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, _ = write_sets(work, geoip, args.subnets)["ecs"]
        for r in range(args.rounds):
            for server in servers(work / f"round{r}", geoip, args, r):
                name = server.name
                got = one(server, data, args.rate, args.before_kill, work / f"{name}-{r}.txt")
                results.setdefault(name, []).append(got)
                print(f"round {r + 1} {name}: received {got[0]}, stored {got[1]}", flush=True)
            if args.peak_seconds <= 0:
                continue
            this_round: dict[str, tuple[float, float]] = {}
            for server in servers(work / f"peak{r}", geoip, args, r):
                qps, cost = peak(server, data, args.peak_seconds, work / "peak.txt")
                peaks.setdefault(server.name, []).append((qps, cost))
                this_round[server.name] = (qps, cost)
                print(f"round {r + 1} {server.name}: peak {qps:.0f}/s, {cost:.1f} us CPU/answer")
            off_qps, off_cost = this_round["journal-off"]
            for name, (qps, cost) in this_round.items():
                ratios.setdefault(name, []).append((qps / off_qps, cost / off_cost))
    print()
    print(
        f"at {args.rate} queries/s offered, {args.subnets} client subnets, killed after "
        f"{args.before_kill:g} s; peak: closed loop, {args.peak_seconds:g} s after a 3 s warm-up; "
        "medians of the rounds, ratios per round"
    )
    print(
        f"{'server':<14} {'received/s':>10} {'lost (median)':>14} {'lost per round':>28}"
        f" {'peak/s':>8} {'us CPU/ans':>10} {'peak vs off':>12} {'CPU vs off':>11}"
    )
    for name, rows in results.items():
        lost = [max(0, received - stored) for received, stored in rows]
        rate = statistics.median(received / args.before_kill for received, _ in rows)
        line = (
            f"{name:<14} {rate:>10.0f} {statistics.median(lost):>14.0f} "
            f"{', '.join(str(n) for n in lost):>28}"
        )
        if name in peaks:
            line += (
                f" {statistics.median(q for q, _ in peaks[name]):>8.0f}"
                f" {statistics.median(c for _, c in peaks[name]):>10.1f}"
                f" {statistics.median(q for q, _ in ratios[name]):>11.3f}x"
                f" {statistics.median(c for _, c in ratios[name]):>10.3f}x"
            )
        print(line)


if __name__ == "__main__":
    main()
