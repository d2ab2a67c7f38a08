"""A lean HTTP/1.1 client for the proxy's hot path: one request to one instance.

Why not httpx here: a profile of the balancer put httpx, httpcore, h11 and anyio at about 1 ms
of CPU per proxied request (request and URL models, the transport stack, anyio's cancel
scopes around every socket operation), several times the budget for the whole hop. The
upstream side of a proxy needs very little of that: POST a body it already holds, read a
status line and headers, then pass the body through as it arrives. This client does exactly
that on an :class:`asyncio.Protocol` with the ``httptools`` parser (the one uvicorn uses), and
keeps idle keep-alive connections per instance. The balancer's background calls (probes,
scrapes, report pushes) still use httpx: they are off the hot path.

Every wait has a timer (connect, response head, each body read), and closing a response that
was not read to the end aborts its connection: on an inference server that is what cancels
the request (rule 5 counts on it).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

# A reader that falls this far behind (a slow client of a fast stream) pauses the socket, so
# a stream is never buffered whole in the balancer.
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024


class HopError(Exception):
    """The instance could not be reached or failed while answering."""


class ConnectFailed(HopError):
    """No connection could be made; nothing reached the instance, so another may be tried."""


class HopTimeout(HopError):
    """A phase ran out of time; ``phase`` is ``connect``, ``first_byte`` or ``read``."""

    def __init__(self, phase: str, message: str) -> None:
        self.phase = phase
        super().__init__(message)


class ConnectTimeout(ConnectFailed, HopTimeout):
    def __init__(self, message: str) -> None:
        HopTimeout.__init__(self, "connect", message)


class HopBroken(HopError):
    """The connection closed, or the instance spoke broken HTTP, before the answer ended."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an instance URL points: parsed once per URL, not once per request."""

    host: str
    port: int
    tls: bool
    prefix: str  # a path the instance is mounted under, without a trailing slash
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if tls else 80)
        return cls(host, port, tls, parts.path.rstrip("/"), (parts.netloc or host).encode())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; holds the state of the response being read on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.keep_alive = False
        self.complete = False
        self.received_any = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.error: HopError | None = None
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Small writes (a request, then the proxy's reads) must not wait for delayed ACKs.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HopBroken(f"the instance sent invalid HTTP: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(HopBroken("the instance closed the connection before the answer ended"))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # Asked here: once the message is complete the parser has reset and says False.
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- waiting -----------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: HopError) -> None:
        if self.error is None:
            self.error = error
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(error)

    async def wait(self, limit_s: float, phase: str) -> None:
        """Until the parser reports progress, the connection fails, or ``limit_s`` passes.
        A timer handle rather than ``asyncio.timeout``: no context manager per read."""
        if self.error is not None:
            raise self.error
        w = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(limit_s, _expire, w, phase, limit_s)
        try:
            await w
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered < _LOW_WATER and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def reusable(self) -> bool:
        return (
            self.complete
            and not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
            and self.keep_alive
        )


def _expire(w: asyncio.Future[None], phase: str, timeout: float) -> None:
    if not w.done():
        w.set_exception(HopTimeout(phase, f"no {phase.replace('_', ' ')} within {timeout:g} s"))


class HopResponse:
    """An answer whose head has arrived; the body is read with :meth:`read` or
    :meth:`chunks`, and :meth:`close` must be called (it is idempotent)."""

    def __init__(self, client: H1Client, origin: Origin, conn: _Connection) -> None:
        self._client, self._origin, self._conn = client, origin, conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def chunks(self, read_timeout: float) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunked encoding already removed); a gap longer than
        ``read_timeout`` raises :class:`HopTimeout` with phase ``read``."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            else:
                await conn.wait(read_timeout, "read")

    async def next_chunk(self, read_timeout: float) -> bytes | None:
        """The next body bytes, or None at the end; :class:`HopTimeout` after
        ``read_timeout`` without any (each call has its own budget)."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.complete:
                return None
            await conn.wait(read_timeout, "read")

    async def read(self, read_timeout: float) -> bytes:
        parts = [chunk async for chunk in self.chunks(read_timeout)]
        return b"".join(parts)

    def close(self) -> None:
        """Give the connection back when the answer was read to its end; otherwise abort it,
        which tells the instance to stop working on the request."""
        if self._released:
            return
        self._released = True
        self._client._release(self._origin, self._conn)


class H1Client:
    """Keep-alive connections per instance, and :meth:`post`."""

    def __init__(self, connect_timeout: float, keepalive_s: float = 4.0) -> None:
        self.connect_timeout = connect_timeout
        # Below uvicorn's and most servers' 5 s idle timeout, so the client drops an idle
        # connection before the server can close it under a request being sent.
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._ssl: ssl.SSLContext | None = None

    def origin(self, url: str) -> Origin:
        o = self._origins.get(url)
        if o is None:
            o = self._origins[url] = Origin.parse(url)
        return o

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        ctx = None
        if origin.tls:
            ctx = self._ssl = self._ssl or ssl.create_default_context()
        conn = _Connection(loop)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=ctx,
                    server_hostname=origin.host if ctx else None,
                )
        except TimeoutError:
            conn.abort()
            raise ConnectTimeout(f"no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect: {exc.strerror or exc}") from None
        return conn

    def _reuse(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # most recently used first: its peer is least likely to drop it
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                conn._reset()
                return conn
            conn.abort()
        return None

    def _release(self, origin: Origin, conn: _Connection) -> None:
        if conn.reusable():
            conn.idle_since = time.monotonic()
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.abort()

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        first_byte_timeout: float,
    ) -> HopResponse:
        """Send the request and wait for the response head. The caller must ``close()`` the
        response, or cancel this call (which aborts the connection)."""
        origin = self.origin(url)
        conn = self._reuse(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, path, body, headers, first_byte_timeout)
            except HopBroken:
                if conn.received_any:
                    raise
                # The instance closed an idle connection as the request went out (its
                # keep-alive timer raced ours): it never read the request. Once, afresh.
        conn = await self._connect(origin)
        return await self._exchange(origin, conn, path, body, headers, first_byte_timeout)

    async def _exchange(
        self,
        origin: Origin,
        conn: _Connection,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        first_byte_timeout: float,
    ) -> HopResponse:
        head = [
            b"POST ",
            origin.prefix.encode(),
            path.encode(),
            b" HTTP/1.1\r\nhost: ",
            origin.host_header,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        assert conn.transport is not None
        try:
            conn.transport.write(b"".join(head) + body)
            while not conn.head_done:
                await conn.wait(first_byte_timeout, "first_byte")
        except BaseException:
            conn.abort()
            raise
        return HopResponse(self, origin, conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
