from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest
import uvloop
import yaml

from gtm.audit import query
from gtm.audit.database import make_async_engine
from gtm.front.affinity import AffinitySettings
from gtm.front.app import FrontApp
from gtm.front.connections import ConnectionLimits
from gtm.front.proxy import ProxyLimits
from gtm.front.server import FrontServer, HeadLimits
from gtm.front.tls import TlsFiles
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES

# The front's own connection handling (caps, head deadline, TLS) meets the event loop's transports
# directly, and `gtm serve` runs on uvloop, whose transports differ (they start reading after
# connection_made whatever the protocol paused): those tests run on both loops.
_BOTH_LOOPS = {"test_connections.py", "test_slow_clients.py", "test_tls.py"}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name in _BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


# The demo's regions are not running here: health comes from the tests (runtime.swap), not
# from probes that would find nothing listening.
NO_PROBES: dict[str, Any] = {"probes": False} if "probes" in Settings.model_fields else {}


@dataclass
class Front:
    url: str
    runtime: Runtime
    app: FrontApp
    server: FrontServer
    stop: asyncio.Event
    task: asyncio.Task[None]


def demo_topology() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    return copy.deepcopy(data)


FrontFactory = Callable[..., contextlib.AbstractAsyncContextManager[Front]]


@pytest.fixture
def start_front(tmp_path: Path, geoip_path: Path) -> FrontFactory:
    """Start a runtime and a front on a free loopback port; on exit stop both (the runtime's
    stop flushes every counted response to the audit store)."""

    @contextlib.asynccontextmanager
    async def start(
        topology: dict[str, Any] | None = None,
        trusted: tuple[str, ...] = ("127.0.0.0/8", "::1/128"),
        head_limits: HeadLimits = HeadLimits(),
        proxy_limits: ProxyLimits = ProxyLimits(connect_timeout_s=2.0, read_timeout_s=10.0),
        keep_alive_s: int = 5,
        ops_allow: tuple[str, ...] = (),
        connection_limits: ConnectionLimits | None = None,
        tls: TlsFiles | None = None,
        tls_reload_interval_s: float = 2.0,
        affinity: AffinitySettings | None = None,
    ) -> AsyncIterator[Front]:
        config = DEMO
        if topology is not None:
            config = tmp_path / "topology.yaml"
            config.write_text(yaml.safe_dump(topology))
        settings = Settings(
            config=config,
            policies=(POLICIES,),
            geoip_path=geoip_path,
            database_url=f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
            spool_dir=tmp_path / "spool",
            node_id="front-test",
            audit_flush_interval_s=0.05,
            trusted_proxies=tuple(ip_network(t) for t in trusted),
            ops_allow=tuple(ip_network(n) for n in ops_allow),
            **NO_PROBES,
        )
        runtime = Runtime(settings)
        await runtime.start()
        # Health comes from the tests (runtime.swap). The fleet sync's composition (no probes,
        # no peers: every region "unknown", every half second) would put its own view back
        # over a test's, at a moment the test does not choose.
        runtime.sync.on_compose = lambda composed: None
        server = FrontServer(
            runtime,
            "127.0.0.1:0",
            head_limits=head_limits,
            proxy_limits=proxy_limits,
            graceful_timeout_s=5,
            keep_alive_s=keep_alive_s,
            connection_limits=connection_limits,
            tls=tls,
            tls_reload_interval_s=tls_reload_interval_s,
            affinity=affinity,
        )
        server.bind()
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(server.run(stop, ready))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            assert server.app is not None
            yield Front(server.url, runtime, server.app, server, stop, task)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await runtime.stop()

    return start


async def audited(runtime: Runtime) -> int:
    """Answers counted in the audit store (read back from the database)."""
    engine = make_async_engine(runtime.settings.database_url)
    try:
        return await query.total_count(engine)
    finally:
        await engine.dispose()


async def audit_rows(runtime: Runtime) -> list[dict[str, Any]]:
    engine = make_async_engine(runtime.settings.database_url)
    try:
        return await query.tail(engine, limit=10_000)
    finally:
        await engine.dispose()
