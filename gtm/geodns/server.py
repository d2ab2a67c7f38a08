"""The DNS listeners: UDP and TCP (RFC 7766) on each configured address, around one
:class:`~gtm.geodns.responder.Responder`.

The UDP protocol answers a repeated query inline (the responder's exact-query cache, without a
call), everything else through the responder; TCP connections are read as length-prefixed
messages, answered in order, with idle and per-connection limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from ipaddress import ip_network
from typing import Any

import structlog

from gtm.errors import ConfigError, Problem
from gtm.geodns.budget import Budget
from gtm.geodns.dnssec import make_signer
from gtm.geodns.identity import ServerIdentity
from gtm.geodns.ratelimit import ResponseRateLimiter
from gtm.geodns.responder import Responder
from gtm.geodns.stats import DnsStats
from gtm.geodns.wire import bound_memos, peer_address
from gtm.listen import parse_listen
from gtm.runtime import Runtime

log = structlog.get_logger(__name__)

UDP_RECEIVE_BUFFER = 2 << 20  # bytes asked for; Linux doubles it for its bookkeeping


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.transport: asyncio.DatagramTransport | None = None
        self._sendto: Callable[[bytes, Any], None] = _not_connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._sendto = self.transport.sendto  # type: ignore[union-attr]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        # addr: (host, port), or (host, port, flowinfo, scope id) over IPv6.
        r = self.responder
        if r.rrl is None:
            # Responder._repeat inline (no call): nearly every query ends here.
            by_query = r._udp.get(addr[0])
            if by_query is not None:
                exact = by_query.get(data[2:])
                if exact is not None:
                    now = r.clock()
                    window = r._window
                    if now < window.until and r._store.current is window.snapshot:
                        if exact.n:
                            exact.n += 1
                        else:
                            exact.n = 1
                            exact.first = now
                            r._tallied.append(exact)
                        exact.last = now
                        self._sendto(data[:2] + exact.tail, addr)
                        return
        try:
            out = r.answer_udp(data, addr[0], r.rrl is None)
        except Exception as exc:  # a bug a packet reached: counted, logged once an interval
            r.stats.failed += 1
            r.runtime.failures.record("dns.udp", exc, peer=str(addr[0]))
            return
        if out is not None:
            self._sendto(out, addr)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable and the like
        log.debug("dns.udp_error", error=str(exc))


def _not_connected(data: bytes, addr: Any) -> None:
    raise RuntimeError("datagram before the transport was made")


class DnsServer:
    """UDP and TCP listeners on every address, sharing one responder."""

    def __init__(
        self,
        responder: Responder,
        listens: tuple[str, ...],
        *,
        tcp_idle_s: float = 10.0,
        tcp_max_connections: int = 1000,
        reuse_port: bool = False,
    ) -> None:
        self.responder = responder
        self.listens = listens
        self.tcp_idle_s = tcp_idle_s
        self.tcp_max = tcp_max_connections
        self.reuse_port = reuse_port
        self._udp: list[asyncio.DatagramTransport] = []
        self._tcp: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self.bound: list[tuple[str, int]] = []  # (host, port) actually bound, for port 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for listen in self.listens:
            host, port = parse_listen(listen)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            # TCP first, so that with port 0 UDP can take the same port number.
            server = await asyncio.start_server(
                self._serve_tcp,
                host,
                port,
                family=family,
                reuse_port=self.reuse_port or None,
                backlog=1024,
            )
            self._tcp.append(server)
            port = server.sockets[0].getsockname()[1]
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self.responder),
                local_addr=(host, port),
                family=family,
                reuse_port=self.reuse_port or None,
            )
            self._udp.append(transport)
            _widen_receive_buffer(transport)
            self.bound.append((host, port))
            log.info("dns.listening", host=host, port=port)

    async def stop(self) -> None:
        for transport in self._udp:
            transport.close()
        for server in self._tcp:
            server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for server in self._tcp:
            await server.wait_closed()
        self._udp.clear()
        self._tcp.clear()

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stats = self.responder.stats
        if len(self._connections) >= self.tcp_max:
            stats.tcp_refused += 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        stats.tcp_connections += 1
        peer = peer_address(str(writer.get_extra_info("peername")[0]))
        try:
            # RFC 7766 §6.2.1: several queries per connection, answered in order; an idle
            # connection is closed after a timeout.
            while True:
                try:
                    header = await asyncio.wait_for(reader.readexactly(2), self.tcp_idle_s)
                    (length,) = struct.unpack("!H", header)
                    message = await asyncio.wait_for(reader.readexactly(length), self.tcp_idle_s)
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    out = self.responder.answer_tcp(message, peer)
                except Exception as exc:  # as over UDP; the connection is closed
                    stats.failed += 1
                    self.responder.runtime.failures.record("dns.tcp", exc, peer=str(peer))
                    return
                if out is None:
                    return  # unreadable: close, as there is no sane way to resynchronise
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._connections.discard(task)
            stats.tcp_connections -= 1
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()


def _widen_receive_buffer(transport: asyncio.BaseTransport) -> None:
    """Ask for a UDP receive buffer of :data:`UDP_RECEIVE_BUFFER` (the kernel caps it at
    net.core.rmem_max). The default (about 200 KB, some 200 queries as the kernel accounts
    them) overflows, and drops queries, whenever the loop pauses a few milliseconds under load;
    authoritative servers raise it for the same reason (NSD, Unbound: so-rcvbuf)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < UDP_RECEIVE_BUFFER:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RECEIVE_BUFFER)


def make_server(runtime: Runtime, stats: DnsStats, *, reuse_port: bool = False) -> DnsServer:
    s = runtime.settings
    budget = Budget.from_mb(s.dns_cache_budget_mb)
    bound_memos(budget.parsed_entries)
    try:
        exempt = tuple(ip_network(n, strict=False) for n in s.dns_rate_limit_exempt)
    except ValueError as exc:
        raise ConfigError([Problem("settings", "GTM_DNS_RATE_LIMIT_EXEMPT", str(exc))]) from exc
    limiter = (
        ResponseRateLimiter(
            s.dns_rate_limit,
            slip=s.dns_rate_slip,
            max_entries=budget.rate_buckets,
            exempt=exempt,
        )
        if s.dns_rate_limit > 0
        else None
    )
    return DnsServer(
        Responder(
            runtime,
            stats,
            limiter,
            budget=budget,
            signer=make_signer(s),
            identity=ServerIdentity(s.dns_server_id, s.dns_server_version),
        ),
        s.dns_listen,
        tcp_idle_s=s.dns_tcp_idle_s,
        tcp_max_connections=s.dns_tcp_max_connections,
        reuse_port=reuse_port,
    )
