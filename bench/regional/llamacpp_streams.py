"""Cut streams: the balancer in front of a real llama-cpp-python server, while it probes.

    python bench/regional/llamacpp_streams.py [--baseline DIR] [--sequential 100]
        [--concurrent 20] [--direct 30] [--probe-interval 0.05]

Needs the ``llamacpp`` extra (llama-cpp-python and gguf). Builds the tests' tiny random-weight
llama model (tests/regional_lb/llamacpp.py), starts ``python -m llama_cpp.server`` with its
defaults (``interrupt_requests`` on: a request that needs the model ends any running stream),
then, for each variant, a ``regional-lb serve`` process (``kind: openai``, one request at a
time, probing every ``--probe-interval`` s) and:

- ``--sequential`` streamed chats one after the other through the balancer, then
  ``--concurrent`` at once;
- ``--direct`` streamed chats straight to the server, one at a time, while the balancer
  (idle) keeps probing it: what the probes cost the server's other clients.

A stream is cut when it ends without a ``finish_reason`` (the server sent ``[DONE]`` early);
"after [DONE]" counts streams with anything relayed after their ``[DONE]``; "charged" sums the
balancer's ``regional_lb_upstream_failures_total``. The ``direct`` row is the server alone
(no balancer), the baseline everything is compared with. ``--baseline DIR``: an export of an
earlier tree (``git archive HEAD regional_lb | tar -x -C DIR``) run the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.regional_lb.llamacpp import ALIAS, llama_server, write_model  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _balancer(tree: Path, server: str, probe_interval: float) -> Iterator[str]:
    port = _free_port()
    config = "\n".join(
        [
            "region: bench",
            f"listen: 127.0.0.1:{port}",
            "server_kind: openai",
            "instances:",
            f"  - {{id: llama, url: '{server}', gpu: cpu, speed: 1.0, max_concurrency: 1}}",
            "tiers:",
            "  - {name: standard, max_utilisation: 1.0, queue_limit: 500, queue_timeout_s: 120}",
            "health:",
            f"  probe_interval_s: {probe_interval}",
            "  probe_timeout_s: 2.0",
            "  slow_start_s: 0",
            "timeouts: {first_byte_s: 60.0, read_s: 60.0}",
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    code = "from regional_lb.cli import app; app(prog_name='regional-lb')"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lb.yaml"
        path.write_text(config + "\n")
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--config", str(path), "--grace", "1"],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:  # ready once it lists the server's model
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    data = httpx.get(f"{url}/v1/models", timeout=2).json().get("data", [])
                    if any(m.get("id") == ALIAS for m in data):
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the balancer did not come up")
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _stream(c: httpx.AsyncClient, url: str) -> tuple[bool, bool]:
    """One streamed chat: (cut, something after [DONE])."""
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 48,
        "stream": True,
    }
    finish, done, after = False, False, False
    # The server closes an interrupted stream's connection right after its early [DONE].
    with contextlib.suppress(httpx.RemoteProtocolError):
        async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if done:
                    after = True
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                doc = json.loads(data)
                finish = finish or any(ch.get("finish_reason") for ch in doc.get("choices", []))
    return not finish, after


async def _through(url: str, sequential: int, concurrent: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=120) as c:
        seq = [await _stream(c, url) for _ in range(sequential)]
        con = await asyncio.gather(*(_stream(c, url) for _ in range(concurrent)))
        metrics = (await c.get(f"{url}/metrics")).text
    charged = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("regional_lb_upstream_failures_total{")
    )
    return {
        f"cut of {sequential} sequential": sum(cut for cut, _ in seq),
        f"cut of {concurrent} concurrent": sum(cut for cut, _ in con),
        "sent after [DONE]": sum(after for _, after in [*seq, *con]),
        "failures charged": charged,
    }


async def _direct(server: str, n: int) -> int:
    async with httpx.AsyncClient(timeout=120) as c:
        return sum([(await _stream(c, server))[0] for _ in range(n)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="an earlier tree to compare")
    ap.add_argument("--sequential", type=int, default=100)
    ap.add_argument("--concurrent", type=int, default=20)
    ap.add_argument("--direct", type=int, default=30)
    ap.add_argument("--probe-interval", type=float, default=0.05)
    args = ap.parse_args()
    variants = ([("before", args.baseline.resolve())] if args.baseline else []) + [("after", ROOT)]
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "tiny.gguf")
        with llama_server(model) as server:
            alone = asyncio.run(_direct(server, args.direct))
            rows["server alone"] = {f"direct clients cut of {args.direct}": alone}
            for name, tree in variants:
                with _balancer(tree, server, args.probe_interval) as url:
                    row = asyncio.run(_through(url, args.sequential, args.concurrent))
                    row[f"direct clients cut of {args.direct}"] = asyncio.run(
                        _direct(server, args.direct)
                    )
                rows[name] = row
    names = list(rows)
    metrics = list(dict.fromkeys(m for r in rows.values() for m in r))
    print(f"llama-cpp-python server, probes every {args.probe_interval:g} s")
    print(f"| metric | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for m in metrics:
        cells = [f"{rows[n][m]:g}" if m in rows[n] else "-" for n in names]
        print(f"| {m} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
