"""A normal client's latency on the HTTP front with and without a slowloris beside it, in one run.

    python bench/http/slowloris.py [--rounds 3] [--seconds 5] [--slow 512] [--excess 64]
                                   [--per-client 512] [--trickle-s 1]

The front (``gtm serve --http``, one worker, the demo topology, full decisions and audit counting,
its default head and body deadlines) is pinned to one core; ``wrk`` and the attacker share the
other. The attacker (this script with ``--attack``) holds ``--slow`` connections from 127.0.0.2,
half sending a request head and half a request body a byte every ``--trickle-s`` seconds, and
opens each again as soon as the front cuts it (at its head or body deadline); ``--excess`` more
keep trying past the per-client limit and are refused. The normal client is ``wrk`` from
127.0.0.1 (a trusted proxy whose ``X-Forwarded-For`` names 4,096 client addresses), run in two
ways in each phase: paced (``--paced-connections`` connections, each waiting 1 ms between
requests: its latency below saturation) and unpaced (``--connections``: the rate it gets). The
phases, quiet and attacked, alternate over rounds; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.http.run import (  # noqa: E402
    HOST,
    WrkResult,
    client_addresses,
    free_port,
    missing_tools,
    pin,
    run_wrk,
    start_gtm,
    stop,
    wait_port,
    write_wrk_script,
)

ATTACKER = "127.0.0.2"


# The attacker ---------------------------------------------------------------------------------


async def _slow_connection(port: int, body: bool, trickle_s: float, stop: asyncio.Event) -> None:
    """One slowloris connection, opened again whenever the front closes it."""
    head = f"GET /v1/models HTTP/1.1\r\nHost: {HOST}\r\nX-Slow: ".encode()
    if body:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
        ).encode()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(ATTACKER, 0)
            )
        except OSError:
            await asyncio.sleep(0.5)
            continue
        try:
            writer.write(head)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(65536), trickle_s) == b"":
                        break  # closed by the front (refused, or cut at a deadline)
                writer.write(b"a")
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
        await asyncio.sleep(0.2)


async def attack(port: int, slow: int, trickle_s: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [
        asyncio.create_task(_slow_connection(port, i % 2 == 1, trickle_s, stop))
        for i in range(slow)
    ]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# The run --------------------------------------------------------------------------------------


def metrics(port: int) -> dict[str, float]:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False, timeout=10).text
    out: dict[str, float] = {}
    for name in (
        "gtm_front_connections_open",
        "gtm_front_head_timeouts_total",
        "gtm_front_body_timeouts_total",
        'gtm_front_connections_refused_total{reason="per_client"}',
    ):
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def wait_open(port: int, at_least: int | None, at_most: int | None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = metrics(port)["gtm_front_connections_open"]
        if (at_least is None or n >= at_least) and (at_most is None or n <= at_most):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{n:.0f} open connections, not within [{at_least}, {at_most}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--slow", type=int, default=512, help="slowloris connections held")
    parser.add_argument("--excess", type=int, default=64, help="more, past the per-client limit")
    parser.add_argument("--per-client", type=int, default=512, help="the front's per-client cap")
    parser.add_argument("--trickle-s", type=float, default=1.0)
    parser.add_argument("--connections", type=int, default=32, help="wrk, unpaced")
    parser.add_argument("--paced-connections", type=int, default=4, help="wrk, 1 ms apart")
    parser.add_argument("--attack", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack is not None:
        asyncio.run(attack(args.attack, args.slow, args.trickle_s))
        return 0
    if any(p.startswith("wrk") for p in missing_tools()):
        print("cannot run the benchmark: wrk not found (Debian package wrk)", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    server_core, load_core = (str(cores[0]), str(cores[-1])) if len(cores) >= 2 else (None, None)
    phases = ("quiet", "attacked")
    paced: dict[str, list[WrkResult]] = {p: [] for p in phases}
    unpaced: dict[str, list[WrkResult]] = {p: [] for p in phases}
    held: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gtm-bench-slowloris-") as tmpdir:
        tmp = Path(tmpdir)
        addresses = client_addresses(4096)
        kept, paced_script = tmp / "kept.lua", tmp / "paced.lua"
        write_wrk_script(kept, addresses, None)
        write_wrk_script(paced_script, addresses, 1)
        port = free_port()
        env = {
            # wrk's address is a trusted proxy (its X-Forwarded-For locates each request); the
            # attacker's is not, so the per-client cap applies to it.
            "GTM_TRUSTED_PROXIES": json.dumps(["127.0.0.1/32"]),
            "GTM_HTTP_MAX_CONNECTIONS_PER_CLIENT": str(args.per_client),
        }
        front = start_gtm(tmp, port, server_core, tag="slowloris", env=env)
        attacker: subprocess.Popen[bytes] | None = None
        try:
            wait_port(port)
            run_wrk(port, 2, args.connections, kept, load_core)  # warm-up
            for rnd in range(args.rounds):
                for phase in phases if rnd % 2 == 0 else phases[::-1]:
                    if phase == "attacked":
                        attacker = subprocess.Popen(
                            [
                                *pin(load_core),
                                sys.executable,
                                __file__,
                                "--attack",
                                str(port),
                                "--slow",
                                str(args.slow + args.excess),
                                "--trickle-s",
                                str(args.trickle_s),
                            ]
                        )
                        wait_open(port, min(args.slow, args.per_client), None)
                    before = metrics(port)["gtm_front_connections_open"]
                    paced[phase].append(
                        run_wrk(port, args.seconds, args.paced_connections, paced_script, load_core)
                    )
                    unpaced[phase].append(
                        run_wrk(port, args.seconds, args.connections, kept, load_core)
                    )
                    if phase == "attacked":
                        held.append(min(before, metrics(port)["gtm_front_connections_open"]))
                        assert attacker is not None
                        stop(attacker)
                        attacker = None
                        wait_open(port, None, 1)  # the scrape itself is one
                    print(
                        f"round {rnd + 1}/{args.rounds} {phase}: paced p50 "
                        f"{paced[phase][-1].p50_ms:.2f} ms p99 {paced[phase][-1].p99_ms:.2f} ms, "
                        f"unpaced {unpaced[phase][-1].rate:,.0f}/s",
                        flush=True,
                    )
            final = metrics(port)
        finally:
            if attacker is not None:
                stop(attacker)
            stop(front)
    report(args, paced, unpaced, held, final)
    return 0


def report(
    args: argparse.Namespace,
    paced: dict[str, list[WrkResult]],
    unpaced: dict[str, list[WrkResult]],
    held: list[float],
    final: dict[str, float],
) -> None:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    print()
    print(
        f"{args.rounds} rounds x {args.seconds}s per phase; attacker: {args.slow} + {args.excess} "
        f"slow connections from {ATTACKER} (half heads, half bodies, a byte every "
        f"{args.trickle_s:g} s), per-client cap {args.per_client}; normal client: wrk paced "
        f"(-c{args.paced_connections}, 1 ms apart) and unpaced (-c{args.connections}); medians"
    )
    print()
    print("| phase | paced p50 | paced p99 | paced req/s | unpaced req/s | unpaced p99 | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for phase in ("quiet", "attacked"):
        p, u = paced[phase], unpaced[phase]
        print(
            f"| {phase} | {med([r.p50_ms for r in p]):.2f} ms "
            f"| {med([r.p99_ms for r in p]):.2f} ms "
            f"| {med([r.rate for r in p]):,.0f} | {med([r.rate for r in u]):,.0f} "
            f"| {med([r.p99_ms for r in u]):.2f} ms | {sum(r.errors for r in p + u)} |"
        )
    print()

    def ratio(results: dict[str, list[WrkResult]], key: str) -> float:
        return med(
            [
                getattr(a, key) / getattr(q, key)
                for a, q in zip(results["attacked"], results["quiet"], strict=True)
            ]
        )

    print(
        f"attacked / quiet, per round: paced p50 {ratio(paced, 'p50_ms'):.2f}x, "
        f"paced p99 {ratio(paced, 'p99_ms'):.2f}x, unpaced rate {ratio(unpaced, 'rate'):.2f}x"
    )
    refused = final['gtm_front_connections_refused_total{reason="per_client"}']
    print(
        f"slow connections held open during the attacked runs (least seen): "
        f"{', '.join(f'{h:.0f}' for h in held)}; front totals: "
        f"{refused:.0f} refused "
        f"over the per-client cap, {final['gtm_front_head_timeouts_total']:.0f} head and "
        f"{final['gtm_front_body_timeouts_total']:.0f} body deadlines"
    )


if __name__ == "__main__":
    sys.exit(main())
