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
import socket
from collections.abc import Callable
from ipaddress import ip_network
from typing import Any

import structlog

from gtm.errors import ConfigError, Problem
from gtm.geodns import steering
from gtm.geodns.admission import SlowLane
from gtm.geodns.budget import Budget
from gtm.geodns.cookies import load_cookies
from gtm.geodns.dnssec import make_signer
from gtm.geodns.established import EstablishedNetworks
from gtm.geodns.groups import TCP_BACKLOG, WorkerGroup, bind_udp, widen_receive_buffer
from gtm.geodns.identity import ServerIdentity
from gtm.geodns.ratelimit import ResponseRateLimiter
from gtm.geodns.responder import Responder
from gtm.geodns.stats import DnsStats
from gtm.geodns.tcp import TcpService
from gtm.geodns.udp import FairUdp, Queued
from gtm.geodns.wire import bound_memos
from gtm.listen import parse_listen
from gtm.runtime import Runtime

log = structlog.get_logger(__name__)


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
                            exact.last = now
                            self._sendto(data[:2] + exact.tail, addr)
                            return
                        if now < exact.until:  # a cookie's entry lapses (Exact.until)
                            exact.n = 1
                            exact.first = exact.last = now
                            r._tallied.append(exact)
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
        fair: bool = True,
        slow_per_network: int = 256,
        slow_total: int = 4096,
        slow_batch: int = 32,
        udp_sockets: int = 1,
        steer_group: int | None = None,
        established_networks: int = 0,
        queue_age: bool = False,
        establish_with_cookie: bool = False,
        groups: dict[str, WorkerGroup] | None = None,
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
        # UDP sockets per listen address with fair admission (gtm.geodns.steering), and the
        # size of the reuseport group they join: with worker processes sharing the port, every
        # worker's sockets (the program picks among all of them).
        self.sockets_per_address = udp_sockets
        self.steer_group = steer_group or udp_sockets
        self.steered = False  # whether the kernel took the steering program
        # Established sender networks (gtm.geodns.established) kept at most per listen address,
        # on the first half of its sockets; 0: off. With worker processes, only on the groups
        # the first process bound for them all (``groups``): the split program names sockets
        # by their place in the group, known only for sockets bound in a known order.
        self.established_networks = established_networks
        self.queue_age = queue_age
        # Only networks a valid DNS cookie proved are established (gtm.geodns.established).
        self.establish_with_cookie = establish_with_cookie
        self.split = False  # whether the kernel took the split program
        # This worker's share of the split groups the first process bound for every worker
        # (gtm.geodns.groups), by listen address: used instead of binding its own.
        self.groups = groups or {}
        self._udp: list[asyncio.DatagramTransport] = []
        self._fair: list[FairUdp] = []
        self._tcp: list[asyncio.Server] = []
        self.tcp = TcpService(
            responder,
            idle_s=tcp_idle_s,
            max_connections=tcp_max_connections,
            fair=fair,
            slow_batch=slow_batch,
        )
        self.bound: list[tuple[str, int]] = []  # (host, port) actually bound, for port 0
        responder.stats.receive_drops = self.receive_drops

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for listen in self.listens:
            host, port = parse_listen(listen)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            # The sockets the first of the workers bound for this one (gtm.geodns.groups).
            share = self.groups.pop(listen, None)
            # TCP first, so that with port 0 UDP can take the same port number.
            if share is not None and share.tcp is not None:
                server = await asyncio.start_server(
                    self.tcp.serve, sock=share.tcp, backlog=TCP_BACKLOG
                )
            else:
                server = await asyncio.start_server(
                    self.tcp.serve,
                    host,
                    port,
                    family=family,
                    reuse_port=self.reuse_port or None,
                    backlog=TCP_BACKLOG,
                )
            self._tcp.append(server)
            port = server.sockets[0].getsockname()[1]
            if self.fair:
                split: steering.SplitGroup | None
                if share is not None:
                    socks, split = share.socks, share.split
                    self.steered = self.split = True
                else:
                    socks, split = self._bind_group(host, port, family)
                lane: SlowLane[Queued] = SlowLane(
                    self.slow_per_network, self.slow_total, self.responder.stats.lane
                )
                established = None
                if split is not None:
                    established = EstablishedNetworks(
                        # The map is the group's: each worker's share of it (gtm.geodns.groups).
                        max(1, self.established_networks // split.workers),
                        proven=self.responder.proven if self.establish_with_cookie else None,
                    )
                    self.responder.stats.established.append(established)
                listener = FairUdp(
                    socks,
                    self.responder,
                    lane,
                    self.slow_batch,
                    split,
                    established,
                    queue_age=self.queue_age,
                )
                self._fair.append(listener)  # closed by stop(), whatever happens next
                listener.start()
            else:
                transport, _ = await loop.create_datagram_endpoint(
                    lambda: _UdpProtocol(self.responder),
                    local_addr=(host, port),
                    family=family,
                    reuse_port=self.reuse_port or None,
                )
                self._udp.append(transport)
                widen_receive_buffer(transport.get_extra_info("socket"))
            self.bound.append((host, port))
            log.info("dns.listening", host=host, port=port)

    def _bind_group(
        self, host: str, port: int, family: socket.AddressFamily
    ) -> tuple[list[socket.socket], steering.SplitGroup | None]:
        """The listen address's UDP sockets, each sender network steered to one of them
        (:mod:`gtm.geodns.steering`); one socket when ``udp_sockets`` is 1. With established
        networks on, and the kernel's leave, the group is split (the map and program
        returned)."""
        socks: list[socket.socket] = []
        split = None
        try:
            for _ in range(self.sockets_per_address):
                sock = bind_udp(host, port, family, self.reuse_port or self.sockets_per_address > 1)
                socks.append(sock)
            split = self._split(socks, host, port)
            if split is None and self.steer_group > 1:
                self.steered = steering.attach(socks[0], self.steer_group)
                if not self.steered:
                    log.warning(
                        "dns.udp_steering_refused",
                        host=host,
                        port=port,
                        detail="the kernel spreads datagrams by its own hash of addresses",
                    )
        except BaseException:
            if split is not None:
                split.close()
            for sock in socks:
                sock.close()
            raise
        return socks, split

    def _split(
        self, socks: list[socket.socket], host: str, port: int
    ) -> steering.SplitGroup | None:
        """The split program on ``socks``' group, where it applies and the kernel takes it;
        None (logged when refused) leaves the group to the hash alone."""
        n = len(socks)
        if self.established_networks <= 0 or n < 2 or self.steer_group != n:
            return None
        try:
            split = steering.SplitGroup.open(
                socks[0], n // 2, n - n // 2, self.established_networks
            )
        except OSError as exc:
            log.warning(
                "dns.established_refused",
                host=host,
                port=port,
                error=str(exc).split("\n")[0],
                detail="the eBPF program needs CAP_BPF: every sender network shares the hashed "
                "sockets, a flood from many networks with them",
            )
            return None
        self.steered = self.split = True
        return split

    def udp_sockets(self) -> list[Any]:
        """Every UDP socket (asyncio's socket wrappers when fairness is off)."""
        return [sock for listener in self._fair for sock in listener.socks] + [
            transport.get_extra_info("socket") for transport in self._udp
        ]

    def socket_of(self, host: str) -> int:
        """The socket of the first UDP listener that ``host``'s datagrams land on now (tests and
        the docs: :meth:`FairUdp.socket_of`)."""
        return self._fair[0].socket_of(host)

    def receive_drops(self) -> int:
        """Datagrams the kernel dropped at the UDP listeners' full receive buffers."""
        return sum(listener.receive_drops() for listener in self._fair) + sum(
            steering.receive_drops(transport.get_extra_info("socket")) for transport in self._udp
        )

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


def make_server(
    runtime: Runtime,
    stats: DnsStats,
    *,
    reuse_port: bool = False,
    groups: dict[str, WorkerGroup] | None = None,
) -> DnsServer:
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
            cookies=(
                load_cookies(
                    s.dns_cookie_secret_file,
                    s.dns_cookie_secret.get_secret_value() if s.dns_cookie_secret else None,
                )
                if s.dns_cookies
                else None
            ),
            require_cookie=s.dns_require_cookie,
        ),
        s.dns_listen,
        tcp_idle_s=s.dns_tcp_idle_s,
        tcp_max_connections=s.dns_tcp_max_connections,
        reuse_port=reuse_port,
        fair=s.dns_fair_admission,
        slow_per_network=s.dns_slow_queue_per_network,
        slow_total=s.dns_slow_queue_total,
        slow_batch=s.dns_slow_batch,
        udp_sockets=s.dns_udp_sockets,
        established_networks=s.dns_established_networks,
        queue_age=s.dns_queue_age,
        establish_with_cookie=s.dns_establish_with_cookie,
        groups=groups,
        # Worker processes on the same port join one reuseport group: the program picks
        # among every worker's sockets.
        steer_group=s.dns_udp_sockets * (s.workers if reuse_port else 1),
    )
