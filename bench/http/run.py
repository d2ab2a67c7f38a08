"""HTTP front benchmark: GTM's redirect against nginx + geoip2 and a bare ASGI ceiling.

    python bench/http/run.py [--rounds 5] [--paced-rounds 3] [--seconds 5] [--connections 32]
                             [--workers 2] [--diagnose] [--reports-per-s 6] [--baseline DIR]

In one run, with the variants interleaved over rounds (the machine is shared and noisy, so only
ratios measured side by side mean anything):

- ``gtm``: the front (``gtm serve --http``, one worker) on the demo topology with the bundled
  GeoLite2-City database: a full decision per request, residency signals, audit counting;
- ``nginx``: nginx with ``libnginx-mod-http-geoip2`` returning the equivalent country-based 307
  (the script writes its configuration);
- ``bare``: the ceiling of Python on ASGI, a bare ASGI app on uvicorn (uvloop, httptools)
  returning a fixed 307 with the same headers.

The front answers its cached redirects in the HTTP protocol itself, without an ASGI request
cycle, so it can be faster than ``bare``; ``--diagnose`` adds ``bare-protocol``, a fixed 307
answered the same way (``bare_protocol.py``), the ceiling of that path, and ``gtm-uncounted``
(``front_uncounted.py``), the front without the audit writer, to split the costs.

Each server is pinned to one core and ``wrk`` to another (``taskset``, when there are two).
Requests carry an ``X-Forwarded-For`` from a fixed set of public addresses, believed by GTM and
by nginx (``realip``) because the benchmark's peer is a trusted proxy, so every request is
located like a real client's. After the rounds, each variant is run paced at 80 % of its median
maximum (``wrk`` with a per-connection delay, the number of connections calibrated by short runs
until the rate is within 3% of the target), again in interleaved rounds, for the p99 latency
target. With ``--workers N`` GTM also runs with N processes on the port and, to compare, with
one, both unpinned beside ``wrk`` (on a machine with few cores the load generator takes its
share of them). ``--reports-per-s R`` pushes signed capacity reports to GTM throughout, as the
regional balancers do (each a new snapshot, so cached answers are decided again): the demo's six
balancers push about six a second.

Finally GTM is stopped gracefully and its audit store read back (DESIGN.md rule 2): the
responses counted there must equal the responses it served (its own metric), and the responses
``wrk`` received, up to the requests still in flight when each ``wrk`` run stopped (at most one
per connection: answered and counted by GTM, never read by ``wrk``).
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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench.common.capacity_push import REPORT_SECRET, ReportPusher  # noqa: E402

HOST = "chat.gtm.example"
PATH = "/v1/chat/completions"

# Country -> demo region, the same answer GTM's nearest-region ranking gives for most clients of
# each country (nginx has no distances; a country map is how it is done there).
COUNTRY_REGION = {
    **dict.fromkeys(["US", "CA", "MX", "BR", "AR", "CO", "CL", "PE"], "us-east"),
    **dict.fromkeys(["GB", "IE", "FR", "ES", "PT", "NL", "BE", "IS"], "eu-west"),
    **dict.fromkeys(["DE", "AT", "CH", "IT", "PL", "CZ", "SE", "DK", "NO", "FI"], "eu-central"),
    **dict.fromkeys(["IN", "PK", "BD", "LK", "AE", "SA"], "ap-south"),
    **dict.fromkeys(["JP", "KR", "CN", "TW", "HK", "AU", "SG"], "ap-northeast"),
}
REGION_URL = {
    "us-east": "http://127.0.0.1:8101",
    "us-west": "http://127.0.0.1:8102",
    "eu-west": "http://127.0.0.1:8103",
    "eu-central": "http://127.0.0.1:8104",
    "ap-south": "http://127.0.0.1:8105",
    "ap-northeast": "http://127.0.0.1:8106",
}


def missing_tools() -> list[str]:
    problems = []
    for tool, package in (("wrk", "wrk"), ("nginx", "nginx"), ("taskset", "util-linux")):
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found (Debian package {package})")
    if shutil.which("nginx") is not None and not _geoip2_module().exists():
        problems.append(f"{_geoip2_module()} not found (Debian package libnginx-mod-http-geoip2)")
    return problems


def _geoip2_module() -> Path:
    """Where this nginx keeps its dynamic modules (``nginx -V``), and the geoip2 one in it."""
    modules = Path("/usr/lib/nginx/modules")  # Debian's, when nginx -V does not say
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        built = subprocess.run(["nginx", "-V"], capture_output=True, text=True, timeout=10)
        found = re.search(r"--modules-path=(\S+)", built.stderr + built.stdout)
        if found:
            modules = Path(found.group(1))
    return modules / "ngx_http_geoip2_module.so"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def pin(cores: str | None) -> list[str]:
    return ["taskset", "-c", cores] if cores and shutil.which("taskset") else []


def client_addresses(n: int = 4096, seed: int = 7) -> list[str]:
    """Public unicast IPv4 addresses (reproducible), as wrk's requests' X-Forwarded-For."""
    rng = random.Random(seed)
    private = {0, 10, 100, 127, 169, 172, 192, 198, 203}
    out: dict[tuple[int, int, int], str] = {}  # one address per /24: the audit's client network
    while len(out) < n:
        a, b, c = rng.randint(1, 223), rng.randint(0, 255), rng.randint(0, 255)
        if a not in private:
            out.setdefault((a, b, c), f"{a}.{b}.{c}.{rng.randint(1, 254)}")
    return list(out.values())


def write_wrk_script(
    path: Path, addresses: list[str], delay_ms: int | None, close: bool = False
) -> None:
    """``close``: every request says ``Connection: close``, so each is a new connection."""
    extra = ', ["Connection"] = "close"' if close else ""
    # Requests are formatted once, in init(): formatting one per request in Lua makes wrk the
    # bottleneck long before the servers are.
    lines = [
        "local addrs = {" + ",".join(f'"{a}"' for a in addresses) + "}",
        "local reqs = {}",
        "local i = 0",
        "init = function(args)",
        "  for k, a in ipairs(addrs) do",
        f'    reqs[k] = wrk.format("GET", "{PATH}", {{["Host"] = "{HOST}",'
        f' ["X-Forwarded-For"] = a{extra}}})',
        "  end",
        "end",
        "request = function()",
        "  i = i % #reqs + 1",
        "  return reqs[i]",
        "end",
    ]
    if delay_ms is not None:
        lines += ["delay = function()", f"  return {delay_ms}", "end"]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class WrkResult:
    rate: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if m is None:
        raise ValueError(text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(
    port: int,
    seconds: float,
    connections: int,
    script: Path,
    core: str | None,
    scheme: str = "http",
) -> WrkResult:
    cmd = [
        *pin(core),
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{round(seconds)}s",
        "--latency",
        "-s",
        str(script),
        f"{scheme}://127.0.0.1:{port}{PATH}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errors = 0
    for m in re.finditer(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out):
        if m.group(1):
            errors += int(m.group(1))
        else:
            errors += sum(int(x) for x in re.findall(r"\d+", m.group(2)))
    return WrkResult(rate, p50, p99, total, errors)


def nginx_config(prefix: Path, port: int, mmdb: Path) -> Path:
    country_map = "\n".join(f"        {c} {REGION_URL[r]};" for c, r in COUNTRY_REGION.items())
    region_map = "\n".join(f"        {c} {r};" for c, r in COUNTRY_REGION.items())
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""load_module {_geoip2_module()};
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
{"user root;" if os.geteuid() == 0 else ""}
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    # The benchmark's peer is a trusted proxy: locate the address it forwards, as GTM does.
    set_real_ip_from 127.0.0.0/8;
    real_ip_header X-Forwarded-For;
    geoip2 {mmdb} {{
        $geoip2_country country iso_code;
    }}
    map $geoip2_country $region_url {{
        default {REGION_URL["us-east"]};
{country_map}
    }}
    map $geoip2_country $region {{
        default us-east;
{region_map}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            add_header Cache-Control no-store always;
            add_header X-GTM-Region $region always;
            add_header X-GTM-Decision-Id $request_id always;
            return 307 $region_url$request_uri;
        }}
    }}
}}
"""
    )
    return conf


@dataclass
class Variant:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None  # None: another variant's server, asked differently
    clients: int  # distinct client addresses (and /24 networks) in the requests
    results: list[WrkResult] = field(default_factory=list)
    pinned: bool = True  # server on one core and wrk on another; False: both float


def start_gtm(
    tmp: Path,
    port: int,
    core: str | None,
    workers: int = 1,
    tag: str = "gtm",
    uncounted: bool = False,
    root: Path = ROOT,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """GTM's front from the checkout at ``root`` (``python -m gtm`` run there imports its own
    ``gtm`` package first): this one, or a baseline checkout to compare with. ``env``: settings
    over the defaults here."""
    settings = {
        **os.environ,
        "GTM_CONFIG": str(root / "examples" / "demo.yaml"),
        "GTM_POLICIES": json.dumps([str(root / "policies")]),
        "GTM_DATABASE_URL": f"sqlite:///{tmp / (tag + '.sqlite3')}",
        "GTM_SPOOL_DIR": str(tmp / (tag + "-spool")),
        "GTM_NODE_ID": f"bench-{tag}",
        "GTM_TRUSTED_PROXIES": json.dumps(["127.0.0.0/8"]),
        "GTM_LOG_LEVEL": "warning",
        # The demo's regions are not running during the benchmark; unknown health counts as up.
        "GTM_PROBES": "false",
        "GTM_REPORT_SECRET": REPORT_SECRET.decode(),  # for --reports-per-s
        **(env or {}),
    }
    settings.pop("GTM_GEOIP_PATH", None)  # the bundled GeoLite2-City, the file nginx reads too
    cmd = [sys.executable, "-m", "gtm", "serve", "--http", f"127.0.0.1:{port}"]
    if uncounted:
        cmd = [sys.executable, str(HERE / "front_uncounted.py"), f"127.0.0.1:{port}"]
    if workers > 1:
        cmd += ["--workers", str(workers)]
    return subprocess.Popen([*pin(core), *cmd], cwd=root, env=settings)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape_responses(port: int) -> int:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
    return sum(
        int(float(m.group(1)))
        for m in re.finditer(r'^gtm_front_responses_total\{status="\d+"\} (\S+)$', text, re.M)
    )


def audited(tmp: Path, tag: str) -> int:
    from gtm.audit import query
    from gtm.audit.database import make_async_engine

    async def total() -> int:
        engine = make_async_engine(f"sqlite:///{tmp / (tag + '.sqlite3')}")
        try:
            return await query.total_count(engine)
        finally:
            await engine.dispose()

    return asyncio.run(total())


@dataclass
class Received:
    """What ``wrk`` read from one GTM process over every run against it."""

    responses: int = 0
    in_flight: int = 0  # the most requests wrk can have left unread when its runs stopped

    def add(self, result: WrkResult, connections: int) -> None:
        self.responses += result.requests
        self.in_flight += connections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--paced-rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="also run GTM with N processes")
    parser.add_argument(
        "--clients", type=int, default=4096, help="distinct client addresses (each its own /24)"
    )
    parser.add_argument(
        "--few-clients", type=int, default=64, help="the same for a second GTM variant"
    )
    parser.add_argument("--json", type=Path, help="write the results here as well")
    parser.add_argument(
        "--reports-per-s",
        type=float,
        default=0.0,
        help="push signed capacity reports to GTM at this rate throughout (a new snapshot each, "
        "as regional balancers cause in production: about one a second per region)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="also run the front of another checkout (e.g. a git worktree of an older commit) "
        "as gtm-baseline, interleaved with this one: a change's effect in one run",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also run the front without audit counting (front_uncounted.py), to split costs",
    )
    args = parser.parse_args()

    problems = missing_tools()
    if any(p.startswith("wrk") for p in problems):
        print("cannot run the benchmark:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    skip_nginx = any("nginx" in p or "geoip2" in p for p in problems)
    for problem in problems:
        print(f"note: {problem}" + (" - nginx is left out" if "nginx" in problem else ""))

    from gtm.decision.geoip import default_database_path

    mmdb = default_database_path()
    cores = os.sched_getaffinity(0)
    server_core, load_core = (str(min(cores)), str(max(cores))) if len(cores) >= 2 else (None, None)
    with tempfile.TemporaryDirectory(prefix="gtm-bench-http-") as tmpdir:
        tmp = Path(tmpdir)
        scripts: dict[int, Path] = {}
        for n in (args.clients, args.few_clients):
            scripts[n] = tmp / f"xff-{n}.lua"
            write_wrk_script(scripts[n], client_addresses(n), None)
        variants: list[Variant] = []
        try:
            port = free_port()
            variants.append(Variant("gtm", port, start_gtm(tmp, port, server_core), args.clients))
            variants.append(Variant(f"gtm-{args.few_clients}", port, None, args.few_clients))
            if args.baseline is not None:
                port = free_port()
                proc = start_gtm(tmp, port, server_core, tag="baseline", root=args.baseline)
                variants.append(Variant("gtm-baseline", port, proc, args.clients))
            if args.diagnose:
                port = free_port()
                proc = start_gtm(tmp, port, server_core, tag="uncounted", uncounted=True)
                variants.append(Variant("gtm-uncounted", port, proc, args.clients))
                port = free_port()
                bare_proto_cmd = [sys.executable, "bare_protocol.py", f"127.0.0.1:{port}"]
                proc = subprocess.Popen([*pin(server_core), *bare_proto_cmd], cwd=HERE)
                variants.append(Variant("bare-protocol", port, proc, args.clients))
            port = free_port()
            bare_cmd = [
                sys.executable, "-m", "uvicorn", "bare_asgi:app",
                "--host", "127.0.0.1", "--port", str(port),
                "--loop", "uvloop", "--http", "httptools",
                "--no-access-log", "--log-level", "warning",
            ]  # fmt: skip
            bare = subprocess.Popen([*pin(server_core), *bare_cmd], cwd=HERE)
            variants.append(Variant("bare", port, bare, args.clients))
            if not skip_nginx:
                port = free_port()
                conf = nginx_config(tmp, port, mmdb)
                nginx_cmd = ["nginx", "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"]
                nginx = subprocess.Popen([*pin(server_core), *nginx_cmd])
                variants.append(Variant("nginx", port, nginx, args.clients))
            if args.workers > 1:
                # N processes on the port and one, both unpinned with wrk floating beside them:
                # how the rate grows with the cores given.
                port = free_port()
                proc = start_gtm(tmp, port, None, workers=args.workers, tag="gtm-workers")
                variants.append(Variant(f"gtm-x{args.workers}", port, proc, args.clients))
                variants[-1].pinned = False
                variants.append(Variant("gtm-x1", free_port(), None, args.clients, pinned=False))
                variants[-1].proc = start_gtm(tmp, variants[-1].port, None, tag="gtm-x1")
            gtm_port = variants[0].port
            received = Received()  # by wrk, from the GTM process audited at the end

            def wrk(v: Variant, seconds: float, connections: int, script: Path) -> WrkResult:
                result = run_wrk(
                    v.port, seconds, connections, script, load_core if v.pinned else None
                )
                if v.port == gtm_port:
                    received.add(result, connections)
                return result

            for v in variants:
                wait_port(v.port)
            pusher = None
            if args.reports_per_s > 0:
                gtm_ports = sorted({v.port for v in variants if v.name.startswith("gtm")})
                pusher = ReportPusher(gtm_ports, args.reports_per_s)
                pusher.start()
            for v in variants:
                wrk(v, 2, args.connections, scripts[v.clients])  # warm-up
            for rnd in range(args.rounds):
                order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
                for v in order:
                    v.results.append(wrk(v, args.seconds, args.connections, scripts[v.clients]))
                print(
                    f"round {rnd + 1}/{args.rounds}: "
                    + ", ".join(f"{v.name} {v.results[-1].rate:,.0f}/s" for v in variants),
                    flush=True,
                )
            # Latency at 80 % of each variant's median maximum, paced by a per-connection delay,
            # in interleaved rounds too: the machine's noise lands on every variant alike. A
            # paced connection sends every delay + latency, so the connections that reach the
            # target rate are found by measuring (a few short calibration runs), not assumed. The
            # delay is wrk's shortest (1 ms), for the fewest connections: with a long delay and
            # hundreds of connections, their timers fire in bursts that queue at the server
            # (with 5 ms the paced p99 came out above the unpaced one).
            paced: dict[str, list[WrkResult]] = {v.name: [] for v in variants}
            delay_ms = 1
            pacing: dict[str, tuple[int, Path]] = {}
            for v in variants:
                target = 0.8 * statistics.median(r.rate for r in v.results)
                paced_script = tmp / f"paced-{v.name}.lua"
                write_wrk_script(paced_script, client_addresses(v.clients), delay_ms)
                connections = max(1, round(target * delay_ms / 1000))
                for attempt in range(6):
                    probe = wrk(v, 2, connections, paced_script)
                    if abs(probe.rate / target - 1) < 0.03 or attempt == 5:
                        break  # the count used is always one that was probed
                    # Capped steps: near saturation latency grows with the connections.
                    step = min(2.0, max(0.5, target / max(probe.rate, 1.0)))
                    connections = max(1, round(connections * step))
                print(
                    f"pacing {v.name}: {connections} connections for {target:,.0f}/s "
                    f"(last probe {probe.rate:,.0f}/s)",
                    flush=True,
                )
                pacing[v.name] = (connections, paced_script)
            for rnd in range(args.paced_rounds):
                order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
                for v in order:
                    connections, paced_script = pacing[v.name]
                    paced[v.name].append(wrk(v, args.seconds, connections, paced_script))
                print(
                    f"paced round {rnd + 1}/{args.paced_rounds}: "
                    + ", ".join(
                        f"{v.name} p99 {paced[v.name][-1].p99_ms:.2f} ms "
                        f"({paced[v.name][-1].rate:,.0f}/s)"
                        for v in variants
                    ),
                    flush=True,
                )
            if pusher is not None:
                pusher.stop()
                print(f"capacity reports accepted: {pusher.accepted:,}")
            gtm = variants[0]
            served = scrape_responses(gtm.port)
        finally:
            for v in variants:
                if v.proc is not None:
                    stop(v.proc)  # SIGTERM: a graceful stop, the audit writer's last flush
        counted = audited(tmp, "gtm")

    report(variants, paced, served, counted, received, args, len(cores))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    v.name: {
                        "rates": [r.rate for r in v.results],
                        "p99_ms": [r.p99_ms for r in v.results],
                        "paced_80pct": [r.__dict__ for r in paced[v.name]],
                    }
                    for v in variants
                }
                | {
                    "served": served,
                    "audited": counted,
                    "wrk_received": received.responses,
                    "wrk_in_flight_max": received.in_flight,
                },
                indent=2,
            )
        )
    return 0


def report(
    variants: list[Variant],
    paced: dict[str, list[WrkResult]],
    served: int,
    counted: int,
    received: Received,
    args: argparse.Namespace,
    cores: int,
) -> None:
    by = {v.name: v for v in variants}

    def med(name: str) -> float:
        return statistics.median(r.rate for r in by[name].results)

    def ratio(a: str, b: str) -> float:
        # Per round, then the median: both were measured minutes apart at most.
        return statistics.median(
            x.rate / y.rate for x, y in zip(by[a].results, by[b].results, strict=True)
        )

    print()
    print(
        f"{args.rounds} rounds x {args.seconds:g}s, wrk -t1 -c{args.connections}, "
        f"one server core; then {args.paced_rounds} rounds paced at 80% of each variant's median "
        f"maximum (wrk's per-connection delay: the rate reached, as a share of the maximum, "
        f"in brackets); medians over rounds"
        + (
            f"; capacity reports pushed at {args.reports_per_s:g}/s (a new snapshot each)"
            if args.reports_per_s > 0
            else ""
        )
    )
    print()

    def p99_paced(name: str) -> float:
        return statistics.median(r.p99_ms for r in paced[name])

    print(
        "| variant | clients | req/s (median) | min-max | p50 at max | p99 at max "
        "| p99 paced (min-max) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v in variants:
        rates = [r.rate for r in v.results]
        paced_cell = "-"  # --paced-rounds 0
        if paced[v.name]:
            share = statistics.median(r.rate for r in paced[v.name]) / med(v.name)
            p99s = [r.p99_ms for r in paced[v.name]]
            paced_cell = (
                f"{p99_paced(v.name):.2f} ms ({min(p99s):.2f}-{max(p99s):.2f}) [{share:.0%}]"
            )
        print(
            f"| {v.name} | {v.clients} | {med(v.name):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} "
            f"| {statistics.median(r.p50_ms for r in v.results):.2f} ms "
            f"| {statistics.median(r.p99_ms for r in v.results):.2f} ms | {paced_cell} |"
        )
    print()
    for name in (v.name for v in variants if v.name.startswith("gtm")):
        if name == "gtm-uncounted":
            print(f"{name} / bare (diagnostic, no audit counting): {ratio(name, 'bare'):.2f}")
            print(f"{name} / bare-protocol (diagnostic): {ratio(name, 'bare-protocol'):.2f}")
            continue
        print(f"{name} / bare (target >= 0.80): {ratio(name, 'bare'):.2f}")
        if "nginx" in by:
            print(f"{name} / nginx: {ratio(name, 'nginx'):.2f}")
        if "bare-protocol" in by:
            print(f"{name} / bare-protocol (diagnostic): {ratio(name, 'bare-protocol'):.2f}")
        if paced[name]:
            p99 = p99_paced(name)
            print(f"{name} p99 paced at 80% of its maximum (target <= 5 ms): {p99:.2f} ms")
    if "gtm-baseline" in by:
        same_run = ratio("gtm", "gtm-baseline")
        print(f"gtm / gtm-baseline ({args.baseline}), per round: {same_run:.2f}")
    errors = sum(r.errors for r in by["gtm"].results) + sum(r.errors for r in paced["gtm"])
    print(f"gtm non-3xx or socket errors: {errors}")
    verdict = "equal" if served == counted else "DIFFERENT"
    print(f"gtm responses served {served:,}, counted in the audit store {counted:,}: {verdict}")
    unread = counted - received.responses
    verdict = "consistent" if 0 <= unread <= received.in_flight else "INCONSISTENT"
    print(
        f"gtm responses read by wrk {received.responses:,}: counted - read = {unread:,} "
        f"(requests in flight when wrk stopped, at most {received.in_flight:,}): {verdict}"
    )
    if args.workers > 1:
        name = f"gtm-x{args.workers}"
        print(
            f"{name} / gtm-x1, both unpinned beside wrk ({cores} cores in all): "
            f"{ratio(name, 'gtm-x1'):.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
