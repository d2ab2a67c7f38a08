from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import pytest
import yaml
from sqlalchemy import text

from gtm.geodns import udp as udp_listener
from gtm.node import Node, run_node
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES

StartNode = Callable[..., Awaitable[Node]]


@pytest.fixture
async def start_node(tmp_path: Path, geoip_path: Path) -> AsyncIterator[StartNode]:
    """Start a node with DNS listeners on free ports; stopped (audit flushed) at teardown."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(config: Path = DEMO, **overrides: Any) -> Node:
        settings = Settings(
            **{
                "config": config,
                "policies": (POLICIES,),
                "geoip_path": geoip_path,
                "database_url": f"sqlite:///{tmp_path / f'dns{len(running)}.sqlite3'}",
                "spool_dir": tmp_path / f"spool{len(running)}",
                "node_id": "dns-test",
                "dns_listen": ("127.0.0.1:0", "[::1]:0"),
                "probes": False,  # no regional balancers run in these tests
                "audit_flush_interval_s": 0.2,
                **overrides,
            }
        )
        stop = asyncio.Event()
        ready: asyncio.Future[Node] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(run_node(settings, stop, ready))
        running.append((stop, task))
        done, _ = await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            running.pop()  # nothing to stop at teardown
            task.result()  # raises what stopped the node
        return ready.result()

    yield start
    for stop, task in running:
        stop.set()
        await task


def port_of(node: Node, family: int = 4) -> int:
    assert node.dns is not None
    for host, port in node.dns.bound:
        if (":" in host) == (family == 6):
            return port
    raise AssertionError("no listener of that family")


async def udp(
    node: Node, message: dns.message.Message, host: str = "127.0.0.1", source: str | None = None
) -> dns.message.Message:
    return await dns.asyncquery.udp(
        message,
        host,
        port=port_of(node, 6 if ":" in host else 4),
        timeout=3,
        source=source,
        ignore_unexpected=False,
    )


async def tcp(
    node: Node, message: dns.message.Message, host: str = "127.0.0.1"
) -> dns.message.Message:
    return await dns.asyncquery.tcp(
        message, host, port=port_of(node, 6 if ":" in host else 4), timeout=3
    )


async def raw_udp(
    node: Node, payload: bytes, wait: float = 1.0, source: str = "127.0.0.1"
) -> bytes | None:
    """Send any bytes; the reply, or None if none came."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.bind((source, 0))
        await loop.sock_sendto(sock, payload, ("127.0.0.1", port_of(node)))
        try:
            return await asyncio.wait_for(loop.sock_recv(sock, 65535), wait)
        except TimeoutError:
            return None


async def raw_tcp(node: Node, wire: bytes) -> bytes:
    """Send any bytes as one TCP message (length-prefixed); the one message that comes back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(node))
    try:
        writer.write(struct.pack("!H", len(wire)) + wire)
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        return await reader.readexactly(length)
    finally:
        writer.close()
        await writer.wait_closed()


def write_topology(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    data = yaml.safe_load(DEMO.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))
    return path


async def audited(node: Node, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    """The audit store's rows for ``sql`` once the writer has flushed what was counted."""
    await node.runtime.writer.flush()
    async with node.runtime.engine.connect() as conn:
        return list((await conn.execute(text(sql), params or {})).all())


@pytest.fixture
def manual_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The established set's timer out of the way (gtm.geodns.udp): each test runs the ticks
    it means."""
    monkeypatch.setattr(udp_listener, "TICK_S", 3600.0)
