"""Overload experiment: do 429s tell clients the truth about when to come back?

    python bench/regional/overload.py [--baseline DIR] [--clients 50] [--retries 3] [--runs 1]

The real balancer (``regional-lb serve``, a process) in front of two ``regional-lb
sim-backend`` processes on loopback (ports from the OS), each instance limited to 4 requests
at a time, one tier with a queue of 10 and a 3 s queue timeout. ``--clients`` requests arrive
at once, each through the official OpenAI SDK with ``max_retries=--retries``, so the SDK's own
retry logic (Retry-After, then its backoff) decides when each comes back. Every attempt is
logged by an event hook on the SDK's HTTP client. With ``--baseline DIR`` (a checkout of an
earlier commit, e.g. ``git worktree add /tmp/rlb-baseline HEAD``) the same experiment runs
first against the balancer of that tree (same simulated instances, same configuration), and
the table puts both side by side.

Retry-After accuracy: for each 429, the value the client was told (``retry-after-ms`` when
present, as the SDK reads it, else ``retry-after``) against the actual time until a slot was
free for that request: its place in line is behind every request that arrived before it (by
first attempt) and had not finished, and its turn came when fewer of those than the pool's
slots were left unfinished. A 429 is accurate when the value is within +-50% of that time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai

ROOT = Path(__file__).resolve().parents[2]
SLOTS_PER_INSTANCE = 4
INSTANCES = 2
QUEUE_LIMIT = 10
QUEUE_TIMEOUT_S = 3.0
MAX_TOKENS = 50  # ~1.5 s on a simulated A100 batching 4: the 50-request backlog takes ~10 s
WARMUP_ROUNDS = 2


@dataclass
class Attempt:
    sent: float
    answered: float = 0.0
    status: int = 0
    told: float | None = None  # Retry-After, seconds


@dataclass
class Logical:
    index: int
    attempts: list[Attempt] = field(default_factory=list)
    ok: bool = False
    ended: float = 0.0

    @property
    def first(self) -> float:
        return self.attempts[0].sent if self.attempts else float("inf")


CURRENT: contextvars.ContextVar[Logical] = contextvars.ContextVar("current")


async def _on_request(request: httpx2.Request) -> None:
    CURRENT.get().attempts.append(Attempt(sent=time.monotonic()))


async def _on_response(response: httpx2.Response) -> None:
    attempt = CURRENT.get().attempts[-1]
    attempt.answered, attempt.status = time.monotonic(), response.status_code
    if response.status_code == 429:
        ms = response.headers.get("retry-after-ms")
        s = response.headers.get("retry-after")
        attempt.told = float(ms) / 1000 if ms else float(s) if s else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], path: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url}{path} not ready in 30 s")


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _config(sims: list[str], port: int) -> str:
    """A configuration both the current and the baseline balancer accept."""
    lines = ["region: bench", f"listen: 127.0.0.1:{port}", "instances:"]
    for k, url in enumerate(sims):
        lines.append(
            f"  - {{id: i{k}, url: '{url}', gpu: A100, models: [m1], "
            f"max_concurrency: {SLOTS_PER_INSTANCE}}}"
        )
    lines += [
        "models: {m1: {decode_per_token: 0.02, prefill_per_token: 0.0002, overhead: 0.005}}",
        "tiers:",
        f"  - {{name: standard, max_utilisation: 1.0, queue_limit: {QUEUE_LIMIT}, "
        f"queue_timeout_s: {QUEUE_TIMEOUT_S}}}",
        "default_tier: standard",
        "default_tenant: {rate: 100000, burst: 100000}",
        "health: {probe_interval_s: 1, slow_start_s: 0}",
    ]
    return "\n".join(lines) + "\n"


async def _one(client: openai.AsyncOpenAI, rec: Logical) -> None:
    CURRENT.set(rec)
    try:
        await client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": f"request {rec.index}"}],
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        rec.ok = True
    except openai.APIError:
        rec.ok = False
    rec.ended = time.monotonic()


async def _experiment(url: str, clients: int, retries: int) -> list[Logical]:
    hooks: dict[str, list[Any]] = {"request": [_on_request], "response": [_on_response]}
    limits = httpx2.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with (
        httpx2.AsyncClient(event_hooks=hooks, limits=limits, timeout=120) as http,
        openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=retries, http_client=http
        ) as client,
    ):
        # Warm-up, not measured: a balancer in service has seen requests like these (its
        # output-length ratio and timings are learned); two rounds that fill every slot.
        slots = SLOTS_PER_INSTANCE * INSTANCES
        for _ in range(WARMUP_ROUNDS):
            warm = [Logical(-1) for _ in range(slots)]
            await asyncio.gather(*(asyncio.create_task(_one(client, r)) for r in warm))
        records = [Logical(k) for k in range(clients)]
        await asyncio.gather(*(asyncio.create_task(_one(client, r)) for r in records))
    return records


def _actual_wait(rec: Logical, t: float, records: list[Logical], slots: int) -> float:
    """Time from ``t`` until fewer than ``slots`` of the requests ahead of ``rec`` (arrived
    first, finished after ``t``, served in the end) were left."""
    ends = sorted(q.ended for q in records if q is not rec and q.ok and q.first < rec.first)
    left = [e for e in ends if e > t]
    if len(left) < slots:
        return 0.0
    return left[len(left) - slots] - t


def summarise(records: list[Logical]) -> dict[str, float]:
    slots = SLOTS_PER_INSTANCE * INSTANCES
    told, actual, accurate = [], [], 0
    for rec in records:
        for a in rec.attempts:
            if a.status != 429 or a.told is None:
                continue
            real = _actual_wait(rec, a.answered, records, slots)
            told.append(a.told)
            actual.append(real)
            accurate += abs(a.told - real) <= 0.5 * real
    n429 = len(told)
    start = min(r.first for r in records)
    return {
        "requests": len(records),
        "failed": sum(not r.ok for r in records),
        "attempts": sum(len(r.attempts) for r in records),
        "rejections (429)": n429,
        "retry_after_within_50pct": accurate / n429 if n429 else float("nan"),
        "retry_after_median_s": statistics.median(told) if told else float("nan"),
        "retry_after_max_s": max(told) if told else float("nan"),
        "distinct_retry_after": len({round(x, 3) for x in told}),
        "actual_wait_median_s": statistics.median(actual) if actual else float("nan"),
        "actual_wait_max_s": max(actual) if actual else float("nan"),
        "makespan_s": max(r.ended for r in records) - start,
    }


def run_variant(tree: Path, clients: int, retries: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    env.pop("REGIONAL_LB_REPORT_SECRET", None)
    code = "from regional_lb.cli import app; app(prog_name='regional-lb')"
    with _processes() as procs, tempfile.TemporaryDirectory() as tmp:
        sims = []
        for _ in range(INSTANCES):  # the simulated instances always come from this tree
            port = _free_port()
            args = ["sim-backend", "--listen", f"127.0.0.1:{port}", "--gpu", "A100"]
            args += ["--models", "m1", "--speedup", "1"]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, *args],
                    cwd=ROOT,
                    env={**env, "PYTHONPATH": str(ROOT)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            sims.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(sims, procs, strict=True):
            _wait_ready(url, proc, "/health")
        port = _free_port()
        cfg = Path(tmp) / "lb.yaml"
        cfg.write_text(_config(sims, port))
        lb = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--config", str(cfg), "--grace", "1"],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(lb)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, lb, "/readyz")
        records = asyncio.run(_experiment(url, clients, retries))
        return summarise(records)


def _fmt(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a checkout of an earlier commit to compare")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="repeat and report the median")
    args = ap.parse_args()
    variants = ([("before", args.baseline.resolve())] if args.baseline else []) + [("after", ROOT)]
    results: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.runs):
        for name, tree in variants:
            results.setdefault(name, []).append(run_variant(tree, args.clients, args.retries))
    names = [n for n, _ in variants]
    print(
        f"{args.clients} concurrent clients, openai SDK max_retries={args.retries}; "
        f"{INSTANCES} instances x {SLOTS_PER_INSTANCE} slots, queue {QUEUE_LIMIT}, "
        f"queue timeout {QUEUE_TIMEOUT_S:g} s; median of {args.runs} run(s)"
    )
    print(f"| metric | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for metric in results[names[0]][0]:
        cells = [_fmt(statistics.median(r[metric] for r in results[n])) for n in names]
        print(f"| {metric} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
