"""Serving the front: uvicorn (httptools parser, the caller's event loop) around :class:`FrontApp`.

``serve_front`` runs inside the caller's loop (``gtm serve`` puts it beside the DNS responder),
binds the socket itself so that a busy port is an exception for the caller rather than
uvicorn's ``sys.exit``, leaves signal handling to the caller, and returns once ``stop`` is set
and the requests in flight have been answered.

The HTTP protocol each connection gets (bounded heads, connection slots and deadlines, cached
redirects answered in the protocol) is :mod:`gtm.front.protocol`. With TLS
(:mod:`gtm.front.tls`) a connection takes its slot before the handshake, which has the same
deadline as a request head: the front runs the handshake itself (:func:`tls_gate_for`) rather
than through uvicorn's ``ssl`` option, under which a connection is invisible to the protocol
until its handshake is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from asyncio import sslproto
from typing import Any, cast

import structlog
import uvicorn
import uvloop
import uvloop.loop

from gtm.errors import ConfigError, Problem
from gtm.front.affinity import AffinitySettings, load_key
from gtm.front.app import FrontApp
from gtm.front.client_address import TrustedProxies, parse_peer
from gtm.front.connections import ConnectionBudget, ConnectionLimits, peer_host
from gtm.front.protocol import HeadLimits, SlotProtocol, protocol_for
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


def parse_listen(listen: str) -> tuple[str, int]:
    """The listen address, or :class:`ConfigError` naming the setting."""
    try:
        return listen_address(listen)
    except ValueError as exc:
        raise ConfigError([Problem("GTM_HTTP_LISTEN", "", str(exc))]) from None


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
        affinity: AffinitySettings | None = None,
    ) -> None:
        """``connection_limits``, ``tls``, ``keep_alive_s`` and ``affinity``: the settings'
        when not given. A TLS key or certificate, or an affinity key
        file, that cannot be used is a :class:`ConfigError` here, before anything listens."""
        settings = runtime.settings
        self.runtime = runtime
        self.host, self.port = parse_listen(listen)
        self.head_limits = head_limits
        self.proxy_limits = proxy_limits
        self.connection_limits = connection_limits or connection_limits_of(settings)
        tls = tls or tls_files_of(settings)
        self.tls = TlsContexts(tls) if tls is not None else None
        self.tls_reload_interval_s = tls_reload_interval_s
        self.affinity = affinity or affinity_of(settings)
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
        app = self.app = FrontApp(self.runtime, forwarder, self.affinity)
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


def affinity_of(settings: Settings) -> AffinitySettings | None:
    """Session affinity as the settings have it; None when it is off."""
    if not settings.http_affinity:
        return None
    return AffinitySettings(
        load_key(settings.http_affinity_key_file),
        ttl_s=settings.http_affinity_ttl_s,
        min_spare=settings.http_affinity_min_spare,
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
    "affinity_of",
    "connection_limits_of",
    "parse_listen",
    "serve_front",
    "tls_files_of",
]
