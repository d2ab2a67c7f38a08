"""GTM's DNS rate with DNSSEC online signing on and off, side by side in the same run.

    python bench/dns/dnssec.py [--rounds 3] [--seconds 5] [--json FILE]

Two GTM servers on the demo topology run at once, pinned to CPU 0: ``off`` (no key) and ``on``
(``GTM_DNSSEC_KEY_FILE``, a fresh P-256 key); dnsperf (closed loop, CPU 1) sends the same query
sets to each in turn, the order alternating each round, and every query has the DO bit set (so
``on`` signs every answer; ``off`` answers the same queries unsigned, as a server without DNSSEC
does). Sets, dnsperf ``-B`` wire files:

* ``plain``: chat.gtm.example A from the loopback resolver: one answer, served from the
  exact-query cache after the first (the fast path);
* ``ecs``: the same name with an ECS option from 5,000 distinct /24s GeoIP places: after the
  warm-up run every answer is in the caches too;
* ``names``: random names that do not exist, new ones for every run: every answer a
  rendered-cache miss and, signed, a black lie with its own NSEC and a new ECDSA signature
  (the worst case: what a random-name flood with DO set costs; it needs no new audit row, so
  nothing else bounds it).

Each run is warmed for 2 s first (caches, GeoIP pages). A flood of new client subnets is left
out: its rate is the audit writer's (``bench/dns/flood.py``), whatever the signing. What a
rendered-cache miss costs, the part of the answering path signing changes, is measured
in-process instead (no sockets, one core): microseconds per answer of
:func:`gtm.geodns.zone.answer` and of the signer around it, for a geo answer whose signature is
cached (a new client subnet) and for a black lie (a new name: a new signature).

Reported: answers/s per set and server in each round, the median of the per-round ratios
on/off, and the in-process costs.
"""

from __future__ import annotations

import argparse
import json
import random
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

from bench.dns.run import dnsperf, ecs_networks, field, gtm_server, running  # noqa: E402
from gtm.decision.geoip import default_database_path  # noqa: E402
from gtm.geodns.dnssec import make_signer  # noqa: E402
from gtm.geodns.dnssec_keys import generate  # noqa: E402
from gtm.geodns.wire import Query, parse_query  # noqa: E402
from gtm.geodns.zone import answer  # noqa: E402
from gtm.runtime import build_snapshot  # noqa: E402
from gtm.settings import Settings  # noqa: E402


def query(name: str, ecs: str | None = None) -> bytes:
    options = [dns.edns.ECSOption(ecs, 24)] if ecs else []
    wire = dns.message.make_query(
        name, "A", use_edns=0, want_dnssec=True, options=options
    ).to_wire()
    return struct.pack("!H", len(wire)) + wire


def write_sets(work: Path, geoip: Path) -> dict[str, Path]:
    sets: dict[str, list[bytes]] = {
        "plain": [query("chat.gtm.example.")],
        "ecs": [query("chat.gtm.example.", net) for net in ecs_networks(geoip, 5000)],
    }
    paths = {}
    for name, queries in sets.items():
        path = paths[name] = work / f"{name}.bin"
        path.write_bytes(b"".join(queries))
    paths["names"] = work / "names.bin"  # written afresh before every run (fresh_names)
    return paths


NAMES_PER_RUN = 150_000  # more than either server answers in a run: dnsperf never wraps
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789"


def fresh_names(path: Path, rng: random.Random, count: int = NAMES_PER_RUN) -> None:
    """``count`` random 16-letter names under the zone, none asked before (a run of dnsperf
    starts at the top of its file: a file used twice would be answered from the caches).
    Made by patching one template, as dnspython would take a minute."""
    template = query("a" * 16 + ".gtm.example.")  # length prefix, header, then the label
    head, tail = template[:15], template[31:]
    with path.open("wb") as f:
        for _ in range(count):
            f.write(head + bytes(rng.choice(_ALPHABET) for _ in range(16)) + tail)


def in_process(work: Path, geoip: Path, key: Path, n: int = 3000) -> dict[str, dict[str, float]]:
    """Microseconds per rendered-cache miss, unsigned and signed (see the module docstring)."""
    settings = Settings(
        config=ROOT / "examples/demo.yaml",
        policies=(ROOT / "policies",),
        geoip_path=geoip,
        dnssec_key_file=key,
    )
    snapshot = build_snapshot(settings, time.time())
    signer = make_signer(settings)
    assert signer is not None
    client = ip_address("127.0.0.1")
    rng = random.Random(5)
    nets = ecs_networks(geoip, n, seed=3)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    cases = {
        "geo answer, new subnet": [query("chat.gtm.example.", net)[2:] for net in nets],
        "black lie, new name": [
            query("".join(rng.choice(alphabet) for _ in range(16)) + ".gtm.example.")[2:]
            for _ in range(n)
        ],
    }
    out: dict[str, dict[str, float]] = {}
    for label, wires in cases.items():
        queries = [parse_query(w) for w in wires]
        assert all(isinstance(q, Query) for q in queries)
        for q in queries:  # warm: decisions memoised per location, as in a running node
            answer(q, client, snapshot, time.time(), 1232)  # type: ignore[arg-type]
        row = out[label] = {"off": float("inf"), "on": float("inf")}
        for attempt in range(3):  # alternating; the best of three each
            for how, fn in (("off", answer), ("on", signer.answer)):
                if attempt and how == "on" and label.startswith("black"):
                    signer = make_signer(settings)  # new names again: no signature cached
                    assert signer is not None
                    fn = signer.answer
                start = time.perf_counter()
                for q in queries:
                    fn(q, client, snapshot, time.time(), 1232)  # type: ignore[arg-type]
                row[how] = min(row[how], (time.perf_counter() - start) / len(queries) * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    geoip = default_database_path()
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="gtm-dnssec-") as tmp:
        work = Path(tmp)
        sets = write_sets(work, geoip)
        key = generate(work / "zone.key")
        off = gtm_server(work, geoip, "off")
        on = gtm_server(work, geoip, "on")
        assert on.env is not None
        on.env["GTM_DNSSEC_KEY_FILE"] = str(key.path)
        servers = {"off": off, "on": on}
        out = work / "dnsperf.out"
        rng = random.Random(29)
        with running(off), running(on):
            for round_no in range(args.rounds):
                order = list(servers) if round_no % 2 == 0 else list(reversed(servers))
                for set_name, data in sets.items():
                    row = results.setdefault(set_name, {"off": [], "on": []})
                    for label in order:
                        server = servers[label]
                        if set_name == "names":
                            fresh_names(data, rng)
                        dnsperf(server.port, data, True, 2, out)  # warm
                        if set_name == "names":
                            fresh_names(data, rng)
                        output = dnsperf(server.port, data, True, args.seconds, out)
                        row[label].append(field(output, "Queries per second"))
                    print(
                        json.dumps(
                            {
                                "round": round_no,
                                "set": set_name,
                                **{k: v[-1] for k, v in row.items()},
                            }
                        ),
                        flush=True,
                    )
        micro = in_process(work, geoip, key.path)
    report(results, micro, args)
    if args.json:
        args.json.write_text(json.dumps({"rates": results, "in_process_us": micro}, indent=2))


def report(
    results: dict[str, dict[str, list[float]]],
    micro: dict[str, dict[str, float]],
    args: argparse.Namespace,
) -> None:
    print(
        f"\nDO=1 queries, {args.rounds} rounds of {args.seconds:g} s, GTM on CPU 0, dnsperf on "
        "CPU 1; answers/s per round (off / on), median ratio on/off\n"
    )
    print("| set | DNSSEC off, answers/s | DNSSEC on, answers/s | on/off (median) |")
    print("|---|---:|---:|---:|")
    for set_name, row in results.items():
        ratios = [b / a for a, b in zip(row["off"], row["on"], strict=True) if a > 0]
        print(
            f"| {set_name} | {' / '.join(f'{x:.0f}' for x in row['off'])} "
            f"| {' / '.join(f'{x:.0f}' for x in row['on'])} "
            f"| {statistics.median(ratios):.2f} |"
        )
    print("\nIn process, one rendered-cache miss (no sockets): microseconds per answer\n")
    print("| miss | unsigned | signed | signed/unsigned |")
    print("|---|---:|---:|---:|")
    for label, row in micro.items():
        print(f"| {label} | {row['off']:.0f} | {row['on']:.0f} | {row['on'] / row['off']:.1f} |")


if __name__ == "__main__":
    main()
