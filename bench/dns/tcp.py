"""DNS over TCP, pipelined: GTM against gdnsd and PowerDNS, and against an earlier GTM.

    python bench/dns/tcp.py [--rounds 3] [--seconds 4] [--connections 4] [--outstanding 200]
                            [--baseline REV] [--json FILE]

Every server runs on the demo topology (as in ``bench/dns/run.py``, whose servers these are),
pinned to CPU 0; dnsperf, on CPU 1, keeps ``--connections`` TCP connections with
``--outstanding`` queries in flight across them (RFC 7766 pipelining: a resolver forwarding
truncated answers, or a DNS-over-TCP load balancer, asks this way), the closed loop's maximum
rate measured in rounds with the servers' order rotating. The query is chat.gtm.example A,
a cached answer in every server: what is measured is the TCP path itself. ``--baseline REV``
adds GTM as of git revision REV (a detached worktree, removed afterwards), so that a change to
the TCP path is measured side by side with the code before it, in the same run. Reported: each
server's median rate and, per round, its ratio to GTM's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench.dns.run import (  # noqa: E402
    CLIENT_CPU,
    Server,
    field,
    gdnsd_server,
    gtm_server,
    pdns_server,
    pinned,
    running,
)
from gtm.decision.geoip import default_database_path  # noqa: E402


def rate(server: Server, data: Path, args: argparse.Namespace) -> float:
    """Queries per second dnsperf got answered over TCP in one closed-loop run."""
    argv = [
        "dnsperf",
        *("-m", "tcp", "-s", "127.0.0.1", "-p", str(server.port), "-d", str(data)),
        *("-l", str(args.seconds), "-c", str(args.connections), "-q", str(args.outstanding)),
    ]
    out = subprocess.run(
        pinned(CLIENT_CPU, argv), capture_output=True, text=True, timeout=args.seconds + 60
    ).stdout
    lost = field(out, "Queries lost:")
    if lost:
        print(f"  {server.name}: {lost:.0f} queries lost", file=sys.stderr)
    return field(out, "Queries per second:")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--outstanding", type=int, default=200)
    parser.add_argument("--baseline", help="a git revision of GTM to compare with")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    geoip = default_database_path()
    with tempfile.TemporaryDirectory(prefix="gtm-bench-tcp-") as tmp:
        work = Path(tmp)
        data = work / "queries.txt"
        data.write_text("chat.gtm.example A\n")
        servers = [gtm_server(work, geoip)]
        baseline = None
        if args.baseline:
            baseline = work / "baseline"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline),
                 args.baseline],
                check=True, capture_output=True,
            )  # fmt: skip
            servers.append(gtm_server(work, geoip, f"gtm@{args.baseline}", root=baseline))
        servers += [s for s in (gdnsd_server(work, geoip), pdns_server(work, geoip)) if s]
        try:
            rates: dict[str, list[float]] = {s.name: [] for s in servers}
            for r in range(args.rounds):
                turn = servers[r % len(servers) :] + servers[: r % len(servers)]
                for server in turn:
                    with running(server):
                        rates[server.name].append(rate(server, data, args))
        finally:
            if baseline is not None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)],
                    check=False, capture_output=True,
                )  # fmt: skip
    ours = rates[servers[0].name]
    print(
        f"TCP, {args.connections} connections, {args.outstanding} outstanding, "
        f"{args.rounds} rounds of {args.seconds:g} s"
    )
    print("| server | queries/s (median) | vs gtm, per round |")
    print("| --- | --- | --- |")
    for server in servers:
        got = rates[server.name]
        ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(got, ours, strict=True))
        print(f"| {server.name} | {statistics.median(got):,.0f} | {ratios} |")
    if args.json:
        args.json.write_text(json.dumps(rates, indent=2))


if __name__ == "__main__":
    main()
