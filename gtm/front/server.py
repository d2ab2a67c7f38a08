"""Serving the front: uvicorn (httptools parser, the caller's event loop) around :class:`FrontApp`.

``serve_front`` runs inside the caller's loop (``gtm serve`` puts it beside the DNS responder),
binds the socket itself so that a busy port is an exception for the caller rather than
uvicorn's ``sys.exit``, leaves signal handling to the caller, and returns once ``stop`` is set
and the requests in flight have been answered.

A redirect that the front's answer cache holds is answered here, in the protocol, as soon as
the request head is parsed: :meth:`gtm.front.answers.AnswerCache.respond` renders and counts
it, and the protocol writes it, with no ASGI request cycle (a task, a scope, two messages), which
costs more than the whole decision. Everything else (cache misses that are not redirects, refusals,
bad input, proxy mode, the front's own endpoints, a request pipelined behind one still being
answered) goes through uvicorn's request cycle to the ASGI app, as before.

Request heads are bounded here, at the protocol, before anything reaches the application:
uvicorn's httptools protocol has no limit of its own on header size, so a client could make it
buffer a head without end. Heads over the limits get 431 (414 for the target) and the connection
is closed; uvicorn's own 400 for unparseable requests stays, and both are counted in the audit
like every other response.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass
from typing import cast

import httptools
import structlog
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gtm.errors import ConfigError, Problem
from gtm.front.app import FrontApp
from gtm.front.client_address import parse_peer
from gtm.front.proxy import Forwarder, ProxyLimits
from gtm.listen import EmbeddedServer
from gtm.listen import parse_listen as listen_address
from gtm.runtime import Runtime

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class HeadLimits:
    max_head_bytes: int = 32 * 1024  # request line and every header together
    max_target_bytes: int = 8 * 1024
    max_headers: int = 100


def parse_listen(listen: str) -> tuple[str, int]:
    """The listen address, or :class:`ConfigError` naming the setting."""
    try:
        return listen_address(listen)
    except ValueError as exc:
        raise ConfigError([Problem("GTM_HTTP_LISTEN", "", str(exc))]) from None


class _HeadTooLarge(httptools.HttpParserError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Event:
    def set(self) -> None:
        pass


class _Answered:
    """The request cycle of a request the protocol answered itself: complete from the start.
    uvicorn's own callbacks read these attributes of the current cycle (a body arriving for
    it is dropped, as for any request answered before its body)."""

    response_complete = True
    more_body = False
    disconnected = False
    keep_alive = True
    message_event = _Event()


_ANSWERED = cast(RequestResponseCycle, _Answered())


def protocol_for(app: FrontApp, limits: HeadLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with bounded request heads, counted protocol errors, and
    cached redirects answered without an ASGI request cycle."""

    class FrontProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _header_bytes = 0
        _too_large: _HeadTooLarge | None = None
        _discarded = -1  # >= 0 once the answer is sent and the rest of the input is dropped
        _in_head = False  # a request head is being parsed
        _in_body = False  # a request's head is parsed and its body is not complete

        def _discard(self, n: int) -> None:
            self._discarded += n
            if self._discarded > _LINGER_BYTES:
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._discarded >= 0:
                self._discard(len(data))
                return
            # Bytes that arrive while a head is pending (or between requests) count towards it.
            if not self._in_body:
                self._head_bytes += len(data)
            super().data_received(data)
            if not self._in_head:
                # No head in progress: the last one completed (its request is being answered
                # or its body read), so nothing is buffered towards a head.
                self._head_bytes = 0
            elif (
                self._head_bytes > limits.max_head_bytes
                and self._too_large is None
                and not self.transport.is_closing()
            ):
                # Still inside a head that has outgrown the limit (one huge header without an
                # end, say): the parser would buffer it all, so the connection ends here.
                self._too_large = _HeadTooLarge(431, "request head too large")
                self.send_400_response(self._too_large.message)

        def on_header(self, name: bytes, value: bytes) -> None:
            n = len(self.headers)  # uvicorn's list of this request's headers so far
            size = (self._header_bytes if n else 0) + len(name) + len(value) + 4
            self._header_bytes = size
            if len(self.url) > limits.max_target_bytes:
                self._too_large = _HeadTooLarge(414, "request target too long")
                raise self._too_large
            if n >= limits.max_headers:
                self._too_large = _HeadTooLarge(431, "too many request headers")
                raise self._too_large
            if size + len(self.url) > limits.max_head_bytes:
                self._too_large = _HeadTooLarge(431, "request head too large")
                raise self._too_large
            super().on_header(name, value)

        def on_message_begin(self) -> None:
            self._in_head = True
            self._in_body = False
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._in_body = False
            if (
                self.cycle is _ANSWERED
                and self.timeout_keep_alive_task is None
                and not self.transport.is_closing()
            ):
                # Answered before its body arrived: the body's bytes cancelled the keep-alive
                # timer that the answer armed, and nothing else would arm it again.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._in_body = True
            cycle = self.cycle
            parser = self.parser
            if (
                (cycle is None or cycle.response_complete)
                and not self.pipeline  # requests ahead of this one are answered first
                and not self.flow.write_paused  # the request cycle waits for the client
                and self.limit_concurrency is None
                and not parser.should_upgrade()
            ):
                keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
                client = self.client
                try:
                    response = app.answers.respond(
                        parser.get_method(),
                        self.url,
                        self.headers,
                        client[0] if client else None,
                        self.server_state.default_headers,
                        keep_alive,
                    )
                except Exception:  # nothing was counted: the request cycle answers instead
                    log.exception("front.fast_path_failed")
                    response = None
                if response is not None:
                    self.cycle = _ANSWERED
                    self.transport.write(response)
                    if not keep_alive:
                        self.transport.close()
                    self.on_response_complete()  # the next pipelined request, keep-alive timer
                    return
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            status, message = 400, "invalid HTTP request"
            if self._too_large is not None:
                status, message = self._too_large.status, self._too_large.message
            code = message.replace(" ", "_").encode()
            body = b'{"error":"' + code + b'","message":"' + message.encode() + b'"}'
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Bad Request')}\r\n"
                "content-type: application/json\r\ncache-control: no-store\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            idle = self.cycle is None or self.cycle.response_complete
            if self._too_large is not None and idle and self.transport.can_write_eof():
                # Lingering close: the client may still be sending the head it was refused
                # for; closing now would reset the connection and could destroy the answer in
                # its receive buffer. Half-close, drop what still comes (bounded), close later.
                self.transport.write_eof()
                self._discarded = 0
                self.loop.call_later(_LINGER_S, self.transport.close)
            else:
                self.transport.close()
            peer = parse_peer(self.client[0]) if self.client else parse_peer("0.0.0.0")
            method = ""
            with contextlib.suppress(Exception):
                method = self.parser.get_method().decode("ascii", "replace")
            app.ledger.count_rejected(app.store.current, peer, None, method, status)

    return FrontProtocol


_LINGER_S = 2.0
_LINGER_BYTES = 1024 * 1024
_REASONS = {400: "Bad Request", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


class FrontServer:
    """One listening front. ``bind()`` early to learn the port (tests listen on port 0)."""

    def __init__(
        self,
        runtime: Runtime,
        listen: str,
        *,
        head_limits: HeadLimits = HeadLimits(),
        proxy_limits: ProxyLimits = ProxyLimits(),
        reuse_port: bool = False,
        graceful_timeout_s: float = 30.0,
        keep_alive_s: int = 5,
    ) -> None:
        self.runtime = runtime
        self.host, self.port = parse_listen(listen)
        self.head_limits = head_limits
        self.proxy_limits = proxy_limits
        self.reuse_port = reuse_port
        self.graceful_timeout_s = graceful_timeout_s
        self.keep_alive_s = keep_alive_s
        self.sock: socket.socket | None = None
        self.app: FrontApp | None = None

    def bind(self) -> socket.socket:
        if self.sock is not None:
            return self.sock
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.reuse_port:
                # Several worker processes on one port; the kernel spreads connections.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ConfigError(
                [Problem("GTM_HTTP_LISTEN", "", f"cannot listen on {self.host}:{self.port}: {exc}")]
            ) from exc
        self.port = sock.getsockname()[1]
        self.sock = sock
        return sock

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        sock = self.bind()
        forwarder = Forwarder(self.proxy_limits)
        app = self.app = FrontApp(self.runtime, forwarder)

        def started() -> None:
            app.ops.ready = True
            log.info("front.listening", url=self.url)
            if ready is not None:
                ready.set()

        config = uvicorn.Config(
            app,
            loop="none",  # the caller's loop (uvloop under `gtm serve`)
            http=protocol_for(app, self.head_limits),
            ws="none",
            lifespan="off",
            proxy_headers=False,  # forwarding headers are judged by the front, not uvicorn
            server_header=False,
            date_header=True,
            access_log=False,
            log_config=None,
            timeout_keep_alive=self.keep_alive_s,
            timeout_graceful_shutdown=max(1, round(self.graceful_timeout_s)),
        )
        server = EmbeddedServer(config, started)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            app.ops.draining = True
            server.should_exit = True
            await serving
        finally:
            stopping.cancel()
            if not serving.done():  # cancelled from outside: stop at once
                server.should_exit = server.force_exit = True
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
            # Every response served is counted in the app's tallies, which the audit writer
            # drains at its next flush (the runtime's stop flushes).
            app.close()
            await forwarder.aclose()
            sock.close()
            self.sock = None
            app.ops.ready = False


async def serve_front(
    runtime: Runtime,
    listen: str,
    stop: asyncio.Event,
    *,
    ready: asyncio.Event | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve the HTTP front on ``listen`` (``HOST:PORT``) until ``stop`` is set.

    Sets ``ready`` once listening; returns after the requests in flight have been answered (and
    counted: the caller's ``runtime.stop()`` then flushes them to the audit store).
    """
    await FrontServer(runtime, listen, reuse_port=reuse_port).run(stop, ready)


__all__ = ["FrontServer", "HeadLimits", "parse_listen", "serve_front"]
