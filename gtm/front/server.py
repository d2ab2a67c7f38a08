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

Connections are bounded here too (:mod:`gtm.front.connections`): a cap in total and per client,
taken when the connection is accepted, a deadline for each request head (408 when a head is
still incomplete at it) and one for each request body (a stall or a trickle below the minimum
rate: the application answers 408, or the connection is closed when the request was answered
already). uvicorn bounds none of these. With TLS (:mod:`gtm.front.tls`) a connection
takes its slot before the handshake, which has the same deadline: the front runs the handshake
itself (``loop.start_tls``) rather than through uvicorn's ``ssl`` option, under which a
connection is invisible to the protocol until its handshake is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from asyncio import sslproto
from dataclasses import dataclass
from typing import Any, cast

import httptools
import structlog
import uvicorn
import uvloop
import uvloop.loop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gtm.errors import ConfigError, Problem
from gtm.front.app import FrontApp
from gtm.front.client_address import TrustedProxies, parse_peer
from gtm.front.connections import BODY_TIMED_OUT, ConnectionBudget, ConnectionLimits, peer_host
from gtm.front.proxy import Forwarder, ProxyLimits
from gtm.front.tls import TlsContexts, TlsFiles
from gtm.listen import EmbeddedServer
from gtm.listen import parse_listen as listen_address
from gtm.runtime import Runtime
from gtm.settings import Settings

log = structlog.get_logger(__name__)

# uvloop's TLS layer (not in its type stubs), used when the front runs on uvloop, as `gtm serve`
# does.
_UvSSLProtocol: Any = getattr(uvloop.loop, "SSLProtocol", None)


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


class _HeadRefused(httptools.HttpParserError):
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

    response_started = True
    response_complete = True
    more_body = False
    disconnected = False
    keep_alive = True
    message_event = _Event()


_ANSWERED = cast(RequestResponseCycle, _Answered())


class SlotProtocol(HttpToolsProtocol):
    """uvicorn's protocol holding a slot of the connection budget while its connection lasts."""

    _admitted = False  # holds a slot of the budget, released when the connection ends
    _gated = False  # the TLS gate took the slot; this protocol takes it over when made
    _took_over = False  # it did (set once: the gate's callback may run after the release)
    _peer: str | None = None

    def gated(self, peer: str | None) -> None:
        self._gated, self._peer = True, peer

    def took_over(self) -> bool:
        return self._took_over


def protocol_for(
    app: FrontApp,
    limits: HeadLimits,
    budget: ConnectionBudget | None = None,
) -> type[SlotProtocol]:
    """uvicorn's httptools protocol with bounded request heads, counted protocol errors, and
    cached redirects answered without an ASGI request cycle; with a ``budget``, connections
    over its caps are closed at once and request heads and bodies have its deadlines."""
    header_timeout_s = budget.limits.header_timeout_s if budget is not None else None
    body_limits = budget.limits if budget is not None else None

    class FrontProtocol(SlotProtocol):
        _head_bytes = 0
        _header_bytes = 0
        _refused_head: _HeadRefused | None = None
        _discarded = -1  # >= 0 once the answer is sent and the rest of the input is dropped
        _in_head = False  # a request head is being parsed
        _in_body = False  # a request's head is parsed and its body is not complete
        _made = False  # uvicorn's connection_made ran (its connection_lost needs it)
        _head_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None
        _body_start = 0.0  # when the body's clock started (the head complete, or reading resumed)
        _body_last = 0.0  # when the last of it came
        _body_bytes = 0  # received since its clock started
        _body_cut = False  # the application was told the body is past its deadline

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if self._gated:
                # The handshake is done: the slot is this protocol's to release.
                self._admitted = self._took_over = True
            elif budget is not None:
                # Plain TCP: the slot is taken here, before a byte is read.
                peer = peer_host(transport.get_extra_info("peername"))
                if budget.admit(peer) is not None:
                    transport.close()
                    return
                self._admitted, self._peer = True, peer
            self._made = True
            super().connection_made(cast(asyncio.Transport, transport))
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._cancel_body_timer()
            if self._admitted:
                self._admitted = False
                assert budget is not None
                budget.release(self._peer)
            if self._made:
                super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if header_timeout_s is not None and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            assert budget is not None
            budget.head_timeouts += 1
            if self._in_head:
                # Part of a head came and the rest did not (slowloris): say so, and close.
                self._refused_head = _HeadRefused(408, "request head timeout")
                self.send_400_response(self._refused_head.message)
            else:
                # Nothing of a request came: there is no one to answer.
                self.transport.close()

        def _start_body_clock(self) -> None:
            assert body_limits is not None
            now = self.loop.time()
            self._body_start = self._body_last = now
            self._body_bytes = 0
            self._body_timer = self.loop.call_later(body_limits.body_timeout_s, self._body_due)

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_due(self) -> None:
            self._body_timer = None
            assert body_limits is not None
            assert budget is not None
            if self.transport.is_closing() or not self._in_body:
                return
            if self.flow.read_paused and not self._body_cut:
                # The front is not reading (the application has not taken what came, or a
                # pipelined request waits its turn): the client is not the slow one. Its clock
                # starts again when reading does.
                self._start_body_clock()
                return
            now = self.loop.time()
            due = body_limits.body_deadline(self._body_start, self._body_last, self._body_bytes)
            if now < due and not self._body_cut:
                self._body_timer = self.loop.call_later(due - now, self._body_due)
                return
            cycle = self.cycle
            if self._body_cut or cycle is None or cycle.response_started:
                # Answered already (a redirect does not wait for its body), or the application
                # was told and did not answer within another grace: nothing more to say here.
                if not self._body_cut:
                    budget.body_timeouts += 1
                self.transport.close()
                return
            # The application is reading the body: it answers 408 and counts that response
            # with its decision (rule 2); the connection closes after it. Should it not answer
            # within another grace, the connection is closed all the same.
            budget.body_timeouts += 1
            self._body_cut = True
            cycle.scope["state"][BODY_TIMED_OUT] = True
            cycle.message_event.set()
            self._body_timer = self.loop.call_later(body_limits.body_timeout_s, self._body_due)

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            if self._body_timer is not None:
                self._body_last = self.loop.time()
            super().on_body(body)

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
                and self._refused_head is None
                and not self.transport.is_closing()
            ):
                # Still inside a head that has outgrown the limit (one huge header without an
                # end, say): the parser would buffer it all, so the connection ends here.
                self._refused_head = _HeadRefused(431, "request head too large")
                self.send_400_response(self._refused_head.message)
            if (
                self._in_body
                and self._body_timer is None
                and body_limits is not None
                and not self.transport.is_closing()
            ):
                # A head is complete and its body is not (a request without a body completes
                # in the same call, and costs no timer).
                self._start_body_clock()

        def on_header(self, name: bytes, value: bytes) -> None:
            n = len(self.headers)  # uvicorn's list of this request's headers so far
            size = (self._header_bytes if n else 0) + len(name) + len(value) + 4
            self._header_bytes = size
            if len(self.url) > limits.max_target_bytes:
                self._refused_head = _HeadRefused(414, "request target too long")
                raise self._refused_head
            if n >= limits.max_headers:
                self._refused_head = _HeadRefused(431, "too many request headers")
                raise self._refused_head
            if size + len(self.url) > limits.max_head_bytes:
                self._refused_head = _HeadRefused(431, "request head too large")
                raise self._refused_head
            super().on_header(name, value)

        def on_message_begin(self) -> None:
            self._in_head = True
            self._in_body = False
            self._body_cut = False
            # A kept-alive connection's next head has the deadline from its first byte.
            self._arm_head_timer()
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._in_body = False
            if self._body_timer is not None:
                self._cancel_body_timer()
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
            self._cancel_head_timer()
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
                except Exception as exc:  # nothing was counted: the request cycle answers
                    app.runtime.failures.record("front.fast_path", exc)
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
            # This answer ends the connection: no deadline may answer again after it (the
            # lingering close below keeps the transport open a while).
            self._cancel_head_timer()
            status, message = 400, "invalid HTTP request"
            if self._refused_head is not None:
                status, message = self._refused_head.status, self._refused_head.message
            code = message.replace(" ", "_").encode()
            body = b'{"error":"' + code + b'","message":"' + message.encode() + b'"}'
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Bad Request')}\r\n"
                "content-type: application/json\r\ncache-control: no-store\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            idle = self.cycle is None or self.cycle.response_complete
            if self._refused_head is not None and idle and self.transport.can_write_eof():
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


def tls_gate_for(
    http: type[SlotProtocol],
    budget: ConnectionBudget,
    contexts: TlsContexts,
    handshakes: set[asyncio.Transport],
) -> type[asyncio.Protocol]:
    """The protocol uvicorn makes for each accepted connection when the front serves TLS: it
    takes the connection's slot, puts a TLS layer with the head deadline as its handshake
    timeout between the socket and ``http`` (a :func:`protocol_for` class, which takes the slot
    over once the handshake is done), and gives the slot back if the handshake never is.
    Connections still in their handshake are kept in ``handshakes`` for a stopping server.

    The layer is the loop's own ``SSLProtocol``, the one ``loop.start_tls`` builds, put in place
    here within ``connection_made``: ``start_tls`` can only begin a step later, and uvloop
    starts reading a socket right after ``connection_made`` whatever the protocol paused, so a
    ClientHello could reach this protocol instead and be lost. Under uvloop it is uvloop's
    compiled layer: asyncio's pure-Python one cost HTTPS with keep-alive about 70% of the
    plain rate (``bench/http/tls.py``: 0.28x plain HTTP, against 0.9x with uvloop's)."""
    timeout_s = budget.limits.header_timeout_s

    class TlsGate(asyncio.Protocol):
        def __init__(self, **kwargs: Any) -> None:
            # uvicorn passes what its HTTP protocols take (config, server_state, app_state).
            self._kwargs = kwargs

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            raw = cast(asyncio.Transport, transport)
            peer = peer_host(raw.get_extra_info("peername"))
            if budget.admit(peer) is not None:
                raw.close()
                return
            protocol = http(**self._kwargs)
            protocol.gated(peer)
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            handshakes.add(raw)

            def handshake_over(done: asyncio.Future[None]) -> None:
                handshakes.discard(raw)
                if not protocol.took_over():
                    # The handshake failed or timed out: the HTTP protocol never started.
                    budget.release(peer)
                    if not done.cancelled() and done.exception() is not None:
                        log.debug(
                            "front.tls_handshake_failed", peer=peer, error=repr(done.exception())
                        )

            waiter.add_done_callback(handshake_over)
            layer = _ssl_protocol(loop)(
                loop,
                protocol,
                contexts.current,
                waiter,
                server_side=True,
                ssl_handshake_timeout=timeout_s,
            )
            raw.set_protocol(layer)
            layer.connection_made(raw)

    return TlsGate


def _ssl_protocol(loop: asyncio.AbstractEventLoop) -> Any:
    """The loop's own TLS layer: uvloop's (compiled; its transports hand it their reads
    directly) under uvloop, asyncio's otherwise. Both take the same arguments."""
    if _UvSSLProtocol is not None and isinstance(loop, uvloop.Loop):
        return _UvSSLProtocol
    return sslproto.SSLProtocol


_LINGER_S = 2.0
_LINGER_BYTES = 1024 * 1024
_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
}


class FrontServer:
    """One listening front. ``bind()`` early to learn the port (tests listen on port 0)."""

    def __init__(
        self,
        runtime: Runtime,
        listen: str,
        *,
        head_limits: HeadLimits = HeadLimits(),
        proxy_limits: ProxyLimits = ProxyLimits(),
        connection_limits: ConnectionLimits | None = None,
        tls: TlsFiles | None = None,
        tls_reload_interval_s: float = 2.0,
        reuse_port: bool = False,
        graceful_timeout_s: float = 30.0,
        keep_alive_s: float | None = None,
    ) -> None:
        """``connection_limits``, ``tls`` and ``keep_alive_s``: the settings' when not given. A
        TLS key or certificate that cannot be used is a :class:`ConfigError` here, before
        anything listens."""
        settings = runtime.settings
        self.runtime = runtime
        self.host, self.port = parse_listen(listen)
        self.head_limits = head_limits
        self.proxy_limits = proxy_limits
        self.connection_limits = connection_limits or connection_limits_of(settings)
        tls = tls or tls_files_of(settings)
        self.tls = TlsContexts(tls) if tls is not None else None
        self.tls_reload_interval_s = tls_reload_interval_s
        trusted = TrustedProxies(settings.trusted_proxies)
        # Every client behind a trusted proxy shares its address: no per-client cap for it.
        self.budget = ConnectionBudget(
            self.connection_limits, lambda host: parse_peer(host) in trusted
        )
        self.reuse_port = reuse_port
        self.graceful_timeout_s = graceful_timeout_s
        self.keep_alive_s = keep_alive_s if keep_alive_s is not None else settings.http_keep_alive_s
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
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        sock = self.bind()
        forwarder = Forwarder(self.proxy_limits)
        app = self.app = FrontApp(self.runtime, forwarder)
        app.stats.connections = self.budget
        front_protocol = protocol_for(app, self.head_limits, self.budget)
        http: type[asyncio.Protocol] = front_protocol
        handshakes: set[asyncio.Transport] = set()
        watching: asyncio.Task[None] | None = None
        if self.tls is not None:
            app.stats.tls = self.tls
            http = tls_gate_for(front_protocol, self.budget, self.tls, handshakes)
            watching = asyncio.ensure_future(self.tls.watch(self.tls_reload_interval_s, stop))

        def started() -> None:
            app.ops.ready = True
            log.info("front.listening", url=self.url)
            if ready is not None:
                ready.set()

        config = uvicorn.Config(
            app,
            loop="none",  # the caller's loop (uvloop under `gtm serve`)
            http=http,
            ws="none",
            lifespan="off",
            proxy_headers=False,  # forwarding headers are judged by the front, not uvicorn
            server_header=False,
            date_header=True,
            access_log=False,
            log_config=None,
            # typeshed says int; uvicorn passes it to call_later, which takes any seconds.
            timeout_keep_alive=self.keep_alive_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=max(1, round(self.graceful_timeout_s)),
        )
        server = EmbeddedServer(config, started)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            app.ops.draining = True
            for transport in list(handshakes):  # no new connections join a stopping server
                transport.abort()
            server.should_exit = True
            await serving
        finally:
            stopping.cancel()
            if watching is not None:
                watching.cancel()
            for transport in list(handshakes):
                transport.abort()
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


def connection_limits_of(settings: Settings) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections=settings.http_max_connections,
        max_per_client=settings.http_max_connections_per_client,
        header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s,
        body_min_rate=settings.http_body_min_rate,
    )


def tls_files_of(settings: Settings) -> TlsFiles | None:
    if settings.http_tls_cert is None or settings.http_tls_key is None:
        return None
    return TlsFiles(settings.http_tls_cert, settings.http_tls_key)


__all__ = [
    "ConnectionLimits",
    "FrontServer",
    "HeadLimits",
    "TlsFiles",
    "connection_limits_of",
    "parse_listen",
    "serve_front",
    "tls_files_of",
]
