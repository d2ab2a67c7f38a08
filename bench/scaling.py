"""Worker scaling with the cores given: ``gtm serve --workers N`` against one worker, each in a
CPU cgroup whose quota is N times the same share of a CPU.

    python bench/scaling.py [--share 0.4] [--workers 1 2] [--rounds 3] [--seconds 5]

On a machine with few cores the load generator needs one of them, so "N workers on N free
cores" cannot be run as such. A CFS quota gives each configuration exactly N x ``share`` CPUs
instead (the rest is left to dnsperf and wrk), which is what "the cores given" means. Each
configuration serves DNS (5,000 ECS subnets, dnsperf) and the HTTP redirect path (4,096
clients, wrk) on the demo topology with full decisions and audit counting; the configurations
run side by side, idle while another is measured, in rounds with the order rotating. Printed:
the maximum rate per configuration (median over rounds), the CPU the cgroup used per second
(it should sit at its quota: the rate is bounded by the cores given, not by the load
generator), and the rate per CPU relative to one worker: about 1.0 means the rate scales with
the cores given.

Needs root and the cgroup (v1 ``cpu`` or v2) filesystem at /sys/fs/cgroup.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dns import run as dnsbench  # noqa: E402
from bench.http import run as httpbench  # noqa: E402
from gtm.decision.geoip import default_database_path  # noqa: E402

PERIOD_US = 100_000


def _enter(procs: Path, argv: list[str]) -> list[str]:
    """``argv`` started inside the cgroup whose ``cgroup.procs`` is ``procs`` (its worker
    processes inherit the group)."""
    return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]


class CpuGroup:
    """A CPU cgroup with a quota, v1 (``cpu`` controller) or v2 (``cpu.max``)."""

    def __init__(self, name: str, cpus: float) -> None:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        base = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/cpu")
        self.path = base / name
        self.path.mkdir(exist_ok=True)
        quota = int(cpus * PERIOD_US)
        if v2:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        self.v2 = v2

    def wrap(self, argv: list[str]) -> list[str]:
        return _enter(self.path / "cgroup.procs", argv)

    def cpu_seconds(self) -> float:
        """CPU time used by the group (v2; on v1 see :func:`_cpuacct`)."""
        if self.v2:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec"):
                    return int(line.split()[1]) / 1e6
        return float("nan")

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _cpuacct(name: str) -> Path | None:
    """cgroup v1 keeps CPU usage in the cpuacct hierarchy: a group of the same name there."""
    base = Path("/sys/fs/cgroup/cpuacct")
    if not base.exists() or Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return None
    path = base / name
    path.mkdir(exist_ok=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--share", type=float, default=0.4, help="CPUs per worker")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument(
        "--database-url",
        help="audit store for every configuration (default: an SQLite file each); several "
        "workers write one store, which SQLite serialises",
    )
    args = parser.parse_args()
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup").exists():
        sys.exit("needs root and /sys/fs/cgroup (CPU quotas stand in for cores)")
    missing = [t for t in ("dnsperf", "wrk") if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing: {', '.join(missing)} (Debian packages dnsperf, wrk)")

    work = Path(tempfile.mkdtemp(prefix="gtm-scaling-"))
    geoip = default_database_path()
    sets = dnsbench.write_sets(work, geoip, 5000)
    ecs_data, ecs_binary = sets["ecs"]
    script = work / "wrk.lua"
    httpbench.write_wrk_script(script, httpbench.client_addresses(4096), None)

    groups: dict[int, CpuGroup] = {}
    accts: dict[int, Path | None] = {}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    ports: dict[int, tuple[int, int]] = {}
    rates: dict[tuple[int, str], list[float]] = {}
    cpu_use: dict[tuple[int, str], list[float]] = {}
    try:
        for n in args.workers:
            name = f"gtm-bench-{n}w"
            groups[n] = CpuGroup(name, n * args.share)
            accts[n] = _cpuacct(name)
            server = dnsbench.gtm_server(work, geoip, f"gtm-{n}w", workers=n)
            http_port = httpbench.free_port()
            argv = [*server.argv, "--http", f"127.0.0.1:{http_port}"]
            # gtm_server's own --http (for pushed reports) is replaced by this one.
            i = argv.index("--http")
            del argv[i : i + 2]
            env = dict(server.env or {})
            env["GTM_TRUSTED_PROXIES"] = '["127.0.0.0/8"]'
            if args.database_url:
                env["GTM_DATABASE_URL"] = args.database_url
            wrapped = groups[n].wrap(argv)
            acct = accts[n]
            if acct is not None:
                wrapped = _enter(acct / "cgroup.procs", wrapped)
            procs[n] = subprocess.Popen(
                wrapped, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            ports[n] = (server.port, http_port)
        for n in args.workers:
            httpbench.wait_port(ports[n][1])
            dnsbench.dnsperf(ports[n][0], ecs_data, ecs_binary, 2, work / "warm.out")
            httpbench.run_wrk(ports[n][1], 2, 32, script, None)

        def usage(n: int) -> float:
            acct = accts[n]
            if acct is not None:
                return int((acct / "cpuacct.usage").read_text()) / 1e9
            return groups[n].cpu_seconds()

        for rnd in range(args.rounds):
            order = (
                args.workers[rnd % len(args.workers) :] + args.workers[: rnd % len(args.workers)]
            )
            for n in order:
                c0, t0 = usage(n), time.monotonic()
                out = dnsbench.dnsperf(
                    ports[n][0], ecs_data, ecs_binary, args.seconds, work / "dns.out"
                )
                cpu_use.setdefault((n, "dns"), []).append((usage(n) - c0) / (time.monotonic() - t0))
                rates.setdefault((n, "dns"), []).append(dnsbench.field(out, "Queries per second"))
                c0, t0 = usage(n), time.monotonic()
                result = httpbench.run_wrk(ports[n][1], args.seconds, 32 * n, script, None)
                cpu_use.setdefault((n, "http"), []).append(
                    (usage(n) - c0) / (time.monotonic() - t0)
                )
                rates.setdefault((n, "http"), []).append(result.rate)
            print(
                f"round {rnd + 1}/{args.rounds}: "
                + ", ".join(
                    f"{n}w dns {rates[(n, 'dns')][-1]:,.0f}/s http {rates[(n, 'http')][-1]:,.0f}/s"
                    for n in args.workers
                ),
                flush=True,
            )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for group in groups.values():
            group.remove()
        for acct in accts.values():
            if acct is not None:
                for _ in range(50):
                    try:
                        acct.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)

    base = args.workers[0]
    print(
        f"\nWorkers in a CPU cgroup of N x {args.share:g} CPU each; {args.rounds} rounds x "
        f"{args.seconds:g} s, medians; DNS: dnsperf, 5,000 ECS subnets; HTTP: wrk, 4,096 clients; "
        f"audit store: {'the given URL' if args.database_url else 'an SQLite file each'}"
    )
    print("| workers | CPUs given | path | rate | CPU used / given | rate per CPU vs 1 worker |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in ("dns", "http"):
        base_rate = statistics.median(rates[(base, path)]) / (base * args.share)
        for n in args.workers:
            rate = statistics.median(rates[(n, path)])
            used = statistics.median(cpu_use[(n, path)])
            given = n * args.share
            print(
                f"| {n} | {given:g} | {path} | {rate:,.0f}/s | {used / given:.2f} | "
                f"{rate / given / base_rate:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
