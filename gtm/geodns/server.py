"""The DNS listeners: UDP and TCP (RFC 7766) on each configured address, answering from memory.

:class:`Responder.respond` is the whole answering path and never awaits: parse, rate limit,
look the rendered answer up (or render it), patch in the ID, flags and question case, count it
towards the audit. Rendered answers are reused per (name, type, EDNS shape, UDP limit, client
network, GeoIP bucket) within one snapshot version, and only until the next instant at which a
decision can change with time alone: when one of the snapshot's capacity reports goes stale.

Answers given from the exact-query cache (nearly all of them) are tallied on the cache entry, an
integer increment, and the audit writer drains the tallies at each flush (the responder is one
of its sources): counting through the writer per answer cost a fifth of the answering path.
Their response counters are folded into :class:`DnsStats` at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address

import structlog

from gtm.audit.record import AuditRecord, zone_record
from gtm.audit.writer import Tally
from gtm.geodns.ratelimit import Limit, ResponseRateLimiter
from gtm.geodns.render import OUR_UDP_SIZE, OptOut, rcode_name, response
from gtm.geodns.stats import DnsStats
from gtm.geodns.wire import Edns, Query, Reject, name_to_text, parse_query
from gtm.geodns.zone import answer, qtype_name, zone_data
from gtm.listen import parse_listen
from gtm.routing import client_network
from gtm.runtime import Runtime
from gtm.snapshot import Snapshot

log = structlog.get_logger(__name__)

IPAddress = IPv4Address | IPv6Address
_CACHE_LIMIT = 200_000
_COPIED = 0x0110  # RD and CD: the only query flags a cached answer takes from each query


@dataclass(frozen=True, slots=True)
class _Cached:
    template: bytes  # rendered with ID 0 and RD/CD clear
    flags: int
    record: AuditRecord
    rcode_name: str
    truncated: bool


class _Exact:
    """The whole response to one exact query from one sender, and the answers given from it
    since the audit writer last drained them (``n``, with the first and last answer's time)."""

    __slots__ = ("first", "last", "n", "record", "stats_key", "tail", "truncated")

    def __init__(
        self, tail: bytes, record: AuditRecord, stats_key: tuple[str, str, str], truncated: bool
    ) -> None:
        self.tail = tail  # the whole response after its ID
        self.record = record
        self.stats_key = stats_key
        self.truncated = truncated
        self.n = 0
        self.first = self.last = 0.0


def time_boundary(snapshot: Snapshot, now: float) -> float:
    """The next instant after ``now`` at which a decision from ``snapshot`` can change without a
    new snapshot: when a capacity report turns stale (DESIGN.md: stale reports are ignored)."""
    stale_after = snapshot.topology.routing.spillover.stale_after_s
    boundaries = [
        c.reported_at + stale_after
        for c in snapshot.capacity.values()
        if c.reported_at + stale_after > now
    ]
    return min(boundaries, default=math.inf)


def udp_limit(edns: Edns | None) -> int:
    # Never more than 1232 over UDP whatever the client advertises (DNS flag day 2020); 512
    # without EDNS (RFC 1035 §4.2.1).
    return min(edns.udp_size, OUR_UDP_SIZE) if edns is not None else 512


class Responder:
    def __init__(
        self,
        runtime: Runtime,
        stats: DnsStats,
        rate_limiter: ResponseRateLimiter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runtime = runtime
        self._store = runtime.store
        self.stats = stats
        self.rrl = rate_limiter
        self._clock = clock
        self._cache: dict[tuple[object, ...], _Cached] = {}
        self._exact: dict[tuple[bytes, object, bool], _Exact] = {}
        self._cache_version = -1
        self._cache_until = 0.0
        self._services: Mapping[str, object] = {}
        # Entries answered from since the last drain. They stay here when the caches are
        # dropped, so no tally is lost to a new snapshot.
        self._tallied: list[_Exact] = []
        runtime.writer.add_source(self.drain_tallies)

    def drain_tallies(self) -> Iterator[Tally]:
        """The audit writer's source: the answers given from cached entries since the last
        drain. Runs on the loop, interleaved with answering (the writer slices its flush): an
        entry answered from again before its turn here is drained with that answer too, and
        one answered from after its turn is listed again for the next drain."""
        tallied, self._tallied = self._tallied, []
        stats = self.stats
        queries = stats.queries
        for entry in tallied:
            n = entry.n
            entry.n = 0
            queries[entry.stats_key] += n
            if entry.truncated:
                stats.truncated += n
            yield entry.record, n, entry.first, entry.last

    def answer_udp(self, wire: bytes, host: str) -> bytes | None:
        """:meth:`respond` to a datagram from ``host`` (the address as the transport gives it),
        with nearly every query's case first: these exact bytes from this sender answered
        before, in this snapshot, with no rate limit to apply. Same answer, same counting."""
        exact = self._exact.get((wire[2:], host, True))
        if exact is not None and self.rrl is None:
            now = self._clock()
            if self._store.current.version == self._cache_version and now < self._cache_until:
                self.stats.cache_hits += 1
                if exact.n:
                    exact.n += 1
                else:
                    exact.n = 1
                    exact.first = now
                    self._tallied.append(exact)
                exact.last = now
                return wire[:2] + exact.tail
        return self.respond(wire, _peer(host), True, host)

    def respond(
        self, wire: bytes, client: IPAddress, udp: bool, peer: str | None = None
    ) -> bytes | None:
        """The response to one message, or None to send nothing. Never raises on input.

        ``peer`` is the sender's address as the transport gave it (cheaper to hash than an
        address object); it keys the exact-query cache.
        """
        snapshot = self._store.current
        now = self._clock()
        if snapshot.version != self._cache_version or now >= self._cache_until:
            self._cache, self._exact = {}, {}
            self._cache_version = snapshot.version
            self._cache_until = time_boundary(snapshot, now)
            self._services = zone_data(snapshot.topology).services
        if udp and self.rrl is not None:
            verdict = self.rrl.check(client)
            if verdict is not Limit.ANSWER:
                self.stats.rate_limited += 1
                if verdict is Limit.DROP:
                    return None
                self.stats.slipped += 1
                limited = parse_query(wire)
                return self._slip(limited, client) if isinstance(limited, Query) else None
        # First level: the exact query bytes after the ID, from this sender, over this transport.
        # The bytes fix name, type, flags, letter case and ECS; the sender fixes the location
        # when there is no ECS. So the whole response but its ID is known: no parsing at all.
        exact_key = (wire[2:], peer if peer is not None else client, udp)
        exact = self._exact.get(exact_key)
        if exact is not None:
            self.stats.cache_hits += 1
            if exact.n:
                exact.n += 1
            else:
                exact.n = 1
                exact.first = now
                self._tallied.append(exact)
            exact.last = now
            return wire[:2] + exact.tail
        parsed = parse_query(wire)
        if isinstance(parsed, Reject):
            return self._reject(parsed, client, udp)
        query = parsed
        limit = udp_limit(query.edns) if udp else None
        key = self._key(query, client, limit, snapshot, self._services)
        cached = self._cache.get(key)
        if cached is None:
            self.stats.cache_misses += 1
            result = answer(query, client, snapshot, now, limit)
            template = (
                b"\x00\x00"
                + (int.from_bytes(result.wire[2:4], "big") & ~_COPIED).to_bytes(2, "big")
                + result.wire[4:]
            )
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            truncated = bool(result.wire[2] & 0x02)
            cached = self._cache[key] = _Cached(
                template,
                int.from_bytes(template[2:4], "big"),
                result.record,
                result.record.response or rcode_name(result.rcode),
                truncated,
            )
            out = result.wire
        else:
            self.stats.cache_hits += 1
            template, n = cached.template, len(query.qname)
            out = (
                query.id.to_bytes(2, "big")
                + (cached.flags | (query.flags & _COPIED)).to_bytes(2, "big")
                + template[4:12]
                + query.qname
                + template[12 + n :]
            )
        stats_key = ("udp" if udp else "tcp", qtype_name(query.qtype), cached.rcode_name)
        if len(self._exact) >= _CACHE_LIMIT:
            self._exact.clear()
        self._exact[exact_key] = _Exact(out[2:], cached.record, stats_key, cached.truncated)
        # Counted at once, like the rare answers below: only repeats are tallied on the entry.
        self.runtime.count(cached.record)
        self.stats.queries[stats_key] += 1
        if cached.truncated:
            self.stats.truncated += 1
        return out

    @staticmethod
    def _key(
        query: Query,
        client: IPAddress,
        limit: int | None,
        snapshot: Snapshot,
        services: Mapping[str, object],
    ) -> tuple[object, ...]:
        edns = query.edns
        ecs = edns.ecs if edns is not None else None
        shape: tuple[object, ...] | None = None
        if edns is not None:
            shape = (edns.do,) if ecs is None else (edns.do, ecs.family, ecs.source, ecs.address)
        if ecs is not None and ecs.source > 0:
            located = ecs.network.network_address
            bucket: tuple[int, int] = (0, 0)  # the ECS subnet in the shape is the bucket
        else:
            located = client
            bucket = (4, int(client) >> 8) if client.version == 4 else (6, int(client) >> 72)
        geo: int | None = None
        if query.qname_text in services:
            loc = snapshot.geo.locate(located)
            net = loc.network
            # A GeoIP network narrower than the client bucket splits it: key by the address.
            if net is not None and net.prefixlen > (24 if net.version == 4 else 56):
                geo = int(located)
        return (query.qname_text, query.qtype, query.qclass, shape, limit, bucket, geo)

    def _reject(self, reject: Reject, client: IPAddress, udp: bool) -> bytes | None:
        if reject.drop:
            self.stats.dropped += 1
            return None
        question = None
        if reject.qname is not None:
            question = reject.qname + struct.pack("!HH", reject.qtype, reject.qclass)
        opt = OptOut(reject.edns.do, None) if reject.edns is not None else None
        wire = response(
            reject.id or 0,
            reject.flags,
            reject.rcode,
            authoritative=False,
            question=question,
            opt=opt,
            limit=512 if udp else None,
        )
        snapshot = self.runtime.store.current
        name = "-"
        if reject.qname is not None:
            name = name_to_text(reject.qname)[:255]
        self.runtime.count(
            zone_record(
                channel="dns",
                name=name,
                client_network=str(client_network(client, None)),
                ecs=None,
                query_type=qtype_name(reject.qtype) if reject.qname else None,
                response=rcode_name(reject.rcode),
                outcome="malformed" if reject.rcode == 1 else "rejected",
                answer=(reject.reason[:200],),
                versions=snapshot.versions,
            )
        )
        self.stats.queries["udp" if udp else "tcp", "-", rcode_name(reject.rcode)] += 1
        return wire

    def _slip(self, query: Query, client: IPAddress) -> bytes:
        edns = query.edns
        opt = OptOut(edns.do, None) if edns is not None else None
        question = query.qname + struct.pack("!HH", query.qtype, query.qclass)
        wire = response(
            query.id, query.flags, 0, authoritative=True, question=question, opt=opt, limit=0
        )  # limit 0: always cut to the question (TC)
        snapshot = self.runtime.store.current
        self.runtime.count(
            zone_record(
                channel="dns",
                name=query.qname_text,
                client_network=str(client_network(client, None)),
                ecs=None,
                query_type=qtype_name(query.qtype),
                response="NOERROR+TC",
                outcome="rate-limited",
                answer=(),
                versions=snapshot.versions,
            )
        )
        self.stats.queries["udp", qtype_name(query.qtype), "NOERROR+TC"] += 1
        self.stats.truncated += 1
        return wire


# -- listeners ---------------------------------------------------------------------------------


_ADDRESSES: dict[str, IPAddress] = {}


def _peer(host: str) -> IPAddress:
    addr = _ADDRESSES.get(host)
    if addr is None:
        if len(_ADDRESSES) > 100_000:
            _ADDRESSES.clear()
        addr = _ADDRESSES[host] = ip_address(host.split("%", 1)[0])
    return addr


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        try:
            out = self.responder.answer_udp(data, str(addr[0]))
        except Exception:  # one bad packet must never take the listener down
            log.exception("dns.udp_failed", peer=str(addr[0]))
            return
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable and the like
        log.debug("dns.udp_error", error=str(exc))


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
        peer = _peer(str(writer.get_extra_info("peername")[0]))
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
                    out = self.responder.respond(message, peer, udp=False)
                except Exception:
                    log.exception("dns.tcp_failed", peer=str(peer))
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


def make_server(runtime: Runtime, stats: DnsStats, *, reuse_port: bool = False) -> DnsServer:
    s = runtime.settings
    limiter = (
        ResponseRateLimiter(s.dns_rate_limit, slip=s.dns_rate_slip)
        if s.dns_rate_limit > 0
        else None
    )
    return DnsServer(
        Responder(runtime, stats, limiter),
        s.dns_listen,
        tcp_idle_s=s.dns_tcp_idle_s,
        tcp_max_connections=s.dns_tcp_max_connections,
        reuse_port=reuse_port,
    )
