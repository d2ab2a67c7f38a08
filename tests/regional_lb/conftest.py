"""Fixtures for the regional tier: simulated instances and balancers on loopback sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest

from regional_lb.balancing.gpus import profile
from regional_lb.config import BalancerConfig, parse_config
from regional_lb.protocol.serving import running
from regional_lb.proxy.app import create_app
from regional_lb.sim.engine import Engine, EngineConfig
from regional_lb.sim.server import create_app as create_sim
from regional_lb.upstream.pool import Pool
from tests.support.waiting import eventually

SPEEDUP = 20.0  # a simulated A100 token takes 1 ms


@asynccontextmanager
async def sim(
    gpu: str = "A100", models: tuple[str, ...] = ("m1",), speedup: float = SPEEDUP, **kw: Any
) -> AsyncIterator[tuple[str, Engine]]:
    app = create_sim(EngineConfig(gpu=profile(gpu), models=list(models), speedup=speedup, **kw))
    async with running(app) as url:
        yield url, app.state.engine


def balancer_config(urls: list[str], **overrides: Any) -> BalancerConfig:
    doc: dict[str, Any] = {
        "region": "test-region",
        "instances": [
            {"id": f"i{k}", "url": u, "gpu": "A100", "models": ["m1"]} for k, u in enumerate(urls)
        ],
        "health": {
            "probe_interval_s": 0.2,
            "probe_timeout_s": 1.0,
            "slow_start_s": 0,
            "stall_timeout_s": 5.0,
        },
        "scrape": {"interval_s": 0.2, "stale_after_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0, "read_s": 10.0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return parse_config(doc)


@asynccontextmanager
async def balancer(
    config: BalancerConfig, secret: bytes | None = None
) -> AsyncIterator[tuple[str, Pool]]:
    app = create_app(config, secret)
    async with running(app) as url:
        yield url, app.state.pool


def idle(pool: Pool) -> bool:
    return all(i.in_flight == 0 and i.outstanding == 0.0 for i in pool.instances) and (
        pool.admission.running == 0
    )


def chat(
    model: str = "m1", max_tokens: int = 20, stream: bool = False, exact: bool = True, **extra: Any
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": exact,
        **extra,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SimProcess = Callable[..., tuple[str, subprocess.Popen[bytes]]]


@pytest.fixture
def sim_process() -> Iterator[SimProcess]:
    """Start ``regional-lb sim-backend`` as a real process (so a test can kill it)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from regional_lb.cli import app; app()",
                "sim-backend",
                "--listen",
                f"127.0.0.1:{port}",
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=0.5).status_code == 200:
                    return url, proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("sim-backend did not start")
            time.sleep(0.05)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


SimFactory = Callable[..., AbstractAsyncContextManager[tuple[str, Engine]]]


__all__ = ["eventually"]  # the regional tests import it from here
