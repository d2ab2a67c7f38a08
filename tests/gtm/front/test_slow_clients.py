"""Slow clients over real sockets (issue 17): request bodies that stall or trickle are cut (408
while the request is still being read, a close once it was answered), a body that keeps coming
at the minimum rate is not, and a slowloris from one address holding every slot it may does not
stop other clients from being answered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from gtm.front.connections import ConnectionLimits
from gtm.front.server import FrontServer, connection_limits_of
from gtm.runtime import Runtime
from tests.support.waiting import eventually

from .conftest import FrontFactory, audit_rows, audited
from .test_connections import (
    CHAT,
    PARTIAL_HEAD,
    WITHIN,
    Conn,
    connect,
    connections,
    normal_request,
)
from .test_proxy import CHAT_EU, FRANKFURT, proxy_topology, regions
from .test_tls import settings

# Short deadlines so the tests are quick; the assertions wait on events, never on these times.
SHORT = ConnectionLimits(max_connections=100, max_per_client=0, header_timeout_s=5)


def limits(**overrides: float) -> ConnectionLimits:
    values: dict[str, float] = {"body_timeout_s": 0.5, "body_min_rate": 1000.0, **overrides}
    return ConnectionLimits(
        max_connections=SHORT.max_connections,
        max_per_client=SHORT.max_per_client,
        header_timeout_s=SHORT.header_timeout_s,
        body_timeout_s=values["body_timeout_s"],
        body_min_rate=values["body_min_rate"],
    )


def post_head(host: str, length: int, path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-Forwarded-For: {FRANKFURT}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@contextlib.asynccontextmanager
async def trickling(conn: Conn, chunk: bytes, every_s: float) -> AsyncIterator[None]:
    """Send ``chunk`` every ``every_s`` on ``conn`` until the server closes it."""

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while not conn.closed.is_set() and not conn.writer.is_closing():
                conn.writer.write(chunk)
                await conn.writer.drain()
                await asyncio.sleep(every_s)

    task = asyncio.create_task(trickle())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def status_of(received: bytes) -> int:
    return int(received.split(b" ", 2)[1])


async def test_a_stalled_body_is_answered_408_with_its_decision(
    start_front: FrontFactory,
) -> None:
    """Proxy mode reads the body before forwarding it: a client that declares a length and
    stops gets 408, counted with the request's decision, and the region never sees it."""
    async with regions(eu_central="ok", eu_west="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo, connection_limits=limits()) as front:
            budget = front.server.budget
            conn = await connect(front, send=post_head(CHAT_EU, 100) + b'{"model": ')
            async with connections(conn):
                await eventually(conn.closed.is_set, within=WITHIN, what="the stalled body cut")
                assert conn.received.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
                assert b"connection: close" in conn.received
                assert b'"error":"request_body_timeout"' in conn.received
                assert budget.body_timeouts == 1
                # Meanwhile, and after, a whole request goes through.
                async with httpx.AsyncClient(base_url=front.url, trust_env=False) as http:
                    r = await http.post(
                        "/v1/chat/completions",
                        content=b'{"model": "m"}',
                        headers={"host": CHAT_EU, "x-forwarded-for": FRANKFURT},
                    )
                assert r.status_code == 200
            await eventually(lambda: budget.open == 0, within=WITHIN, what="slots released")
        assert [len(region.requests) for region in up.values()] in ([1, 0], [0, 1])
    assert front.app.stats.responses.get(408) == 1
    rows = await audit_rows(front.runtime)
    assert sorted(row["response"].split(" ")[0] for row in rows) == ["200", "408"]
    (timed_out,) = [row for row in rows if row["response"].startswith("408")]
    assert timed_out["response"] == "408 request body timeout"
    assert timed_out["region"] == "eu-central"  # the decision stands behind the 408
    assert await audited(front.runtime) == 2


async def test_a_trickled_body_is_cut_below_the_minimum_rate(start_front: FrontFactory) -> None:
    """A byte at a time, far below the minimum rate: cut once the grace is spent, although
    bytes keep coming (each would reset a plain idle timer)."""
    async with regions(eu_central="ok", eu_west="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo, connection_limits=limits()) as front:
            budget = front.server.budget
            conn = await connect(front, send=post_head(CHAT_EU, 10_000))
            async with connections(conn), trickling(conn, b"x", 0.02):
                await eventually(conn.closed.is_set, within=WITHIN, what="the trickle cut")
            assert budget.body_timeouts == 1
            if conn.received:  # else the close reset the connection before the answer was read
                assert status_of(conn.received) == 408
            await eventually(lambda: budget.open == 0, within=WITHIN, what="slots released")
        assert not any(region.requests for region in up.values())
    assert front.app.stats.responses.get(408) == 1
    assert await audited(front.runtime) == 1


async def test_a_body_at_the_minimum_rate_is_not_cut(start_front: FrontFactory) -> None:
    """Slow but steady: 30 bytes every 0.1 s against a minimum of 10 bytes/s, for longer than
    the grace. The body completes and is forwarded."""
    async with regions(eu_central="ok", eu_west="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        steady = limits(body_timeout_s=2.0, body_min_rate=10.0)
        async with start_front(topo, connection_limits=steady) as front:
            chunks = [b"%030d" % i for i in range(40)]  # 1,200 bytes over about 4 s
            conn = await connect(front, send=post_head(CHAT_EU, 30 * len(chunks)))
            async with connections(conn):
                for chunk in chunks:
                    conn.writer.write(chunk)
                    await conn.writer.drain()
                    await asyncio.sleep(0.1)
                await eventually(
                    lambda: conn.received.endswith(b"0\r\n\r\n"), within=WITHIN, what="answer"
                )
            assert status_of(conn.received) == 200
            assert front.server.budget.body_timeouts == 0
        (request,) = [r for region in up.values() for r in region.requests]
        assert request[2] == b"".join(chunks)


async def test_a_redirect_answered_before_its_body_is_closed_when_the_body_trickles(
    start_front: FrontFactory,
) -> None:
    """A redirect is answered as soon as its head is read; a body that then trickles on kept
    the connection open for ever (every byte cancelled the keep-alive timer)."""
    async with start_front(connection_limits=limits(), keep_alive_s=60) as front:
        budget = front.server.budget
        conn = await connect(front, send=post_head(CHAT, 10_000))
        async with connections(conn):
            await eventually(lambda: b"\r\n\r\n" in conn.received, what="the redirect")
            assert status_of(conn.received) == 307
            async with trickling(conn, b"x", 0.02):
                await eventually(conn.closed.is_set, within=WITHIN, what="the trickle cut")
        assert budget.body_timeouts == 1
        await eventually(lambda: budget.open == 0, within=WITHIN, what="slots released")
    assert await audited(front.runtime) == 1  # the 307; closing is no response


async def test_a_stalled_capacity_report_is_answered_408(start_front: FrontFactory) -> None:
    async with start_front(connection_limits=limits()) as front:
        head = (
            b"POST /v1/capacity HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
        )
        conn = await connect(front, send=head)
        async with connections(conn):
            await eventually(conn.closed.is_set, within=WITHIN, what="the stalled report cut")
        assert conn.received.startswith(b"HTTP/1.1 408 ")
        assert front.server.budget.body_timeouts == 1


async def test_a_slowloris_at_its_per_client_limit_leaves_others_served(
    start_front: FrontFactory,
) -> None:
    """One address holds every connection it may, half with heads that never end and half with
    bodies that never end (deadlines far away here); its next connections are refused, and
    another client's requests are answered throughout."""
    cap = ConnectionLimits(
        max_connections=100, max_per_client=40, header_timeout_s=600, body_timeout_s=600
    )
    async with start_front(connection_limits=cap, trusted=()) as front:
        budget = front.server.budget
        slow = [await connect(front, "127.0.0.2", PARTIAL_HEAD) for _ in range(20)]
        slow += [await connect(front, "127.0.0.2", post_head(CHAT, 10_000)) for _ in range(20)]
        async with connections(*slow):
            await eventually(lambda: budget.held_by("127.0.0.2") == 40, what="40 slots held")
            more = [await connect(front, "127.0.0.2", PARTIAL_HEAD) for _ in range(10)]
            async with connections(*more):
                await eventually(
                    lambda: all(c.closed.is_set() for c in more), within=WITHIN, what="refused"
                )
            assert budget.refused["per_client"] == 10
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.3")
            async with httpx.AsyncClient(
                base_url=front.url, transport=transport, trust_env=False
            ) as http:
                for _ in range(50):  # kept alive, and on new connections
                    r = await http.get("/v1/models", headers={"host": CHAT})
                    assert r.status_code == 307
            for _ in range(5):
                assert (await normal_request(front, "127.0.0.4")).status_code == 307
            assert not any(c.closed.is_set() for c in slow)  # the limit, not a timeout
        await eventually(lambda: budget.open == 0, within=WITHIN, what="slots released")


def test_the_deadlines_and_keep_alive_come_from_the_settings(tmp_path: Path) -> None:
    configured = settings(
        tmp_path, http_body_timeout_s=7.5, http_body_min_rate=0, http_keep_alive_s=1.5
    )
    got = connection_limits_of(configured)
    assert (got.body_timeout_s, got.body_min_rate) == (7.5, 0)
    assert FrontServer(Runtime(configured), "127.0.0.1:0").keep_alive_s == 1.5
    # 0 bytes/s: the body must be whole within the timeout, whatever came.
    assert got.body_deadline(100.0, 107.0, 1_000_000) == 107.5
    assert limits().body_deadline(100.0, 100.1, 2_000) == 100.6  # stalled since 100.1
    assert limits().body_deadline(100.0, 101.4, 1_000) == 101.5  # 1 s of credit for 1,000 B


async def test_idle_kept_alive_connections_are_closed(start_front: FrontFactory) -> None:
    async with start_front(connection_limits=limits(), keep_alive_s=0.3) as front:
        whole = f"GET /v1/models HTTP/1.1\r\nHost: {CHAT}\r\n\r\n".encode()
        conn = await connect(front, send=whole)
        async with connections(conn):
            await eventually(conn.closed.is_set, within=WITHIN, what="the idle connection closed")
        assert status_of(conn.received) == 307
