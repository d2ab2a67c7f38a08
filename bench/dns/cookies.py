"""What DNS cookies cost the responder: queries with a cookie against the same queries without,
side by side in one run.

    python bench/dns/cookies.py [--rounds 3] [--seconds 5] [--subnets 2000] [--baseline DIR]

One GTM node (pinned to CPU 0; dnsperf on CPU 1, closed loop) with a known cookie secret, so the
query sets can carry server cookies it accepts. Sets, all for chat.gtm.example A from
127.0.0.1:

- ``plain``: no EDNS option (the first level: one entry per sender and bytes);
- ``cookie``: a client cookie and a valid server cookie for 127.0.0.1, as a resolver that
  speaks cookies sends once it has one (echoed back: the first level answers it too);
- ``client-only``: a client cookie alone (a new server cookie each time the entry is made);
- ``ecs`` and ``ecs+cookie``: an ECS option of one of ``--subnets`` /24s, without and with a
  valid cookie (with one, the ECS path does not take it: the slow path answers).

Each round measures every set once, the order rotating; ratios are to ``plain`` in the same
round, then the median. ``--baseline DIR`` adds the ``plain`` set against GTM from another
checkout (e.g. ``git worktree add /tmp/base HEAD~1``) in the same rounds: what the change
to the first level's answering costs queries without cookies.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import struct
import sys
import tempfile
import time
from ipaddress import ip_address
from pathlib import Path

import dns.edns
import dns.message

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench.dns.run import Server, dnsperf, ecs_networks, field, gtm_server, running  # noqa: E402
from gtm.decision.geoip import default_database_path  # noqa: E402
from gtm.geodns.cookies import ServerCookies  # noqa: E402

SECRET = bytes(range(16))
CLIENT = bytes.fromhex("0102030405060708")


def _write(path: Path, wires: list[bytes]) -> Path:
    with path.open("wb") as f:
        for wire in wires:
            f.write(struct.pack("!H", len(wire)) + wire)
    return path


def write_sets(work: Path, subnets: int) -> dict[str, Path]:
    # Stamped now: valid for the next hour, echoed for the next half (the runs are shorter).
    server = ServerCookies(SECRET).make(CLIENT, ip_address("127.0.0.1"), int(time.time()))
    cookie = dns.edns.GenericOption(10, CLIENT + server)
    client_only = dns.edns.GenericOption(10, CLIENT)

    def query(*options: dns.edns.Option) -> bytes:
        return dns.message.make_query(
            "chat.gtm.example.", "A", use_edns=0 if options else False, options=list(options)
        ).to_wire()

    nets = ecs_networks(default_database_path(), subnets)
    return {
        "plain": _write(work / "plain.bin", [query()]),
        "cookie": _write(work / "cookie.bin", [query(cookie)]),
        "client-only": _write(work / "client.bin", [query(client_only)]),
        "ecs": _write(work / "ecs.bin", [query(dns.edns.ECSOption(n, 24)) for n in nets]),
        "ecs+cookie": _write(
            work / "ecs-cookie.bin", [query(cookie, dns.edns.ECSOption(n, 24)) for n in nets]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--subnets", type=int, default=2000)
    parser.add_argument("--baseline", type=Path, help="another checkout's root (plain set only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sets = write_sets(work, args.subnets)
        server = gtm_server(work, default_database_path())
        server.env["GTM_DNS_COOKIE_SECRET"] = SECRET.hex()
        runs: list[tuple[Server, Path]] = [(server, p) for p in sets.values()]
        names = [f"gtm {k}" for k in sets]
        base = None
        if args.baseline is not None:
            base = gtm_server(work, default_database_path(), "gtm-baseline", root=args.baseline)
            runs.append((base, sets["plain"]))
            names.append("baseline plain")
        out = work / "dnsperf.out"
        rates: dict[str, list[float]] = {n: [] for n in names}
        with contextlib.ExitStack() as stack:
            stack.enter_context(running(server))
            if base is not None:
                stack.enter_context(running(base))
            for srv, data in runs:
                dnsperf(srv.port, data, True, 2, out)  # warm
            for rnd in range(args.rounds):
                shift = rnd % len(runs)
                order = [*range(shift, len(runs)), *range(shift)]
                for i in order:
                    srv, data = runs[i]
                    result = dnsperf(srv.port, data, True, args.seconds, out)
                    rates[names[i]].append(field(result, "Queries per second"))
                print(
                    f"round {rnd + 1}/{args.rounds}: "
                    + ", ".join(f"{n} {v[-1]:,.0f}/s" for n, v in rates.items()),
                    file=sys.stderr,
                    flush=True,
                )
    plain = rates["gtm plain"]
    print(f"\nDNS cookies, GTM on CPU 0, dnsperf on CPU 1 (closed loop), {args.rounds} rounds")
    print(f"{'set':<16} {'answers/s (median)':>19} {'vs plain (median of rounds)':>28}")
    for name, values in rates.items():
        ratios = [v / p for v, p in zip(values, plain, strict=True)]
        print(
            f"{name:<16} {statistics.median(values):>19,.0f} "
            f"{statistics.median(ratios):>18.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
