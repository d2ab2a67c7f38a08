"""What legitimate clients get while a cache-busting flood runs: fair admission on and off.

    python bench/dns/fairness.py [--seconds 6] [--floods ecs-200k names-200k ecs-2m]
                                 [--senders 1 256] [--share 0.2] [--budget-mb 64]
                                 [--legit-rate N] [--rounds 1] [--json FILE]
                                 [--modes fair fair-hashed fair-1socket off rig gdnsd powerdns]
                                 [--server-cpus 0] [--client-cpus 1] [--flood-cpus 1]

Legitimate clients: dnsperf from their own sender (127.0.2.1), chat.gtm.example A with ECS
from 5,000 known /24s (warmed first: every answer cached), paced at ``--share`` of the
capacity measured for that load at the start of the run (closed loop, fair admission on),
every reply timed (``-v``). The flood: this script's ``flood`` mode, an open loop sending as
fast as one Python process can (nice 10, so it does not take the core from dnsperf) from
``--senders`` sender networks (1: one resolver; 256: spoofed-looking senders, one /24 each,
127.1.x.1), looping over a ``bench/dns/flood.py`` query set (``ecs-200k``, ``ecs-2m``: random
/24s; ``names-200k``: random names; ``malformed-200k``: issue 32's repro, an IPv4 and an IPv6
ECS query then the IPv4 one with 4 octets appended, from new /24s, best with ``--flood-rate
10000``), and counting the answers it gets back.

For each flood set and each admission mode (``fair``: GTM_DNS_FAIR_ADMISSION=true, the
default, each sender network steered to its own socket and the established networks, the
legitimate sender among them, on sockets of their own; ``fair-hashed``: the same without
established networks, GTM_DNS_ESTABLISHED_NETWORKS=0, every network hashed over all the
sockets; ``fair-1socket``: every sender in one socket, GTM_DNS_UDP_SOCKETS=1; ``off``: every
datagram answered in the order read, in one socket), a fresh server
(pinned to CPU 0, both clients on CPU 1, unless ``--server-cpus``, ``--client-cpus`` and
``--flood-cpus`` say otherwise) serves, in one run: the legitimate load alone, then
the same load with the flood. Reported: legitimate answers / sent, their p99 with the flood as
a ratio of the p99 alone (targets, from the issue: >= 95% and <= 2x), the flood's sending
rate and goodput (answers/s it got), the server's peak RSS and heap growth against the DNS
budget. dnsperf times a reply when its receiving thread gets to it, on a core shared with the
flooder: its tail is partly the client's, in both modes alike.

Two kinds of rows tell what that rig costs by itself and what servers nobody here wrote get
on it. ``rig``: the same GTM server and loads, but the flood goes to a UDP socket that this
script binds and never reads, so the server does no flood work at all: the legitimate p99's
rise is then the flood's cost to the machine (the sender's core, the kernel's delivery),
which no server can avoid on it. ``gdnsd``, ``powerdns``: the same loads against the
reference servers of ``bench/dns/run.py`` (where installed), flooded like GTM.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench.dns.flood import AnonSampler, peak_rss_mb, write_set  # noqa: E402
from bench.dns.run import (  # noqa: E402
    CLIENT_CPU,
    SERVER_CPU,
    TIMEOUT_S,
    Server,
    field,
    gdnsd_server,
    gtm_server,
    pdns_server,
    percentiles,
    pinned,
    running,
)
from gtm.decision.geoip import default_database_path  # noqa: E402

LEGIT_FROM = "127.0.2.1"
# Admission modes compared: fair admission with sender networks steered to their own sockets
# and established ones to sockets of their own (the default), the same hashed only
# (GTM_DNS_ESTABLISHED_NETWORKS=0), in one socket (GTM_DNS_UDP_SOCKETS=1), and off.
MODES = ("fair", "fair-hashed", "fair-1socket", "off")
# Rows beside them (the module's docstring): the rig's own cost and the reference servers.
CONTROLS = ("rig", "gdnsd", "powerdns")
FLOODS = ("ecs-200k", "names-200k", "ecs-2m", "tcp-names-200k", "malformed-200k")
SIZES = {
    "ecs-200k": 200_000,
    "names-200k": 200_000,
    "ecs-2m": 2_000_000,
    "tcp-names-200k": 200_000,
    "malformed-200k": 200_000,
}


def legit_dnsperf(
    port: int, data: Path, seconds: float, out: Path, rate: int | None, cpus: str = CLIENT_CPU
) -> dict[str, float]:
    """dnsperf from the legitimate sender: closed loop (``rate`` None) or paced and timed."""
    argv = [
        "dnsperf",
        *("-s", "127.0.0.1", "-p", str(port), "-a", LEGIT_FROM, "-d", str(data), "-B"),
        *("-l", str(seconds), "-T", "1", "-c", "4", "-q", "200", "-t", str(TIMEOUT_S)),
    ]
    if rate is not None:
        # Room for every query of a timeout's worth outstanding: a lost query must not hold
        # the paced sending back (it is counted as lost, at the timeout, in the p99).
        argv += ["-Q", str(rate), "-v", "-q", str(int(rate * (TIMEOUT_S + 1)))]
    with out.open("w") as f:
        # stderr: a warning per answer that came after its query timed out; they are counted.
        subprocess.run(
            pinned(cpus, argv),
            stdout=f,
            stderr=subprocess.DEVNULL,
            timeout=seconds + 30,
            check=False,
        )
    text = out.read_text()
    figures = {
        "sent": field(text, "Queries sent"),
        "answered": field(text, "Queries completed"),
        "qps": field(text, "Queries per second"),
    }
    if rate is not None:
        figures["p50_ms"], figures["p99_ms"], _ = percentiles(text)
    return figures


def udp_drops(local_ip: str | None = None, port: int | None = None) -> int:
    """Datagrams the kernel dropped at full receive buffers, summed over the UDP sockets bound
    to ``local_ip`` (any port) or to ``port`` (/proc/net/udp's last column)."""
    total = 0
    for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
        parts = line.split()
        address, hex_port = parts[1].split(":")
        ip = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
        if (local_ip is not None and ip == local_ip) or (
            port is not None and int(hex_port, 16) == port
        ):
            total += int(parts[-1])
    return total


class DropSampler:
    """The largest drop count seen on the legitimate client's sockets while a run lasts (they
    are gone when dnsperf exits)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, udp_drops(local_ip=LEGIT_FROM))

    def __enter__(self) -> DropSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def admission_metrics(metrics_port: int | None) -> dict[str, float]:
    """The server's slow-path admission counters (gtm.geodns.admission) from its metrics."""
    if metrics_port is None:
        return {}
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("gtm_dns_slow_", "gtm_dns_send_dropped_total", "gtm_dns_established")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def read_set(path: Path) -> list[bytes]:
    blob = path.read_bytes()
    out, i = [], 0
    while i < len(blob):
        (n,) = struct.unpack_from("!H", blob, i)
        out.append(blob[i + 2 : i + 2 + n])
        i += 2 + n
    return out


def flood(port: int, data: Path, seconds: float, senders: int, rate: float) -> dict[str, float]:
    """Send ``data``'s queries in a loop, as fast as this process can (or at ``rate`` a second
    when positive), for ``seconds``; count the answers. Run in its own process (the ``flood``
    mode)."""
    queries = read_set(data)
    socks = []
    for i in range(senders):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind(("127.0.1.1" if senders == 1 else f"127.1.{i}.1", 0))
        socks.append(sock)
    target = ("127.0.0.1", port)
    sent = answered = refused = 0
    n, j = len(queries), 0
    start = time.monotonic()
    deadline = start + seconds
    while (now := time.monotonic()) < deadline:
        if rate > 0 and sent > (now - start) * rate:
            time.sleep(0.001)
            continue
        for k in range(len(socks)):
            sock = socks[k]
            for _ in range(16):
                try:
                    sock.sendto(queries[j], target)
                    sent += 1
                except BlockingIOError:
                    refused += 1
                j = j + 1 if j + 1 < n else 0
            while True:
                try:
                    sock.recv(4096)
                    answered += 1
                except BlockingIOError:
                    break
    time.sleep(TIMEOUT_S)  # answers still on their way
    for sock in socks:
        while True:
            try:
                sock.recv(4096)
                answered += 1
            except BlockingIOError:
                break
    return {"sent": sent, "answered": answered, "send_refused": refused, "seconds": seconds}


TCP_CONNECTIONS = 200  # the TCP flood's connections, all from one network (127.1.0.0/24)
TCP_PIPELINE = 8  # queries each keeps outstanding


def tcp_flood(port: int, data: Path, seconds: float) -> dict[str, float]:
    """The ``tcp-`` floods: :data:`TCP_CONNECTIONS` connections from one network, each with
    :data:`TCP_PIPELINE` queries of ``data`` outstanding (RFC 7766 pipelining), for
    ``seconds``; the answers counted. Run in its own process (the ``flood`` mode)."""
    import asyncio

    queries = read_set(data)
    counts = {"sent": 0, "answered": 0}

    async def one(i: int, deadline: float) -> None:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=(f"127.1.0.{i % 250 + 1}", 0)
        )
        j = i * 997
        outstanding = 0
        try:
            while time.monotonic() < deadline:
                while outstanding < TCP_PIPELINE:
                    wire = queries[j % len(queries)]
                    j += 1
                    writer.write(struct.pack("!H", len(wire)) + wire)
                    outstanding += 1
                    counts["sent"] += 1
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                await reader.readexactly(length)
                outstanding -= 1
                counts["answered"] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def run() -> None:
        deadline = time.monotonic() + seconds
        tasks = [asyncio.create_task(one(i, deadline)) for i in range(TCP_CONNECTIONS)]
        await asyncio.wait(tasks, timeout=seconds + TIMEOUT_S)
        for task in tasks:
            task.cancel()

    asyncio.run(run())
    return {**counts, "send_refused": 0, "seconds": seconds}


def start_flood(
    port: int,
    data: Path,
    seconds: float,
    senders: int,
    out: Path,
    rate: float = 0,
    cpus: str = CLIENT_CPU,
) -> Any:
    argv = [sys.executable, __file__, "flood", str(port), str(data), str(seconds), str(senders)]
    argv.append(str(rate))
    return subprocess.Popen(
        pinned(cpus, ["nice", "-n", "10", *argv]), stdout=out.open("w"), cwd=ROOT
    )


def server_for(
    work: Path, geoip: Path, name: str, mode: str, args: argparse.Namespace
) -> Server | None:
    """The server a row measures: GTM with the mode's settings, or a reference server (None
    where it is not installed)."""
    if mode in ("gdnsd", "powerdns"):
        make = gdnsd_server if mode == "gdnsd" else pdns_server
        (work / name).mkdir()
        return make(work / name, geoip)
    server = gtm_server(work, geoip, name)
    assert server.env is not None
    server.env["GTM_DNS_CACHE_BUDGET_MB"] = str(args.budget_mb)
    server.env["GTM_DNS_FAIR_ADMISSION"] = "false" if mode == "off" else "true"
    if mode == "fair-1socket":
        server.env["GTM_DNS_UDP_SOCKETS"] = "1"  # every sender network in one receive buffer
    if mode == "fair-hashed":
        server.env["GTM_DNS_ESTABLISHED_NETWORKS"] = "0"  # every network hashed, as before
    return server


def one_server(
    work: Path,
    geoip: Path,
    name: str,
    mode: str,
    legit: Path,
    flood_set: Path,
    senders: int,
    rate: int,
    args: argparse.Namespace,
) -> dict[str, Any] | None:
    server = server_for(work, geoip, name, mode, args)
    if server is None:
        return None
    server.cpus = args.server_cpus
    # The rig's row: the flood goes to a socket bound here and never read (the module's
    # docstring); the kernel drops what its buffer cannot hold, as it does for a server.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind(("127.0.0.1", 0))
        flood_port = sink.getsockname()[1] if mode == "rig" else server.port
        return measured(server, flood_port, legit, flood_set, senders, rate, name, work, args)


def measured(
    server: Server,
    flood_port: int,
    legit: Path,
    flood_set: Path,
    senders: int,
    rate: int,
    name: str,
    work: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One row: the legitimate load alone, then beside the flood sent to ``flood_port``."""
    row: dict[str, Any] = {}
    cpus = args.client_cpus  # dnsperf's
    with running(server):
        legit_dnsperf(server.port, legit, 3, work / f"{name}-warm.out", None, cpus)
        with AnonSampler(server.pid) as anon:
            row["alone"] = legit_dnsperf(
                server.port, legit, args.seconds, work / f"{name}-alone.out", rate, cpus
            )
            flood_out = work / f"{name}-flood.json"
            proc = start_flood(
                flood_port,
                flood_set,
                args.seconds + 2,
                senders,
                flood_out,
                args.flood_rate,
                args.flood_cpus,
            )
            time.sleep(1)  # the flood under way before the legitimate load starts
            server_drops = udp_drops(port=server.port)
            cpu_before, wall_before = cpu_seconds(server.pid), time.monotonic()
            with DropSampler() as client_drops:
                row["flood"] = legit_dnsperf(
                    server.port, legit, args.seconds, work / f"{name}-with.out", rate, cpus
                )
            # The server's share of a core meanwhile: below 1, it waited for the CPU (the
            # machine is shared), not for work.
            row["flood"]["server_cpu"] = (cpu_seconds(server.pid) - cpu_before) / (
                time.monotonic() - wall_before
            )
            # Where legitimate queries were lost: the server's buffer (everyone's, shared
            # with the flood) or the client's own.
            row["flood"]["server_buffer_drops"] = udp_drops(port=server.port) - server_drops
            row["flood"]["client_buffer_drops"] = client_drops.peak
            proc.wait(timeout=args.seconds + 60)
        row["flooder"] = json.loads(flood_out.read_text())
        row["admission"] = admission_metrics(server.metrics_port)
        row["rss_mb"] = peak_rss_mb(server.pid)
        row["heap_growth_mb"] = anon.peak - anon.start
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "flood":
        port, data, seconds, senders, rate = sys.argv[2:7]
        if Path(data).name.startswith("tcp-"):
            print(json.dumps(tcp_flood(int(port), Path(data), float(seconds))))
            return
        print(json.dumps(flood(int(port), Path(data), float(seconds), int(senders), float(rate))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--floods", nargs="*", default=list(FLOODS[:2]), choices=list(FLOODS))
    parser.add_argument("--senders", nargs="*", type=int, default=[1, 256])
    parser.add_argument("--share", type=float, default=0.2, help="of the legit capacity")
    parser.add_argument("--legit-rate", type=int, help="queries/s (default: --share of capacity)")
    parser.add_argument("--budget-mb", type=float, default=64)
    parser.add_argument(
        "--flood-rate", type=float, default=0, help="flood queries/s (default 0: full speed)"
    )
    parser.add_argument(
        "--modes",
        nargs="*",
        default=list(MODES),
        choices=list(MODES + CONTROLS),
        help="admission: fair (a socket per sender network's hash), fair-1socket, off; "
        "controls: rig (the flood to an unread socket), gdnsd, powerdns",
    )
    parser.add_argument("--rounds", type=int, default=1, help="each row this many times")
    # On a machine with cores to spare, the flood's sender off the legitimate client's core
    # takes the rig's own cost (the `rig` row) out of the legitimate p99.
    parser.add_argument("--server-cpus", default=SERVER_CPU, help="taskset list (default 0)")
    parser.add_argument("--client-cpus", default=CLIENT_CPU, help="dnsperf's (default 1)")
    parser.add_argument("--flood-cpus", default=CLIENT_CPU, help="the flooder's (default 1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    geoip = default_database_path()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gtm-fairness-") as tmp:
        work = Path(tmp)
        legit = write_set(work / "legit.bin", "ecs-5k", 5_000, seed=29)
        rate = args.legit_rate
        capacity = 0.0
        if rate is None:
            server = gtm_server(work, geoip, "capacity")
            server.cpus = args.server_cpus
            with running(server):
                cpus = args.client_cpus
                legit_dnsperf(server.port, legit, 3, work / "cap-warm.out", None, cpus)
                capacity = legit_dnsperf(server.port, legit, 5, work / "cap.out", None, cpus)["qps"]
            rate = max(100, int(capacity * args.share))
        print(f"legitimate load paced at {rate}/s", flush=True)
        sets = {
            name: write_set(work / f"{name}.bin", name.removeprefix("tcp-"), SIZES[name])
            for name in args.floods
        }
        # Rounds interleave the rows (every mode, then every mode again): what the shared
        # machine does meanwhile falls on each of them alike.
        for n in range(args.rounds):
            for flood_name, flood_set in sets.items():
                for senders in args.senders:
                    for mode in args.modes:
                        name = f"{flood_name}-{senders}-{mode}-{n}"
                        row = one_server(
                            work, geoip, name, mode, legit, flood_set, senders, rate, args
                        )
                        if row is None:
                            print(f"{mode}: not installed, skipped", flush=True)
                            continue
                        row |= {"flood_set": flood_name, "senders": senders, "mode": mode}
                        results.append(row | {"round": n + 1})
                        print(json.dumps(row), flush=True)
    report(results, rate, capacity, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report(
    results: list[dict[str, Any]], rate: int, capacity: float, args: argparse.Namespace
) -> None:
    print(
        f"\n{args.seconds:g} s per run; legitimate load {rate}/s "
        + (f"({args.share:.0%} of {capacity:.0f}/s measured)" if capacity else "(as given)")
        + f" from {LEGIT_FROM}, 5,000 known /24s; "
        f"server on CPUs {args.server_cpus}, dnsperf on {args.client_cpus}, the flooder on "
        f"{args.flood_cpus}; DNS budget {args.budget_mb:g} MiB; flood "
        f"{f'{args.flood_rate:g}/s' if args.flood_rate else 'at full speed'}\n"
    )
    print(
        "| flood | senders | admission | legit answered/sent alone | legit answered/sent "
        "flooded | p99 alone ms | p99 flooded ms | p99 ratio | flood sent/s | flood goodput/s "
        "| lost in server buffer | server CPU share | established | peak RSS MiB "
        "| heap growth MiB |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in results:
        alone, flooded, f = r["alone"], r["flood"], r["flooder"]
        print(
            f"| {r['flood_set']} | {r['senders']} | {r['mode']} "
            f"| {alone['answered'] / alone['sent']:.1%} "
            f"| {flooded['answered'] / flooded['sent']:.1%} "
            f"| {alone['p99_ms']:.2f} | {flooded['p99_ms']:.2f} "
            f"| {flooded['p99_ms'] / max(alone['p99_ms'], 0.001):.2f} "
            f"| {f['sent'] / f['seconds']:.0f} | {f['answered'] / f['seconds']:.0f} "
            f"| {flooded['server_buffer_drops']:.0f} | {flooded['server_cpu']:.2f} "
            f"| {r['admission'].get('gtm_dns_established_networks', 0):.0f} "
            f"| {r['rss_mb']:.0f} | {r['heap_growth_mb']:.0f} |"
        )
    if args.rounds > 1:
        summary(results)
    print(
        "\ntargets: legitimate answered >= 95% of sent; p99 flooded <= 2x p99 alone"
        "\nrig: the flood sent to a socket nobody reads (no server work); gdnsd, powerdns: "
        "reference servers under the same loads"
    )


def summary(results: list[dict[str, Any]]) -> None:
    """Each row's rounds in one line: the median p99 ratio and its range, the least share of
    legitimate queries answered under the flood."""
    rows: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in results:
        rows.setdefault((r["flood_set"], r["senders"], r["mode"]), []).append(r)
    print(
        "\n| flood | senders | admission | rounds | legit answered flooded, least "
        "| p99 ratio, median | p99 ratio, range | rounds within 2x |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|"
    )
    for (flood_set, senders, mode), runs in rows.items():
        ratios = sorted(r["flood"]["p99_ms"] / max(r["alone"]["p99_ms"], 0.001) for r in runs)
        least = min(r["flood"]["answered"] / r["flood"]["sent"] for r in runs)
        within = sum(ratio <= 2 for ratio in ratios)
        print(
            f"| {flood_set} | {senders} | {mode} | {len(runs)} | {least:.1%} "
            f"| {statistics.median(ratios):.2f} | {ratios[0]:.2f}-{ratios[-1]:.2f} "
            f"| {within} of {len(runs)} |"
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
