"""GTM's DNS responder against gdnsd, PowerDNS (geoip backend) and a bare Python ceiling.

    python bench/dns/run.py [--rounds 3] [--seconds 5] [--latency-rounds 2] [--subnets 5000]
                            [--rrl] [--workers 2] [--only NAME ...] [--json FILE]

Every server runs on the demo topology's six regions with the bundled GeoLite2-City database,
pinned to CPU 0, one worker/thread; dnsperf, and this script itself, run pinned to CPU 1. Two
query sets, the same for every server: ``plain`` (chat.gtm.example A from the loopback resolver)
and ``ecs`` (the same name with an EDNS Client Subnet option from thousands of distinct real /24
networks, sent by dnsperf as pre-built wire messages).

All servers run at once (idle while another is measured) and the maximum rate (closed loop) is
measured in rounds, the servers' order rotating each round: on a shared, noisy machine only
figures taken side by side compare, so the ratios are per round, then the median. Each peak
run also reads the server's CPU time (user + system, all its threads and worker processes) to
give the CPU cost of an answer: dnsperf itself needs most of a core at these rates, so the
maximum is partly the client's, and the cost per answer is what tells the servers apart. After
the rounds, latency percentiles at 80% of each server's median maximum (open loop, every reply
timed; dnsperf writes its per-query lines to a file, not a pipe this script would have to read
meanwhile), in rounds too, also as a ratio to the bare ceiling's at its own 80%. dnsperf times
a reply when its receiving thread, which shares a core with its sending thread, gets to it: its
tail is partly the client's. So each paced run also carries ``probe.py``'s queries (2,000 a
second, inside the 80%), timed by the kernel's arrival stamp on each reply: the server's own
queueing and answering, which is what the p99 target is about. Finally GTM's
own count of the responses it sent (its metrics) is compared with the answers counted in its
audit store after a graceful stop: they must be equal (DESIGN.md rule 2).

GTM runs the full path: parse, decide (residency, health, capacity), render or reuse, and count
into the SQLite audit store. Response rate limiting is off in every server, as it is by default
in BIND and Knot (gdnsd and PowerDNS Authoritative have none; GTM's, on by default, spares
loopback, and is set to 0 here all the same):
``--rrl`` adds ``gtm-rrl``, GTM with the limiter on at a rate no single client network of the
bench reaches (all of dnsperf's queries come from one /24), to show what checking it costs.
``--workers N`` adds ``gtm-Nw``: ``gtm serve --workers N`` on CPUs 0 to N-1, sharing the port
(SO_REUSEPORT); on a two-core machine its second worker shares CPU 1 with dnsperf, so it shows
what a second process adds under that handicap, not the scaling on free cores. Its responses
sent are not compared with the audit (only the first worker serves metrics).

The bare ceiling answers one pre-rendered packet with the ID patched, with the same widened UDP
receive buffer as GTM (neither loses queries to a full buffer). gdnsd and PowerDNS are
configured from the same regions (gdnsd: nearest datacenter by coordinates, like GTM; PowerDNS
geoip: by continent, its nearest equivalent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import dns.edns
import dns.message
import dns.query
import maxminddb

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench.common.capacity_push import REPORT_SECRET, ReportPusher  # noqa: E402
from gtm.decision.geoip import default_database_path  # noqa: E402
from gtm.decision.topology import load_topology  # noqa: E402

SERVER_CPU, CLIENT_CPU = "0", "1"
TIMEOUT_S = 2.0


def free_port() -> int:
    while True:
        with socket.socket() as t:
            t.bind(("127.0.0.1", 0))
            port = int(t.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


def pinned(cpu: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *argv] if shutil.which("taskset") else argv


# -- query sets ---------------------------------------------------------------------------------


def ecs_networks(geoip: Path, count: int, seed: int = 11) -> list[str]:
    """Distinct /24s that the GeoIP database places somewhere."""
    rng = random.Random(seed)
    reader = maxminddb.open_database(str(geoip))
    found: dict[int, str] = {}
    while len(found) < count:
        value = rng.getrandbits(24) << 8
        if (value >> 24) in (0, 10, 127) or value >> 24 >= 224:
            continue
        record = reader.get(IPv4Address(value))
        if isinstance(record, dict) and record.get("location"):
            found[value] = str(IPv4Address(value))
    reader.close()
    return list(found.values())


def write_sets(directory: Path, geoip: Path, subnets: int) -> dict[str, tuple[Path, bool]]:
    plain = directory / "plain.txt"
    plain.write_text("chat.gtm.example A\n")
    binary = directory / "ecs.bin"
    with binary.open("wb") as f:
        for net in ecs_networks(geoip, subnets):
            wire = dns.message.make_query(
                "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.ECSOption(net, 24)]
            ).to_wire()
            f.write(struct.pack("!H", len(wire)) + wire)
    return {"plain": (plain, False), "ecs": (binary, True)}


def probe_file(data: Path, binary: bool) -> Path:
    """The query set as length-prefixed wire messages, as :mod:`probe` reads them: ``data``
    itself when it is already (dnsperf ``-B``), else its ``name type`` lines made into messages
    the way dnsperf sends them (no EDNS)."""
    if binary:
        return data
    wired = data.with_suffix(".probe.bin")
    with wired.open("wb") as f:
        for line in data.read_text().splitlines():
            name, rdtype = line.split()[:2]
            wire = dns.message.make_query(name, rdtype, use_edns=False).to_wire()
            f.write(struct.pack("!H", len(wire)) + wire)
    return wired


# -- servers ------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] | None = None
    note: str = ""
    metrics_port: int | None = None
    cpus: str = SERVER_CPU
    push_port: int | None = None  # GTM's HTTP front, where capacity reports are pushed
    cwd: Path = ROOT  # GTM's checkout: `python -m gtm` imports the gtm package found there
    pid: int = 0  # set while it runs


def gtm_server(
    work: Path,
    geoip: Path,
    name: str = "gtm",
    *,
    workers: int = 1,
    rate_limit: float = 0,
    root: Path = ROOT,
) -> Server:
    port, metrics, front = free_port(), free_port(), free_port()
    data = work / name
    env = os.environ | {
        "GTM_GEOIP_PATH": str(geoip),
        "GTM_DATABASE_URL": f"sqlite:///{data / 'bench.sqlite3'}",
        "GTM_SPOOL_DIR": str(data / "spool"),
        "GTM_LOG_LEVEL": "warning",
        "GTM_PROBES": "false",  # no balancers in this benchmark: regions stay as configured
        "GTM_CONFIG": str(root / "examples/demo.yaml"),
        "GTM_POLICIES": json.dumps([str(root / "policies")]),
        "GTM_DNS_RATE_LIMIT": str(rate_limit),
        "GTM_REPORT_SECRET": REPORT_SECRET.decode(),
    }
    data.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        *("-m", "gtm", "serve", "--dns", f"127.0.0.1:{port}"),
        *("--metrics", f"127.0.0.1:{metrics}"),
        # The HTTP front takes the pushed capacity reports (--reports-per-s).
        *("--http", f"127.0.0.1:{front}"),
    ]
    note = "full decisions + audit counting"
    if rate_limit:
        note += f", RRL on ({rate_limit:g}/s per /24)"
    if workers > 1:
        argv += ["--workers", str(workers)]
        note += f", {workers} workers on CPUs 0-{workers - 1} (CPU 1 shared with dnsperf)"
    return Server(
        name,
        argv,
        port,
        env,
        note,
        metrics,
        cpus=f"0-{workers - 1}" if workers > 1 else SERVER_CPU,
        push_port=front,
        cwd=root,
    )


def bare_server() -> Server:
    port = free_port()
    return Server(
        "bare-python",
        [sys.executable, str(Path(__file__).with_name("bare.py")), str(port)],
        port,
        note="fixed answer, ID patched (ceiling)",
    )


def gdnsd_server(work: Path, geoip: Path) -> Server | None:
    binary = shutil.which("gdnsd")
    if binary is None:
        return None
    port = free_port()
    topo = load_topology(ROOT / "examples/demo.yaml")
    base = work / "gdnsd"
    for sub in ("zones", "run", "state"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    dcs = ", ".join(r.id for r in topo.regions)
    coords = ", ".join(f"{r.id} => [{r.lat}, {r.lon}]" for r in topo.regions)
    dcmap = ", ".join(f"{r.id} => {r.ipv4[0]}" for r in topo.regions)
    (base / "config").write_text(f"""
options => {{ listen => [ 127.0.0.1:{port} ], run_dir => {base / "run"},
  state_dir => {base / "state"}, udp_threads => 1, tcp_threads => 1 }}
plugins => {{ geoip => {{
  maps => {{ demo => {{ geoip2_db => {geoip}, datacenters => [{dcs}],
                       auto_dc_coords => {{ {coords} }} }} }}
  resources => {{ chat => {{ map => demo, dcmap => {{ {dcmap} }} }} }}
}} }}
""")
    (base / "zones" / "gtm.example").write_text(
        "@ 60 SOA ns1 hostmaster 2026112201 3600 600 1209600 60\n@ 3600 NS ns1\n"
        "@ 3600 NS ns2\nns1 3600 A 192.0.2.53\nns2 3600 A 192.0.2.54\n"
        "chat 30 DYNA geoip!chat\n"
    )
    return Server(
        "gdnsd",
        [binary, "-c", str(base), "start"],
        port,
        note="geoip plugin, nearest by coordinates",
    )


def pdns_server(work: Path, geoip: Path) -> Server | None:
    binary = shutil.which("pdns_server")
    if binary is None:
        return None
    port = free_port()
    base = work / "pdns"
    base.mkdir(exist_ok=True)
    (base / "zones.yaml").write_text("""domains:
- domain: gtm.example
  ttl: 30
  records:
    gtm.example:
      - soa: ns1.gtm.example hostmaster.gtm.example 2026112201 3600 600 1209600 60
      - ns: ns1.gtm.example
    ns1.gtm.example: [{a: 192.0.2.53}]
    na.chat.gtm.example: [{a: 192.0.2.10}]
    sa.chat.gtm.example: [{a: 192.0.2.10}]
    eu.chat.gtm.example: [{a: 192.0.2.40}]
    af.chat.gtm.example: [{a: 192.0.2.40}]
    as.chat.gtm.example: [{a: 192.0.2.50}]
    oc.chat.gtm.example: [{a: 192.0.2.60}]
    default.chat.gtm.example: [{a: 192.0.2.10}]
  services:
    chat.gtm.example: ['%cn.chat.gtm.example', 'default.chat.gtm.example']
""")
    (base / "pdns.conf").write_text(f"""launch=geoip
geoip-database-files=mmdb:{geoip}
geoip-zones-file={base / "zones.yaml"}
edns-subnet-processing=yes
local-address=127.0.0.1
local-port={port}
socket-dir={base}
daemon=no
guardian=no
setuid=
setgid=
receiver-threads=1
distributor-threads=1
disable-syslog=yes
loglevel=3
""")
    return Server(
        "powerdns-geoip",
        [binary, f"--config-dir={base}"],
        port,
        note="geoip backend by continent, packet cache on (default)",
    )


@contextlib.contextmanager
def running(server: Server) -> Iterator[None]:
    proc = subprocess.Popen(
        pinned(server.cpus, server.argv),
        env=server.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=server.cwd,
    )
    try:
        deadline = time.monotonic() + 30
        query = dns.message.make_query("chat.gtm.example.", "A")
        while True:
            try:
                dns.query.udp(query, "127.0.0.1", port=server.port, timeout=0.5)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{server.name} did not start") from None
                time.sleep(0.2)
        server.pid = proc.pid  # taskset execs the server in its own process
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- measuring ----------------------------------------------------------------------------------


def dnsperf(
    port: int, data: Path, binary: bool, seconds: float, out: Path, rate: int | None = None
) -> str:
    argv = [
        "dnsperf",
        *("-s", "127.0.0.1", "-p", str(port), "-d", str(data), "-l", str(seconds)),
        *("-T", "1", "-c", "16", "-q", "200", "-t", str(TIMEOUT_S)),
    ]
    if binary:
        argv.append("-B")
    if rate is not None:
        argv += ["-Q", str(rate), "-v"]
    # To a file: with -v dnsperf prints a line per query, and a pipe would need this script to
    # read them while the run lasts.
    with out.open("w") as f:
        subprocess.run(pinned(CLIENT_CPU, argv), stdout=f, timeout=seconds + 30, check=False)
    return out.read_text()


PROBE_RATE = 2000  # probe queries a second, part of the paced rate


def paced_with_probe(
    port: int, data: Path, binary: bool, seconds: float, out: Path, rate: int
) -> tuple[str, dict[str, Any]]:
    """dnsperf paced at ``rate`` - PROBE_RATE queries a second with ``probe.py`` sending the
    rest from the same core meanwhile: dnsperf's per-query output and the probe's result."""
    argv = [
        "dnsperf",
        *("-s", "127.0.0.1", "-p", str(port), "-d", str(data), "-l", str(seconds)),
        *("-T", "1", "-c", "16", "-q", "200", "-t", str(TIMEOUT_S)),
        *("-Q", str(max(1, rate - PROBE_RATE)), "-v"),
    ]
    if binary:
        argv.append("-B")
    # Real-time priority on the client core: the probe sends when due even while dnsperf is
    # catching up after a stall (otherwise it would sample the worst moments least).
    realtime = ["chrt", "-f", "10"] if shutil.which("chrt") and os.geteuid() == 0 else []
    probe = [
        *realtime,
        sys.executable,
        str(Path(__file__).with_name("probe.py")),
        *(str(port), str(probe_file(data, binary))),
        *("--rate", str(PROBE_RATE), "--seconds", str(seconds - 1)),
    ]
    with out.open("w") as f:
        load = subprocess.Popen(pinned(CLIENT_CPU, argv), stdout=f)
        try:
            time.sleep(0.5)  # the probe runs inside dnsperf's run, not at its edges
            result = subprocess.run(
                pinned(CLIENT_CPU, probe), capture_output=True, text=True, timeout=seconds + 30
            )
            load.wait(timeout=seconds + 30)
        finally:
            if load.poll() is None:  # the probe failed: no stray load on the next run
                load.kill()
                load.wait()
    if result.returncode != 0:
        raise RuntimeError(f"probe failed: {result.stderr[-2000:]}")
    timed: dict[str, Any] = json.loads(result.stdout)
    if not timed.get("samples"):
        raise RuntimeError(f"the probe sent no queries: {result.stdout}")
    return out.read_text(), timed


def field(output: str, label: str) -> float:
    for line in output.splitlines():
        if label in line:
            return float(line.split(":", 1)[1].split()[0])
    raise RuntimeError(f"dnsperf printed no {label!r}:\n{output[-2000:]}")


def percentiles(output: str) -> tuple[float, float, float]:
    samples = []
    for line in output.splitlines():
        if line.startswith("> "):
            last = line.split()[-1]
            # "> T name type": timed out. Counted as the timeout, so losses show in the tail.
            samples.append(float(last) if last[0].isdigit() else TIMEOUT_S)
    samples.sort()
    if not samples:
        raise RuntimeError("no per-query latencies in dnsperf -v output")
    n = len(samples)
    return (
        samples[n // 2] * 1e3,
        samples[min(n - 1, int(n * 0.99))] * 1e3,
        statistics.fmean(samples) * 1e3,
    )


def responses_sent(metrics_port: int) -> int:
    """GTM's own count of the DNS responses it sent (every transport, type and rcode)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    sample = re.compile(r"^gtm_dns_responses_total\{.*\} (\S+)$", re.M)
    return sum(int(float(m.group(1))) for m in sample.finditer(text))


def settled_responses_sent(metrics_port: int, database: Path, limit_s: float = 90) -> int:
    """:func:`responses_sent` once the audit store has caught up with it. Answers given from
    the cache reach the metrics when the audit writer drains their tallies, and the store when
    that flush's rows are inserted; a flush of thousands of rows is paced over a second or more
    on a loaded core, so "unchanged for a while" is not enough: wait until the two agree and
    hold still, or until ``limit_s`` (the caller then reports the difference)."""
    last = (-1, -1)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = (responses_sent(metrics_port), audited(database))
        if now == last and now[0] == now[1]:
            break
        last = now
    return last[0]


def audited(database: Path) -> int:
    from gtm.audit import query
    from gtm.audit.database import make_async_engine

    async def total() -> int:
        engine = make_async_engine(f"sqlite:///{database}")
        try:
            return await query.total_count(engine)
        finally:
            await engine.dispose()

    return asyncio.run(total())


def audited_by_node(database: Path) -> dict[str, int]:
    """Answers counted per node (worker) in an audit store."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(database)) as conn:
        rows = conn.execute("SELECT node, SUM(count) FROM decisions GROUP BY node ORDER BY node")
        return {str(node): int(n) for node, n in rows}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, its threads and its descendants (workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (
                    int(fields[1]),
                    (int(fields[11]) + int(fields[12])) / tick,
                )
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += stats.get(current, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == current]
    return total


@dataclass
class Results:
    peaks: dict[str, dict[str, list[float]]]  # server -> set -> qps per round
    lost: dict[str, dict[str, list[float]]]
    cost: dict[str, dict[str, list[float]]]  # server -> set -> CPU microseconds per answer
    # server -> set -> (p50, p99, mean, rate) per latency round
    paced: dict[str, dict[str, list[tuple[float, float, float, float]]]]
    # server -> set -> the probe's kernel-timed (p50, p99, p99.9, lost) per latency round
    probed: dict[str, dict[str, list[tuple[float, float, float, int]]]]
    served: dict[str, int]  # gtm servers (one worker): responses sent, by their metrics
    counted: dict[str, int]  # ... and answers counted in their audit store
    by_worker: dict[str, dict[str, int]]  # gtm servers with workers: answers counted per worker


def run_all(
    servers: list[Server], sets: dict[str, tuple[Path, bool]], args: argparse.Namespace, work: Path
) -> Results:
    out = work / "dnsperf.out"
    peaks: dict[str, dict[str, list[float]]] = {s.name: {k: [] for k in sets} for s in servers}
    lost: dict[str, dict[str, list[float]]] = {s.name: {k: [] for k in sets} for s in servers}
    cost: dict[str, dict[str, list[float]]] = {s.name: {k: [] for k in sets} for s in servers}
    paced: dict[str, dict[str, list[tuple[float, float, float, float]]]] = {
        s.name: {k: [] for k in sets} for s in servers
    }
    probed: dict[str, dict[str, list[tuple[float, float, float, int]]]] = {
        s.name: {k: [] for k in sets} for s in servers
    }
    checked = [s for s in servers if s.metrics_port is not None and "--workers" not in s.argv]
    served: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(running(server))
        pushed = [s.push_port for s in servers if s.push_port is not None]
        if args.reports_per_s > 0 and pushed:
            pusher = ReportPusher(pushed, args.reports_per_s)
            pusher.start()
            stack.callback(pusher.stop)
        for server in servers:
            for data, binary in sets.values():
                dnsperf(server.port, data, binary, 2, out)  # warm: caches, GeoIP pages
        for rnd in range(args.rounds):
            shift = rnd % len(servers)
            for server in servers[shift:] + servers[:shift]:
                for name, (data, binary) in sets.items():
                    before = cpu_seconds(server.pid)
                    peak = dnsperf(server.port, data, binary, args.seconds, out)
                    used = cpu_seconds(server.pid) - before
                    peaks[server.name][name].append(field(peak, "Queries per second"))
                    lost[server.name][name].append(field(peak, "Queries lost"))
                    answered = field(peak, "Queries completed")
                    cost[server.name][name].append(used / max(answered, 1) * 1e6)
            print(
                f"round {rnd + 1}/{args.rounds}: "
                + ", ".join(f"{n} {k} {v[k][-1]:,.0f}/s" for n, v in peaks.items() for k in sets),
                file=sys.stderr,
                flush=True,
            )
        for rnd in range(args.latency_rounds):
            shift = rnd % len(servers)
            for server in servers[shift:] + servers[:shift]:
                for name, (data, binary) in sets.items():
                    rate = int(0.8 * statistics.median(peaks[server.name][name]))
                    result, probe = paced_with_probe(
                        server.port, data, binary, max(args.seconds, 4), out, rate
                    )
                    paced[server.name][name].append((*percentiles(result), rate))
                    timed = probe["kernel_ms"]
                    probed[server.name][name].append(
                        (timed["p50"], timed["p99"], timed["p99.9"], probe["lost"])
                    )
        for server in checked:
            assert server.metrics_port is not None
            served[server.name] = settled_responses_sent(
                server.metrics_port, work / server.name / "bench.sqlite3"
            )
    counted = {s.name: audited(work / s.name / "bench.sqlite3") for s in checked}
    by_worker = {
        s.name: audited_by_node(work / s.name / "bench.sqlite3")
        for s in servers
        if "--workers" in s.argv
    }
    return Results(peaks, lost, cost, paced, probed, served, counted, by_worker)


def report(results: Results, notes: dict[str, str], args: argparse.Namespace) -> None:
    peaks, cost = results.peaks, results.cost

    def ratio(a: str, b: str, set_name: str) -> str:
        if b not in peaks or a not in peaks:
            return "-"
        pairs = zip(peaks[a][set_name], peaks[b][set_name], strict=True)
        return f"{statistics.median(x / y for x, y in pairs):.2f}x"

    def cost_ratio(a: str, set_name: str) -> str:
        # The bare ceiling's CPU per answer over this server's, per round: the share of the
        # bare ceiling's rate this server would reach on a core of its own.
        if "bare-python" not in cost:
            return "-"
        pairs = zip(cost["bare-python"][set_name], cost[a][set_name], strict=True)
        return f"{statistics.median(b / x for b, x in pairs):.2f}x"

    def p99_ratio(table: Mapping[str, Mapping[str, Sequence[Any]]], a: str, set_name: str) -> str:
        # A p99 (dnsperf's or the probe's: the second figure of each round's entry) over the
        # bare ceiling's in the same latency round, then the median.
        if "bare-python" not in table:
            return "-"
        pairs = zip(table["bare-python"][set_name], table[a][set_name], strict=True)
        return f"{statistics.median(x[1] / b[1] for b, x in pairs):.2f}x"

    print(
        f"\nDNS, one server core (CPU {SERVER_CPU}), dnsperf on CPU {CLIENT_CPU}; "
        f"{args.subnets} ECS /24 subnets; capacity reports pushed to GTM at "
        f"{args.reports_per_s:g}/s; {args.rounds} rounds x {args.seconds:g} s, "
        "ratios per round then the median; latency paced at 80% of the median maximum "
        f"({args.latency_rounds} rounds, medians); "
        "CPU us/answer: the server's user+system time over the answers of its peak runs; "
        "p50/p99 ms@80%: dnsperf's timing; srv p99: the probe's, by the kernel's arrival stamps "
        f"({PROBE_RATE}/s of the 80%)"
    )
    print(
        f"{'server':<16} {'set':<6} {'qps':>9} {'min-max':>11} {'lost':>5} {'us/ans':>7} "
        f"{'p50 ms@80%':>11} {'p99 ms@80%':>11} {'srv p99':>8} {'srv p99.9':>9}  "
        f"{'vs bare':>8} {'cpu vs bare':>11} {'p99 vs bare':>11} {'srv vs bare':>11} "
        f"{'vs pdns':>8}  note"
    )
    for name, by_set in peaks.items():
        for set_name, rates in by_set.items():
            p50 = statistics.median(x[0] for x in results.paced[name][set_name])
            p99 = statistics.median(x[1] for x in results.paced[name][set_name])
            srv99 = statistics.median(x[1] for x in results.probed[name][set_name])
            srv999 = statistics.median(x[2] for x in results.probed[name][set_name])
            spread = f"{min(rates) / 1e3:.0f}k-{max(rates) / 1e3:.0f}k"
            print(
                f"{name:<16} {set_name:<6} {statistics.median(rates):>9,.0f} {spread:>11} "
                f"{max(results.lost[name][set_name]):>5.0f} "
                f"{statistics.median(cost[name][set_name]):>7.2f} {p50:>11.3f} {p99:>11.3f} "
                f"{srv99:>8.3f} {srv999:>9.3f}  "
                f"{ratio(name, 'bare-python', set_name):>8} {cost_ratio(name, set_name):>11} "
                f"{p99_ratio(results.paced, name, set_name):>11} "
                f"{p99_ratio(results.probed, name, set_name):>11} "
                f"{ratio(name, 'powerdns-geoip', set_name):>8}  {notes[name]}"
            )
    if "gtm-baseline" in peaks and "gtm" in peaks:
        for set_name in peaks["gtm"]:
            same_run = ratio("gtm", "gtm-baseline", set_name)
            print(f"gtm / gtm-baseline ({args.baseline}), {set_name}, per round: {same_run}")
    for name, probed_sets in results.probed.items():
        for set_name, rounds in probed_sets.items():
            if any(x[3] for x in rounds):
                print(
                    f"{name} {set_name}: the probe lost {sum(x[3] for x in rounds)} queries "
                    "(counted at its 1 s timeout in srv p99)"
                )
    for name, served in results.served.items():
        counted = results.counted[name]
        verdict = "equal" if served == counted else "DIFFERENT"
        print(
            f"{name} responses sent {served:,}, counted in its audit store {counted:,}: {verdict}"
        )
    for name, nodes in results.by_worker.items():
        split = ", ".join(f"{node} {n:,}" for node, n in nodes.items())
        print(f"{name} answers counted per worker: {split}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--subnets", type=int, default=5000)
    parser.add_argument("--latency-rounds", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="server names to run")
    parser.add_argument(
        "--rrl", action="store_true", help="add gtm-rrl: GTM with rate limiting on (never hit)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="add gtm-Nw: gtm serve --workers N (N > 1)"
    )
    parser.add_argument(
        "--reports-per-s",
        type=float,
        default=6,
        help="signed capacity reports pushed to each GTM a second, regions in turn (the demo's "
        "six balancers push about six); each is a new snapshot; 0 for none",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="add gtm-baseline: GTM from another checkout (e.g. a git worktree of an older "
        "commit), interleaved with this one",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("dnsperf") is None:
        sys.exit("dnsperf is not installed (Debian: apt-get install dnsperf)")
    # This script (and the readiness checks it makes) stays off the servers' core.
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {int(CLIENT_CPU)})
    geoip = default_database_path()
    with tempfile.TemporaryDirectory(prefix="gtm-dns-bench-") as tmp:
        work = Path(tmp)
        sets = write_sets(work, geoip, args.subnets)
        candidates = [
            gtm_server(work, geoip),
            bare_server(),
            gdnsd_server(work, geoip),
            pdns_server(work, geoip),
        ]
        missing = [
            n for n, s in zip(("gdnsd", "powerdns"), candidates[2:], strict=True) if s is None
        ]
        if missing:
            print(
                f"not installed, skipped: {', '.join(missing)} "
                "(Debian: gdnsd, pdns-server pdns-backend-geoip)"
            )
        if args.rrl:
            # dnsperf sends everything from 127.0.0.1: one /24, so a realistic limit would
            # drop nearly all of it. This one is never reached; the check still runs on
            # every datagram.
            candidates.append(gtm_server(work, geoip, "gtm-rrl", rate_limit=1e9))
        if args.baseline is not None:
            candidates.append(gtm_server(work, geoip, "gtm-baseline", root=args.baseline))
        if args.workers > 1:
            name = f"gtm-{args.workers}w"
            candidates.append(gtm_server(work, geoip, name, workers=args.workers))
        servers = [
            s for s in candidates if s is not None and (not args.only or s.name in args.only)
        ]
        results = run_all(servers, sets, args, work)
    report(results, {s.name: s.note for s in servers}, args)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "peaks": results.peaks,
                    "lost": results.lost,
                    "cpu_us_per_answer": results.cost,
                    "paced_p50_p99_mean_rate": results.paced,
                    "probed_p50_p99_p999_lost": results.probed,
                    "served": results.served,
                    "audited": results.counted,
                    "audited_by_worker": results.by_worker,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
