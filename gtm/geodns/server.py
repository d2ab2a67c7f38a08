"""The DNS listeners: UDP and TCP (RFC 7766) on each configured address, around one
:class:`~gtm.geodns.responder.Responder`.

Over UDP, a query a cache holds is answered as it is read (a repeated one inline: the
responder's exact-query cache, without a call); the rest wait for the slow path in queues per
sender network, drained round robin a bounded slice per loop turn (:mod:`gtm.geodns.admission`,
off with ``GTM_DNS_FAIR_ADMISSION=false``: then every datagram is answered in the order read).
TCP connections are served by :mod:`gtm.geodns.tcp` (misses admitted per sender network
there too).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Hashable
from ipaddress import ip_network
from typing import Any

import structlog

from gtm.errors import ConfigError, Problem
from gtm.geodns.admission import NETWORK_FULL, OVER_SHARE, SlowLane, sender_network
from gtm.geodns.budget import Budget
from gtm.geodns.dnssec import make_signer
from gtm.geodns.identity import ServerIdentity
from gtm.geodns.ratelimit import ResponseRateLimiter
from gtm.geodns.responder import SLOW, Responder
from gtm.geodns.stats import DnsStats
from gtm.geodns.tcp import TcpService
from gtm.geodns.wire import bound_memos
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


READ_BATCH = 256  # datagrams read per loop turn at most, before the loop serves others
# While the reader is behind, of each READ_BATCH datagrams read, the most one sender network
# gets answered or queued when others sent too: the rest of its datagrams are dropped as they
# are read (counted as OVER_SHARE), for a read and a dictionary look-up each. A flood from one
# network then costs the loop little more than reading it, so the reader catches up and the
# kernel's buffer (shared by every sender, and a FIFO) stops delaying and dropping the others.
TURN_SHARE = 64
# The slow path's time in one loop turn, at most (and at least one query): cached answers wait
# in the kernel's buffer while it runs (gtm.geodns.admission).
SLOW_TURN_S = 0.001


class _FairUdp:
    """A UDP listener that admits the slow path per sender network (gtm.geodns.admission).

    asyncio's datagram transport reads one datagram per loop turn: behind a flood that fills
    the slow path, a cached answer waits for every query read before it, and what the kernel's
    buffer cannot hold meanwhile is dropped whoever sent it. Here every datagram waiting is read
    in one turn (up to :data:`READ_BATCH`), those a cache holds answered at once; the others are
    queued per sender /24 (/56) and drained round robin, ``slow_batch`` a turn, so each loop
    turn reads and answers the cached queries first and gives the slow path a bounded slice;
    one query a turn while the reader is behind (datagrams still waiting after a full batch)."""

    def __init__(
        self, sock: socket.socket, responder: Responder, lane: SlowLane[_Queued], slow_batch: int
    ) -> None:
        self.sock = sock
        self.responder = responder
        self.lane = lane
        self.slow_batch = slow_batch
        self._loop = asyncio.get_running_loop()
        self._scheduled = False
        self._closed = False
        # The last read stopped at READ_BATCH with datagrams still waiting: the reader is
        # behind, so the slow path gets one query a turn until it catches up (cached answers
        # first; what the kernel's buffer cannot hold it drops whoever sent it).
        self._behind = False
        # Sender host string -> its network (the queue it waits in); a memo, cleared when full.
        self._networks: dict[str, Hashable] = {}
        # Whether the last full batch read came from more than one network: only then is a
        # network held to TURN_SHARE (a large resolver alone is not capped).
        self._shared = False

    def start(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.sock.fileno())
        self.lane.clear()  # counted as dropped at shutdown
        self.sock.close()

    def _network(self, host: str) -> Hashable:
        network = self._networks.get(host)
        if network is None:
            if len(self._networks) >= _NETWORK_MEMO:
                self._networks.clear()
            network = self._networks[host] = sender_network(host)
        return network

    def _readable(self) -> None:
        r = self.responder
        sock = self.sock
        lane = self.lane
        networks = self._networks
        # Behind (the last batch stopped at READ_BATCH) with other networks sending: each
        # network's datagrams past TURN_SHARE in this batch are dropped as they are read.
        share = self._behind and self._shared
        taken: dict[Hashable, int] = {}
        self._behind = True
        for _ in range(READ_BATCH):
            try:
                data, addr = sock.recvfrom(65535)
            except InterruptedError:
                continue
            except OSError:  # nothing more waiting (BlockingIOError), or an ICMP error
                self._behind = False
                break
            network = networks.get(addr[0])
            if network is None:
                network = self._network(addr[0])
            n = taken.get(network, 0)
            if share and n >= TURN_SHARE:
                lane.counts.dropped[OVER_SHARE] += 1
                continue
            taken[network] = n + 1
            if r.rrl is None:
                # Responder._repeat inline (no call), as in _UdpProtocol: nearly every query.
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
                            self._send(data[:2] + exact.tail, addr)
                            continue
                # Not a first-level answer, from a network whose queue is at its bound: it
                # would be dropped anyway, so the other caches are not even looked at (a flood
                # then costs the read and two lookups a datagram). With the rate limiter on,
                # each datagram goes through it first (answer_cached): a flooding network is
                # limited there.
                if lane.full(network):
                    lane.counts.dropped[NETWORK_FULL] += 1
                    continue
            try:
                out = r.answer_cached(data, addr[0])
            except Exception as exc:  # a bug a packet reached: counted, logged once an interval
                r.stats.failed += 1
                r.runtime.failures.record("dns.udp", exc, peer=str(addr[0]))
                continue
            if out is SLOW:
                if lane.offer(network, (data, addr)) and not self._scheduled:
                    self._scheduled = True
                    self._loop.call_soon(self._drain)
            elif out is not None:
                self._send(out, addr)
        if self._behind:
            self._shared = len(taken) > 1

    def _drain(self) -> None:
        """One turn's slice of the slow path: ``slow_batch`` queued queries, one per network in
        turn; scheduled again for the next turn while any wait."""
        self._scheduled = False
        if self._closed:
            return
        r = self.responder
        lane = self.lane
        counts = lane.counts
        # slow_batch queries at most (one while the reader is behind), and no more once
        # SLOW_TURN_S has passed: new subnets or names cost unequal times (a GeoIP look-up, a
        # rendering, a signature), so a count alone does not bound the turn.
        limit = 1 if self._behind else self.slow_batch
        until = time.perf_counter() + SLOW_TURN_S
        for _ in range(limit):
            taken = lane.take(1)
            if not taken:
                break
            data, addr = taken[0]
            counts.admitted += 1
            try:
                out = r.answer_udp(data, addr[0], checked=True)
            except Exception as exc:  # as in _readable
                r.stats.failed += 1
                r.runtime.failures.record("dns.udp", exc, peer=str(addr[0]))
                continue
            if out is not None:
                self._send(out, addr)
            if time.perf_counter() >= until:
                break
        if self.lane.size:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _send(self, out: bytes, addr: Any) -> None:
        try:
            self.sock.sendto(out, addr)
        except OSError as exc:  # the send buffer full (BlockingIOError), or unroutable
            self.responder.stats.send_dropped += 1
            log.debug("dns.udp_send_error", error=str(exc))


_Queued = tuple[bytes, Any]  # a datagram waiting for the slow path, and its sender's address
_NETWORK_MEMO = 1 << 16  # sender hosts whose network is memoised


def _bind_udp(
    host: str, port: int, family: socket.AddressFamily, reuse_port: bool
) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


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
        fair: bool = True,
        slow_per_network: int = 256,
        slow_total: int = 4096,
        slow_batch: int = 32,
    ) -> None:
        self.responder = responder
        self.listens = listens
        self.reuse_port = reuse_port
        # Fair admission of the slow path (gtm.geodns.admission); off: asyncio's transport,
        # every datagram answered in the order read, one per loop turn.
        self.fair = fair
        self.slow_per_network = slow_per_network
        self.slow_total = slow_total
        self.slow_batch = slow_batch
        self._udp: list[asyncio.DatagramTransport] = []
        self._fair: list[_FairUdp] = []
        self._tcp: list[asyncio.Server] = []
        self.tcp = TcpService(
            responder,
            idle_s=tcp_idle_s,
            max_connections=tcp_max_connections,
            fair=fair,
            slow_batch=slow_batch,
        )
        self.bound: list[tuple[str, int]] = []  # (host, port) actually bound, for port 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for listen in self.listens:
            host, port = parse_listen(listen)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            # TCP first, so that with port 0 UDP can take the same port number.
            server = await asyncio.start_server(
                self.tcp.serve,
                host,
                port,
                family=family,
                reuse_port=self.reuse_port or None,
                backlog=1024,
            )
            self._tcp.append(server)
            port = server.sockets[0].getsockname()[1]
            if self.fair:
                sock = _bind_udp(host, port, family, self.reuse_port)
                _widen_receive_buffer(sock)
                lane: SlowLane[_Queued] = SlowLane(
                    self.slow_per_network, self.slow_total, self.responder.stats.lane
                )
                listener = _FairUdp(sock, self.responder, lane, self.slow_batch)
                listener.start()
                self._fair.append(listener)
            else:
                transport, _ = await loop.create_datagram_endpoint(
                    lambda: _UdpProtocol(self.responder),
                    local_addr=(host, port),
                    family=family,
                    reuse_port=self.reuse_port or None,
                )
                self._udp.append(transport)
                _widen_receive_buffer(transport.get_extra_info("socket"))
            self.bound.append((host, port))
            log.info("dns.listening", host=host, port=port)

    def udp_sockets(self) -> list[Any]:
        """The UDP listeners' sockets (asyncio's socket wrappers when fairness is off)."""
        return [listener.sock for listener in self._fair] + [
            transport.get_extra_info("socket") for transport in self._udp
        ]

    async def stop(self) -> None:
        for transport in self._udp:
            transport.close()
        for listener in self._fair:
            listener.close()
        for server in self._tcp:
            server.close()
        await self.tcp.close()
        for server in self._tcp:
            await server.wait_closed()
        self._udp.clear()
        self._fair.clear()
        self._tcp.clear()


def _widen_receive_buffer(sock: Any) -> None:
    """Ask for a UDP receive buffer of :data:`UDP_RECEIVE_BUFFER` (the kernel caps it at
    net.core.rmem_max). The default (about 200 KB, some 200 queries as the kernel accounts
    them) overflows, and drops queries, whenever the loop pauses a few milliseconds under load;
    authoritative servers raise it for the same reason (NSD, Unbound: so-rcvbuf)."""
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
        fair=s.dns_fair_admission,
        slow_per_network=s.dns_slow_queue_per_network,
        slow_total=s.dns_slow_queue_total,
        slow_batch=s.dns_slow_batch,
    )
