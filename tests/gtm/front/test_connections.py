"""The front's connection bounds over real sockets (issue 17: fifty slow-header connections stayed
open indefinitely): request heads have a deadline, and connections a cap in total and per
client; a normal request is answered once slots are free."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

from gtm.front.connections import ConnectionLimits
from tests.support.waiting import eventually

from .conftest import Front, FrontFactory, audited

CHAT = "chat.gtm.example"
PARTIAL_HEAD = f"GET /v1/models HTTP/1.1\r\nHost: {CHAT}\r\nX-Slow: ".encode()
# Generous: these bound how long a broken front makes the test wait, not how fast a good one is.
WITHIN = 30.0


class Conn:
    """A raw client connection; ``received`` fills until the server closes it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.received = b""
        self.closed = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while chunk := await self.reader.read(65536):
                self.received += chunk
        except ConnectionError:
            pass  # a reset is a close too
        finally:
            self.closed.set()

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def connect(front: Front, source: str = "127.0.0.1", send: bytes = b"") -> Conn:
    url = urlsplit(front.url)
    assert url.hostname is not None and url.port is not None
    reader, writer = await asyncio.open_connection(url.hostname, url.port, local_addr=(source, 0))
    if send:
        writer.write(send)
        await writer.drain()
    return Conn(reader, writer)


@contextlib.asynccontextmanager
async def connections(*conns: Conn) -> AsyncIterator[list[Conn]]:
    held = list(conns)
    try:
        yield held
    finally:
        for conn in held:
            await conn.aclose()


async def normal_request(front: Front, source: str = "127.0.0.1") -> httpx.Response:
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(base_url=front.url, transport=transport, trust_env=False) as http:
        return await http.get("/v1/models", headers={"host": CHAT})


async def test_slow_heads_are_cut_with_408_and_counted(start_front: FrontFactory) -> None:
    limits = ConnectionLimits(max_connections=100, max_per_client=0, header_timeout_s=0.5)
    async with start_front(connection_limits=limits) as front:
        budget = front.server.budget
        slow = [await connect(front, send=PARTIAL_HEAD) for _ in range(50)]
        silent = await connect(front)  # connects and never says a word
        async with connections(*slow, silent):
            # Meanwhile a normal client is answered as usual.
            assert (await normal_request(front)).status_code == 307
            await eventually(
                lambda: all(c.closed.is_set() for c in [*slow, silent]),
                within=WITHIN,
                what="slow-header connections closed by the server",
            )
            for conn in slow:
                assert conn.received.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
                assert b"connection: close" in conn.received
            assert silent.received == b""
        await eventually(lambda: budget.open == 0, within=WITHIN, what="every slot released")
        assert budget.head_timeouts == 51
        assert front.app.stats.responses.get(408) == 50
    # Every 408 is a response, and counted in the audit like any other (DESIGN.md rule 2).
    assert await audited(front.runtime) == 51


async def test_a_kept_alive_connection_has_the_deadline_for_its_next_head(
    start_front: FrontFactory,
) -> None:
    limits = ConnectionLimits(max_connections=100, max_per_client=0, header_timeout_s=0.5)
    async with start_front(connection_limits=limits, keep_alive_s=60) as front:
        whole = f"GET /v1/models HTTP/1.1\r\nHost: {CHAT}\r\n\r\n".encode()
        conn = await connect(front, send=whole)
        async with connections(conn):
            await eventually(lambda: b"\r\n\r\n" in conn.received, what="the first answer")
            assert conn.received.startswith(b"HTTP/1.1 307 ")
            first = len(conn.received)
            # Idle between requests is the keep-alive timer's business (60 s here); a head
            # begun and not finished is this deadline's.
            conn.writer.write(PARTIAL_HEAD)
            await eventually(conn.closed.is_set, within=WITHIN, what="the slow second head cut")
            assert conn.received[first:].startswith(b"HTTP/1.1 408 ")


async def test_connections_past_the_cap_are_closed_until_slots_free(
    start_front: FrontFactory,
) -> None:
    limits = ConnectionLimits(max_connections=5, max_per_client=0, header_timeout_s=600)
    async with start_front(connection_limits=limits) as front:
        budget = front.server.budget
        held = [await connect(front, send=PARTIAL_HEAD) for _ in range(5)]
        async with connections(*held):
            await eventually(lambda: budget.open == 5, what="five slots taken")
            extra = await connect(front)
            async with connections(extra):
                await eventually(extra.closed.is_set, within=WITHIN, what="6th connection closed")
                assert extra.received == b""
            try:
                refused = await normal_request(front)
            except httpx.TransportError:
                pass  # closed before an answer: what a full front does
            else:
                raise AssertionError(f"answered {refused.status_code} past the cap")
            assert budget.refused["cap"] >= 2
            # One slot frees: a normal request is answered again.
            await held.pop().aclose()
            await eventually(lambda: budget.open == 4, what="a slot released")
            assert (await normal_request(front)).status_code == 307
            assert all(not c.closed.is_set() for c in held)


async def test_one_client_cannot_take_every_slot(start_front: FrontFactory) -> None:
    limits = ConnectionLimits(max_connections=100, max_per_client=3, header_timeout_s=600)
    # Loopback is no trusted proxy here, except 127.0.0.9: all its clients share its address.
    async with start_front(connection_limits=limits, trusted=("127.0.0.9/32",)) as front:
        budget = front.server.budget
        greedy = [await connect(front, "127.0.0.2", PARTIAL_HEAD) for _ in range(3)]
        async with connections(*greedy):
            await eventually(lambda: budget.held_by("127.0.0.2") == 3, what="three slots held")
            fourth = await connect(front, "127.0.0.2")
            async with connections(fourth):
                await eventually(fourth.closed.is_set, within=WITHIN, what="4th connection closed")
            assert budget.refused["per_client"] == 1
            # Another client is answered meanwhile, and so is the trusted proxy past three.
            assert (await normal_request(front, "127.0.0.3")).status_code == 307
            proxied = [await connect(front, "127.0.0.9", PARTIAL_HEAD) for _ in range(4)]
            async with connections(*proxied):
                await eventually(lambda: budget.held_by("127.0.0.9") == 4, what="proxy slots")
                assert not any(c.closed.is_set() for c in proxied)
        await eventually(lambda: budget.open == 0, what="every slot released")
