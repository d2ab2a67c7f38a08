"""Proxy (anycast) mode against real regional servers on loopback: one that refuses connections,
one that answers 503, one that breaks off mid-stream, and healthy ones that stream."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gtm.front.proxy import ProxyLimits, end_to_end
from tests.gtm.front.conftest import FrontFactory, audit_rows, audited, demo_topology

FRANKFURT = "198.51.100.7"  # nearest: eu-central, then eu-west
CHAT_EU = "chat.eu.gtm.example"


@dataclass
class Region:
    """A minimal HTTP/1.1 server that behaves as told and remembers what it was sent."""

    # "ok" | "503" | "midstream" (the first answer only) | "slow" (4 s of tokens) | "short"
    behaviour: str
    name: str
    port: int = 0
    requests: list[tuple[bytes, dict[str, str], bytes]] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *lines = head.decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append((line.encode(), headers, body))
            if self.behaviour in ("slow", "short"):
                # A token stream; the front closing the connection is the cancel signal.
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for _ in range(200 if self.behaviour == "slow" else 10):
                    writer.write(b"7\r\ntoken\n\n\r\n")
                    await writer.drain()
                    if await _closed(reader, 0.02):
                        self.cancelled.set()
                        return
                writer.write(b"0\r\n\r\n")
            elif self.behaviour == "503":
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
                writer.write(b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n")
                for i in range(3):
                    chunk = f"data: {self.name} {i} {body.decode()}\n\n".encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                    if self.behaviour == "midstream" and i == 0 and len(self.requests) == 1:
                        writer.transport.abort()  # the region dies after the first token
                        return
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _closed(reader: asyncio.StreamReader, wait: float) -> bool:
    """Whether the peer closed its side within ``wait`` seconds."""
    try:
        return await asyncio.wait_for(reader.read(1), wait) == b""
    except TimeoutError:
        return False


@contextlib.asynccontextmanager
async def regions(**behaviours: str) -> AsyncIterator[dict[str, Region]]:
    servers = []
    made: dict[str, Region] = {}
    for name, behaviour in behaviours.items():
        region = Region(behaviour, name.replace("_", "-"))
        server = await asyncio.start_server(region.handle, "127.0.0.1", 0)
        region.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        made[region.name] = region
    try:
        yield made
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


def refused_port() -> int:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proxy_topology(ports: dict[str, int]) -> dict[str, Any]:
    topo = demo_topology()
    for region in topo["regions"]:
        region["base_url"] = f"http://127.0.0.1:{ports.get(region['id']) or refused_port()}"
    for service in topo["services"]:
        service["http"] = {"mode": "proxy"}
    return topo


def client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, trust_env=False, timeout=10)


HEADERS = {"host": CHAT_EU, "x-forwarded-for": FRANKFURT}


async def _read_stream(http: httpx.AsyncClient, received: list[str]) -> None:
    async with http.stream("POST", "/v1/chat", content=b"q", headers=HEADERS) as r:
        assert r.status_code == 200
        async for chunk in r.aiter_text():
            received.append(chunk)


async def test_streams_the_regions_answer_with_body_and_client_address(
    start_front: FrontFactory,
) -> None:
    async with regions(eu_central="ok", eu_west="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            extra = {"connection": "keep-alive, x-secret-hop", "x-secret-hop": "1"}
            async with http.stream(
                "POST", "/v1/chat?stream=1", content=b"hello", headers={**HEADERS, **extra}
            ) as r:
                chunks = [c async for c in r.aiter_text()]
            assert r.status_code == 200
            assert r.headers["x-gtm-region"] == "eu-central"
            assert "".join(chunks) == "".join(f"data: eu-central {i} hello\n\n" for i in range(3))
    line, headers, body = up["eu-central"].requests[0]
    assert line == b"POST /v1/chat?stream=1 HTTP/1.1"
    assert body == b"hello"
    assert headers["x-forwarded-for"] == FRANKFURT
    assert headers["x-forwarded-host"] == CHAT_EU
    assert headers["x-gtm-residency"] == "eu-personal"
    # Headers the client's Connection names are hop-by-hop (RFC 9110 section 7.6.1).
    assert "x-secret-hop" not in headers
    assert "connection" not in headers or "x-secret-hop" not in headers["connection"]
    assert not up["eu-west"].requests
    assert await audited(front.runtime) == 1


@pytest.mark.parametrize("first", ["refused", "503"])
async def test_failure_before_the_first_byte_retries_inside_the_allowed_set(
    start_front: FrontFactory, first: str
) -> None:
    behaviours = {"eu_west": "ok", "us_east": "ok"}
    if first == "503":
        behaviours["eu_central"] = "503"
    async with regions(**behaviours) as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            r = await http.post("/v1/chat", content=b"q", headers=HEADERS)
            assert r.status_code == 200
            assert r.headers["x-gtm-region"] == "eu-west"
            assert r.text.startswith("data: eu-west 0 q")
    assert len(up["eu-west"].requests) == 1
    assert not up["us-east"].requests  # nearer than nothing, but not allowed
    if first == "503":
        assert len(up["eu-central"].requests) == 1
    rows = await audit_rows(front.runtime)
    assert [(row["region"], row["response"].split(" ")[0]) for row in rows] == [("eu-west", "200")]
    assert "eu-central" in rows[0]["response"]  # the retry is on the record


async def test_every_allowed_region_failing_is_a_clean_502(start_front: FrontFactory) -> None:
    async with regions(us_east="ok", us_west="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            r = await http.post("/v1/chat", content=b"q", headers=HEADERS)
            assert r.status_code == 502
            assert r.json()["error"] == "no_region_could_be_reached"
    assert not up["us-east"].requests
    assert not up["us-west"].requests
    assert await audited(front.runtime) == 1


async def test_failure_mid_stream_is_not_retried_and_ends_the_response(
    start_front: FrontFactory,
) -> None:
    async with regions(eu_central="midstream", eu_west="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            received: list[str] = []
            with pytest.raises(httpx.RemoteProtocolError):
                await _read_stream(http, received)
            assert "".join(received) == "data: eu-central 0 q\n\n"
            # The front is fine afterwards and answers the next request.
            r2 = await http.post("/v1/chat", content=b"q", headers=HEADERS)
            assert r2.status_code == 200
            assert r2.headers["x-gtm-region"] == "eu-central"
    assert len(up["eu-central"].requests) == 2
    assert not up["eu-west"].requests
    rows = await audit_rows(front.runtime)
    responses = sorted(row["response"] for row in rows for _ in range(row["count"]))
    assert len(responses) == 2
    assert any("aborted" in r and "mid-stream" in r for r in responses)


async def test_retry_budget_bounds_retries(start_front: FrontFactory) -> None:
    limits = ProxyLimits(connect_timeout_s=2, read_timeout_s=10, retry_ratio=0.0, retry_burst=1)
    async with regions(eu_west="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo, proxy_limits=limits) as front, client(front.url) as http:
            first = await http.post("/v1/chat", content=b"q", headers=HEADERS)
            second = await http.post("/v1/chat", content=b"q", headers=HEADERS)
    assert first.status_code == 200  # the one banked retry
    assert second.status_code == 502  # budget spent: no second retry
    assert second.json()["error"] == "no_region_could_be_reached"
    assert len(up["eu-west"].requests) == 1
    rows = await audit_rows(front.runtime)
    assert sum(row["count"] for row in rows) == 2
    assert any("retry budget exhausted" in row["response"] for row in rows)


async def test_body_over_the_limit_is_413(start_front: FrontFactory) -> None:
    limits = ProxyLimits(max_body_bytes=1000)
    async with regions(eu_central="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo, proxy_limits=limits) as front, client(front.url) as http:
            r = await http.post("/v1/chat", content=b"x" * 5000, headers=HEADERS)
            assert r.status_code == 413
    assert not up["eu-central"].requests
    assert await audited(front.runtime) == 1


async def test_client_going_away_mid_stream_closes_the_upstream(start_front: FrontFactory) -> None:
    async with regions(eu_central="slow") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            async with http.stream("POST", "/v1/chat", content=b"q", headers=HEADERS) as r:
                assert r.status_code == 200
                async for _ in r.aiter_raw():
                    break  # the client has seen enough and hangs up
            await asyncio.wait_for(up["eu-central"].cancelled.wait(), 5)
    rows = await audit_rows(front.runtime)
    assert [row["count"] for row in rows] == [1]
    assert "client disconnected" in rows[0]["response"]


async def test_stopping_lets_the_stream_in_flight_finish(start_front: FrontFactory) -> None:
    async with regions(eu_central="short") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            async with http.stream("POST", "/v1/chat", content=b"q", headers=HEADERS) as r:
                chunks = []
                async for chunk in r.aiter_raw():
                    if not chunks:
                        front.stop.set()  # shutdown begins with this stream in flight
                    chunks.append(chunk)
            assert b"".join(chunks) == b"token\n\n" * 10
            await asyncio.wait_for(front.task, 10)
            with pytest.raises(httpx.ConnectError):
                await http.get("/", headers=HEADERS)
    assert await audited(front.runtime) == 1


def test_headers_a_message_names_in_connection_are_not_passed_on() -> None:
    """Both ways through the proxy: the request's and the region's response's own Connection
    header names more hop-by-hop headers (RFC 9110 section 7.6.1), in any case and spacing."""
    headers = [
        (b"connection", b"close, X-Trace-Hop ,keep-alive"),
        (b"x-trace-hop", b"1"),
        (b"keep-alive", b"timeout=5"),
        (b"content-type", b"text/event-stream"),
    ]
    assert end_to_end(headers, frozenset({b"connection"})) == [
        (b"content-type", b"text/event-stream")
    ]
