"""Cache-busting floods against GTM's DNS responder: goodput, peak memory and audit rows.

    python bench/dns/flood.py [--seconds 8]
                              [--sets ecs-5k ecs-200k ecs-2m ecs20-200k ecs32-200k
                                      names-200k names-ecs-200k]
                              [--budget-mb 64] [--no-before] [--before REV] [--json FILE]

Query sets (dnsperf ``-B`` wire files, looped over for the run's length):

* ``ecs-5k``, ``ecs-200k``, ``ecs-2m``: chat.gtm.example A with an ECS option from 5,000,
  200,000 or 2,000,000 distinct random /24s (the shape of a random-subnet attack, and of a
  large resolver population);
* ``ecs20-200k``: the same from random /20s, a source length that is not a whole octet;
* ``ecs32-200k``: the same from random /32s, a source longer than the audit's precision, which
  the ECS path does not take: every query through the slow path and its memos (parse, client
  networks, GeoIP locations, plans);
* ``names-200k``: 200,000 distinct random names under the zone (NXDOMAIN), no ECS;
* ``names-ecs-200k``: the same with a random client subnet each (ECS /24).

Every set is sent by dnsperf (closed loop, CPU 1) to, in turn: the bare Python ceiling (one
pre-rendered answer, ``bare.py``), GTM as it is in this checkout, and, unless ``--no-before``,
GTM as committed at ``--before`` (default HEAD: the code before the working tree's changes;
``git archive``), each pinned to CPU 0. GTM is started afresh for each set, so its peak RSS
(VmHWM) is that set's; the ceiling runs once per set too, just before, so each row's figures
are taken side by side.
Response rate limiting is off (every query comes from one loopback address), the audit store is
SQLite. Reported per set and server: goodput (answers/s) from a fresh start and sustained (GTM:
a second run of the same length right after the first, on the same server: the flood going on,
its subnets seen before), their shares of the ceiling's, lost queries, peak RSS, the heap
(RssAnon) when the flood starts and how far it grows under it over both runs (the memory the
DNS budget bounds; RSS also counts the pages of the memory-mapped GeoIP file the
flood touches), and audit rows written per second of flood (rows, not answers: rule 2 still
counts every answer, on fewer rows when they are aggregated).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import dns.edns
import dns.message

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench.dns.run import bare_server, dnsperf, field, gtm_server, running  # noqa: E402
from gtm.decision.geoip import default_database_path  # noqa: E402

SETS = {
    "ecs-5k": 5_000,
    "ecs-200k": 200_000,
    "ecs-2m": 2_000_000,
    "ecs20-200k": 200_000,
    "ecs32-200k": 200_000,
    "names-200k": 200_000,
    "names-ecs-200k": 200_000,
}


def random_slash24s(count: int, rng: random.Random) -> list[int]:
    """Distinct random /24s (network numbers), outside 0/8, 10/8, 127/8 and multicast up."""
    seen: set[int] = set()
    out: list[int] = []
    while len(out) < count:
        value = rng.getrandbits(24)
        first = value >> 16
        if first in (0, 10, 127) or first >= 224 or value in seen:
            continue
        seen.add(value)
        out.append(value)
    return out


def write_set(path: Path, name: str, count: int, seed: int = 17) -> Path:
    """A dnsperf -B file: each message length-prefixed. Built by patching one template, as
    dnspython would take minutes for two million messages."""
    rng = random.Random(seed)
    with path.open("wb") as f:
        if name.startswith("malformed"):
            # Issue 32's repro, over and over from new subnets: an IPv4 /24 ECS query, an IPv6
            # /56 one (teaching the sender both shapes), then the IPv4 one with 4 octets
            # appended (7 octets after the IPv4 shape's key: once a crash, now FORMERR).
            v4 = dns.message.make_query(
                "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.ECSOption("192.0.2.0", 24)]
            ).to_wire()
            v6 = dns.message.make_query(
                "chat.gtm.example.", "A", use_edns=0,
                options=[dns.edns.ECSOption("2001:db8::", 56)],
            ).to_wire()  # fmt: skip
            for net in random_slash24s(count // 3, rng):
                wire = v4[:-3] + net.to_bytes(3, "big")
                for message in (wire, v6, wire + b"\x00\x00\x00\x01"):
                    f.write(struct.pack("!H", len(message)) + message)
        elif name.startswith("ecs"):
            source = {"ecs20-": 20, "ecs32-": 32}.get(name[:6], 24)
            template = dns.message.make_query(
                "chat.gtm.example.",
                "A",
                use_edns=0,
                options=[dns.edns.ECSOption("192.0.2.1" if source == 32 else "192.0.2.0", source)],
            ).to_wire()
            size = (source + 7) // 8
            head = struct.pack("!H", len(template)) + template[:-size]
            # Distinct /24s; for /20s, each /24's first 20 bits (a few collide: fine for a
            # flood); for /32s, an address in each.
            for net in random_slash24s(count, rng):
                if source == 20:
                    net &= ~0xF
                elif source == 32:
                    net = (net << 8) | rng.randrange(1, 255)
                f.write(head + net.to_bytes(size, "big"))
        else:
            alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789"
            # names-ecs: each random name with a random client subnet too (through resolvers
            # that send ECS for every name).
            subnets = random_slash24s(count, rng) if name.startswith("names-ecs") else None
            for i in range(count):
                label = bytes(rng.choice(alphabet) for _ in range(16))
                options = []
                if subnets is not None:
                    options = [dns.edns.ECSOption(str(IPv4Address(subnets[i] << 8)), 24)]
                wire = dns.message.make_query(
                    label.decode() + ".gtm.example.", "A", use_edns=0, options=options
                ).to_wire()
                f.write(struct.pack("!H", len(wire)) + wire)
    return path


def status_mb(pid: int, field_name: str) -> float:
    """A /proc status figure (VmHWM, RssAnon, ...) of the server process and its children
    (worker processes), summed, in MiB."""
    total = 0.0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                total += int(line.split()[1]) / 1024
    return total


def peak_rss_mb(pid: int) -> float:
    return status_mb(pid, "VmHWM")


class AnonSampler:
    """Samples the server's anonymous memory (RssAnon: the heap, not the memory-mapped GeoIP
    file, whose pages the kernel can drop) every 0.2 s while a run lasts; its peak less the
    figure at the start is what the flood cost in memory the DNS budget is meant to bound."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = status_mb(pid, "RssAnon")
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            with contextlib.suppress(OSError, ValueError):
                self.peak = max(self.peak, status_mb(self.pid, "RssAnon"))

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def audit_rows(database: Path) -> int:
    with sqlite3.connect(database) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM decisions").fetchone()[0])


def before_checkout(work: Path, rev: str = "HEAD") -> Path:
    """The tree at ``rev``, unpacked (git archive reads the repository; it changes nothing)."""
    target = work / "before"
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def measure(server: Any, data: Path, seconds: float, out: Path, *, again: bool) -> dict[str, float]:
    """One run from a fresh start; with ``again``, a second run of the same length right after
    it (the flood going on: its subnets seen before, the caches as the first run left them)."""
    with running(server):
        with AnonSampler(server.pid) as anon:
            output = dnsperf(server.port, data, True, seconds, out)
            first_peak = anon.peak
            sustained = dnsperf(server.port, data, True, seconds, out) if again else output
        rss = peak_rss_mb(server.pid)
    return {
        "goodput": field(output, "Queries per second"),
        "sustained": field(sustained, "Queries per second"),
        "lost": field(output, "Queries lost") + (field(sustained, "Queries lost") if again else 0),
        "rss_mb": rss,
        "anon_start_mb": anon.start,
        "anon_growth_mb": anon.peak - anon.start,
        "anon_first_mb": first_peak - anon.start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--sets", nargs="*", default=list(SETS), choices=list(SETS))
    parser.add_argument("--budget-mb", type=float, default=64)
    parser.add_argument("--no-before", action="store_true", help="skip GTM as at --before")
    parser.add_argument("--before", default="HEAD", help="the commit to compare with")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    geoip = default_database_path()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="gtm-flood-") as tmp:
        work = Path(tmp)
        before = None if args.no_before else before_checkout(work, args.before)
        for set_name in args.sets:
            data = write_set(work / f"{set_name}.bin", set_name, SETS[set_name])
            row: dict[str, dict[str, float]] = {}
            row["bare"] = measure(bare_server(), data, args.seconds, work / "bare.out", again=False)
            candidates = [("gtm", ROOT)] + ([("gtm-before", before)] if before else [])
            for label, root in candidates:
                name = f"{label}-{set_name}"
                server = gtm_server(work, geoip, name, root=root)
                assert server.env is not None
                server.env["GTM_DNS_CACHE_BUDGET_MB"] = str(args.budget_mb)
                figures = measure(server, data, args.seconds, work / f"{name}.out", again=True)
                rows = audit_rows(work / name / "bench.sqlite3")
                figures["audit_rows_per_s"] = rows / (2 * args.seconds)
                row[label] = figures
            results[set_name] = row
            print(json.dumps({set_name: row}), flush=True)
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.seconds:g} s per run, dnsperf on CPU 1, servers on CPU 0; "
        f"GTM budget {args.budget_mb:g} MiB\n"
    )
    print(
        "| set | server | answers/s from a start | of ceiling | sustained answers/s | of ceiling "
        "| lost | peak RSS MiB | heap at start MiB | heap growth MiB | audit rows/s |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for set_name, row in results.items():
        ceiling = row["bare"]["goodput"]
        for label, f in row.items():
            rows = f"{f['audit_rows_per_s']:.0f}" if "audit_rows_per_s" in f else "-"
            print(
                f"| {set_name} | {label} | {f['goodput']:.0f} | {f['goodput'] / ceiling:.2f} "
                f"| {f['sustained']:.0f} | {f['sustained'] / ceiling:.2f} "
                f"| {f['lost']:.0f} | {f['rss_mb']:.0f} | {f['anon_start_mb']:.0f} "
                f"| {f['anon_growth_mb']:.0f} | {rows} |"
            )
    print(
        "\nsustained: a second run of the same length right after the first, on the same server"
        " (the flood going on). 200k subnets against 5k, from a start / sustained: "
        + _ratios(results, "ecs-200k", "ecs-5k")
    )


def _ratios(results: dict[str, dict[str, dict[str, float]]], flood: str, base: str) -> str:
    if flood not in results or base not in results:
        return "(both sets needed)"
    f, b = results[flood]["gtm"], results[base]["gtm"]
    return f"{f['goodput'] / b['goodput']:.2f} / {f['sustained'] / b['sustained']:.2f}"


if __name__ == "__main__":
    main()
