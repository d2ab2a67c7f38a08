"""The fair UDP listener of one listen address (DESIGN.md rule 9): a group of sockets each
sender network is steered to (:mod:`gtm.geodns.steering`), read a bounded batch a loop turn
each, cached answers sent as read and the rest admitted per sender network
(:mod:`gtm.geodns.admission`); with a split group, the established networks' sockets and
slow-path lane (:mod:`gtm.geodns.established`). :mod:`gtm.geodns.server` binds the sockets
and runs one of these per address."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Hashable
from typing import Any

import structlog

from gtm.geodns import steering
from gtm.geodns.admission import NETWORK_FULL, OVER_SHARE, UNPROVEN, SlowLane, sender_network
from gtm.geodns.established import EstablishedNetworks, is_calm
from gtm.geodns.responder import SLOW, Responder
from gtm.geodns.stats import ESTABLISHED, GENERAL, SO_TIMESTAMPNS, STAMP_SPACE, age_of_stamp
from gtm.geodns.steering import receive_queued

log = structlog.get_logger(__name__)

# A datagram waiting for the slow path, its sender's address and the socket it came in on.
Queued = tuple[bytes, Any, socket.socket]

READ_BATCH = 256  # datagrams read per loop turn at most, before the loop serves others
# While the reader is behind, of each READ_BATCH datagrams read, the most one sender network
# gets answered or queued when others sent too: the rest of its datagrams are dropped as they
# are read (counted as OVER_SHARE), for a read and a dictionary look-up each. A flood from one
# network then costs the loop little more than reading it, so the reader catches up and the
# kernel's buffer (shared by every sender, and a FIFO) stops delaying and dropping the others.
TURN_SHARE = 64
# Datagrams read per loop turn at most from each socket of a group (gtm.geodns.steering): a
# socket's datagrams wait behind at most one such batch of every other socket's, a flood's
# included, so a smaller batch bounds their wait; the loop's own cost per turn (a poll and a
# call per ready socket) is then still small beside it. Its share, as TURN_SHARE of READ_BATCH.
SOCKET_BATCH = 64
SOCKET_SHARE = 16
# A general socket's batch while the general sockets are behind (flooded) and established
# networks have sockets of their own (gtm.geodns.established): newcomers get less of the loop
# during a flood, and an established network's queries wait behind at most this much of each.
GENERAL_BATCH = 8
GENERAL_SHARE = 2
# Bytes waiting in a general socket after a full small batch above which it is flooded: about
# a usual batch's datagrams as the kernel accounts them (some 800 bytes each, small or not).
FLOODED_BYTES = SOCKET_BATCH * 1024
# Of the slow path's queries while both lanes wait, the established networks' lane gets this
# many in every so many (gtm.geodns.established).
PRIORITY_SHARE = (3, 4)
# The established set's tick (gtm.geodns.established): how often it is updated.
TICK_S = 1.0
# The slow path's time in one loop turn, at most (and at least one query): cached answers wait
# in the kernel's buffer while it runs (gtm.geodns.admission).
SLOW_TURN_S = 0.001
# Of the datagrams an established network's socket behind a flood would drop as unproven
# (gtm.geodns.admission.UNPROVEN), each cookie-speaking network has this many a tick answered
# all the same: a client of it whose cookie went bad (a restarted resolver, an address new to
# its pool, another node's secret) is handed a fresh one, while a forged flood in the
# network's name gets next to nothing.
UNPROVEN_ALLOWANCE = 8
# A socket's queue age is observed on the first read batch after this long since the last: a
# recvmsg and a stamp parsed on every batch would add to the kernel's own cost of stamping
# (3-4% of the listener's capacity at full load); once a millisecond per socket is noise beside
# it, and still plenty of observations.
STAMP_EVERY_S = 0.001


class _Socket:
    """One socket of a listener's group and what its last read found."""

    __slots__ = ("behind", "protected", "shared", "sock", "stamp_after")

    def __init__(self, sock: socket.socket, protected: bool = False) -> None:
        self.sock = sock
        # It serves established networks only (gtm.geodns.established).
        self.protected = protected
        # The last read stopped at a full batch with datagrams still waiting: the reader is
        # behind on this socket.
        self.behind = False
        # Whether its last full batch came from more than one network: only then is a network
        # held to its share of a batch (a large resolver alone is not capped).
        self.shared = False
        # When (time.monotonic()) a read batch next observes its queue age (STAMP_EVERY_S).
        self.stamp_after = 0.0


class FairUdp:
    """A UDP listener that admits the slow path per sender network (gtm.geodns.admission).

    asyncio's datagram transport reads one datagram per loop turn: behind a flood that fills
    the slow path, a cached answer waits for every query read before it, and what the kernel's
    buffer cannot hold meanwhile is dropped whoever sent it. Here the listen address has a
    group of sockets, each sender network steered by the kernel to one of them
    (:mod:`gtm.geodns.steering`), so a flood fills and overflows only its own socket's buffer.
    Each loop turn reads every socket that has datagrams waiting, up to :data:`SOCKET_BATCH`
    each (:data:`READ_BATCH` from a lone socket), and answers those a cache holds at once; the
    others are queued per sender /24 (/56) and drained round robin, ``slow_batch`` a turn, so
    each loop turn reads and answers the cached queries first and gives the slow path a
    bounded slice; one query a turn while the reader is behind (datagrams still waiting after
    a full batch) on any socket."""

    def __init__(
        self,
        socks: list[socket.socket],
        responder: Responder,
        lane: SlowLane[Queued],
        slow_batch: int,
        split: steering.SplitGroup | None = None,
        established: EstablishedNetworks | None = None,
        *,
        queue_age: bool = False,
    ) -> None:
        self.socks = socks
        # Whether the kernel stamps datagrams for gtm_dns_udp_queue_age_seconds (STAMP_EVERY_S).
        self.queue_age = queue_age
        self.responder = responder
        self.lane = lane
        self.slow_batch = slow_batch
        self._loop = asyncio.get_running_loop()
        self._scheduled = False
        self._closed = False
        # With a split group, its first sockets serve the established networks
        # (gtm.geodns.established), whose set a timer updates every TICK_S.
        self.split = split
        self.established = established if split is not None else None
        # With a split group, the slow path of the established networks' sockets waits in a
        # lane of its own, which gets PRIORITY_SHARE of the slow path's queries while both
        # wait: their cache misses (a cache dropped, new subnets) are not one share among
        # every flooding network's, and newcomers still get the rest. Same bounds, counters.
        self.priority: SlowLane[Queued] | None = (
            SlowLane(lane.per_network, lane.total, lane.counts) if split is not None else None
        )
        # Established networks are proven ones (GTM_DNS_ESTABLISH_WITH_COOKIE), and cookies are
        # checked: a protected socket behind a flood drops what a cookie-speaking network's
        # clients would not send, a datagram in its name without a valid cookie (_readable).
        self._proof = (
            self.established is not None
            and self.established.proven is not None
            and responder.cookies is not None
        )
        protected = split.protected if split is not None else 0
        self._sockets = [_Socket(sock, i < protected) for i, sock in enumerate(socks)]
        # Networks read this tick, on the general and on the protected sockets; those over
        # their share on a protected socket (to demote).
        self._seen_general: set[Hashable] = set()
        self._seen_protected: set[Hashable] = set()
        self._over: set[Hashable] = set()
        # Unproven datagrams answered this tick, by network (UNPROVEN_ALLOWANCE).
        self._unproven: dict[Hashable, int] = {}
        self._slow_taken = 0  # queries the slow path took while both lanes waited
        self._read = 0  # datagrams read this tick (what its drops are measured against)
        self._dropped_before = 0
        self._timer: asyncio.TimerHandle | None = None
        self._batch, self._share = (
            (READ_BATCH, TURN_SHARE) if len(socks) == 1 else (SOCKET_BATCH, SOCKET_SHARE)
        )
        # Sockets whose last read stopped at a full batch with datagrams still waiting: while
        # any is, the slow path gets one query a turn until the reader catches up (cached
        # answers first; what a socket's buffer cannot hold the kernel drops, from that socket).
        self._behind = 0
        self._general_behind = 0  # of them, the general sockets of a split group
        # Sender host string -> its network (the queue it waits in); a memo, cleared when full.
        self._networks: dict[str, Hashable] = {}

    def start(self) -> None:
        for state in self._sockets:
            # The kernel stamps each datagram as it queues it: the first of each read batch
            # tells how long queries wait before they are read (gtm_dns_udp_queue_age_seconds).
            if self.queue_age:
                with contextlib.suppress(OSError):
                    state.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self._loop.add_reader(state.sock.fileno(), self._readable, state)
        if self.established is not None:
            self._dropped_before = self._dropped()
            self._timer = self._loop.call_later(TICK_S, self._tick)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for state in self._sockets:
            self._loop.remove_reader(state.sock.fileno())
        self.lane.clear()  # counted as dropped at shutdown
        if self.priority is not None:
            self.priority.clear()
        for state in self._sockets:
            state.sock.close()
        if self.split is not None:
            self.split.close()

    def _dropped(self) -> int:
        """Datagrams lost so far, by the kernel's buffers or by admission."""
        return self.receive_drops() + sum(self.lane.counts.dropped.values())

    def tick(self) -> None:
        """Close a tick of the established set: who was read, whether anything was lost; the
        map follows what it decides."""
        established, split = self.established, self.split
        assert established is not None
        assert split is not None
        dropped = self._dropped()
        calm = is_calm(dropped - self._dropped_before, self._read)
        self._dropped_before, self._read = dropped, 0
        for network in self._over:
            if established.demote(network):
                self._unsteer(network)
        self._over.clear()
        self._unproven.clear()
        general, self._seen_general = self._seen_general, set()
        protected, self._seen_protected = self._seen_protected, set()
        changes = established.end_tick(general, protected, calm=calm)
        for network in changes.removed:
            self._unsteer(network)
        for i, network in enumerate(changes.added):
            try:
                split.add(network)
            except OSError as exc:  # the map full or gone: these are not established after all
                for unwritten in changes.added[i:]:
                    established.forget(unwritten)
                log.warning("dns.established_map_error", error=str(exc))
                break

    def _unsteer(self, network: Hashable) -> None:
        assert self.split is not None
        with contextlib.suppress(OSError):  # not in the map (already out): nothing to undo
            self.split.remove(network)

    def _tick(self) -> None:
        if self._closed:
            return
        try:
            self.tick()
        except Exception as exc:  # the set stays as it was; answering goes on
            self.responder.runtime.failures.record("dns.established", exc)
        self._timer = self._loop.call_later(TICK_S, self._tick)

    def receive_drops(self) -> int:
        """Datagrams the kernel dropped at this listener's full receive buffers."""
        return sum(steering.receive_drops(state.sock) for state in self._sockets)

    def socket_of(self, host: str) -> int:
        """The socket of this listener (its index) that datagrams from ``host`` land on now, as
        the kernel's program picks it (a group this process bound alone, or a split group of
        workers: an index outside this worker's sockets is another worker's)."""
        n = len(self._sockets)
        split = self.split
        if split is None:
            return steering.socket_index(host, n) if n > 1 else 0
        network = sender_network(host)
        if self.established is not None and network in self.established:
            return steering.protected_index(network, split.protected)
        index = steering.split_index(host, split.general, split.protected, split.workers)
        return index - split.base

    def _network(self, host: str) -> Hashable:
        network = self._networks.get(host)
        if network is None:
            if len(self._networks) >= _NETWORK_MEMO:
                self._networks.clear()
            network = self._networks[host] = sender_network(host)
        return network

    def _readable(self, state: _Socket) -> None:
        r = self.responder
        sock = state.sock
        lane = self.lane
        if state.protected and self.priority is not None:
            lane = self.priority
        networks = self._networks
        # Behind (the last batch was full) with other networks sending on this socket: each
        # network's datagrams past its share of this batch are dropped as read.
        share = state.behind and state.shared
        # An established network's socket, behind: a flood forged in the name of networks
        # whose clients speak cookies is told from them by the cookie (a forger never sees
        # ours), dropped before it takes their share of the batch, or demotes them.
        suspect = self._proof and state.protected and state.behind
        taken: dict[Hashable, int] = {}
        batch, turn_share = self._batch, self._share
        if state.protected:
            # Established networks' sockets are read as a lone socket is: the other sockets'
            # turn is bounded below, so these drain at the loop's speed.
            batch, turn_share = READ_BATCH, TURN_SHARE
        elif self._general_behind and self.established:
            # The general sockets are flooded while established networks wait: they get a
            # small batch each per turn, so the turn (what an established query waits behind
            # at most) stays short; the kernel drops the rest of the flood, at no cost here.
            batch, turn_share = GENERAL_BATCH, GENERAL_SHARE
        if not state.behind:
            self._behind += 1
            self._general_behind += not state.protected
        state.behind = True
        # The first datagram of the batch is the oldest waiting: its age is how far behind the
        # reader is on this socket. One recvmsg a batch at most (STAMP_EVERY_S); the rest are
        # read without the stamp.
        stamp = self.queue_age and (at := time.monotonic()) >= state.stamp_after
        if stamp:
            state.stamp_after = at + STAMP_EVERY_S
        for _ in range(batch):
            try:
                if not stamp:
                    data, addr = sock.recvfrom(65535)
                else:
                    stamp = False
                    data, ancillary, _flags, addr = sock.recvmsg(65535, STAMP_SPACE)
                    age = age_of_stamp(ancillary, time.time())
                    if age is not None:
                        r.stats.queue_age[ESTABLISHED if state.protected else GENERAL].observe(age)
            except InterruptedError:
                continue
            except OSError:  # nothing more waiting (BlockingIOError), or an ICMP error
                state.behind = False
                self._behind -= 1
                self._general_behind -= not state.protected
                break
            network = networks.get(addr[0])
            if network is None:
                network = self._network(addr[0])
            if suspect and r.speaks_cookies(network) and not r.cookie_proves(data, addr[0]):
                let = self._unproven.get(network, 0)
                if let >= UNPROVEN_ALLOWANCE:
                    lane.counts.dropped[UNPROVEN] += 1
                    continue
                self._unproven[network] = let + 1
            n = taken.get(network, 0)
            if share and n >= turn_share:
                lane.counts.dropped[OVER_SHARE] += 1
                if state.protected:
                    self._over.add(network)  # an established network flooding: demoted
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
                                exact.last = now
                                self._send(sock, data[:2] + exact.tail, addr)
                                continue
                            if now < exact.until:  # a cookie's entry lapses (Exact.until)
                                exact.n = 1
                                exact.first = exact.last = now
                                r._tallied.append(exact)
                                self._send(sock, data[:2] + exact.tail, addr)
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
                if lane.offer(network, (data, addr, sock)) and not self._scheduled:
                    self._scheduled = True
                    self._loop.call_soon(self._drain)
            elif out is not None:
                self._send(sock, out, addr)
        if state.behind:
            state.shared = len(taken) > 1
        if state.behind and batch == GENERAL_BATCH and receive_queued(sock) < FLOODED_BYTES:
            # A small batch came back full, but no more than a usual batch waits: not flooded
            # (else steady traffic would keep the small batch, and the small batch "behind").
            state.behind = False
            self._behind -= 1
            self._general_behind -= 1
        if self.established is not None:
            (self._seen_protected if state.protected else self._seen_general).update(taken)
            self._read += sum(taken.values())

    def _drain(self) -> None:
        """One turn's slice of the slow path: ``slow_batch`` queued queries, one per network in
        turn; scheduled again for the next turn while any wait."""
        self._scheduled = False
        if self._closed:
            return
        r = self.responder
        lane, priority = self.lane, self.priority
        counts = lane.counts
        # slow_batch queries at most (one while the reader is behind), and no more once
        # SLOW_TURN_S has passed: new subnets or names cost unequal times (a GeoIP look-up, a
        # rendering, a signature), so a count alone does not bound the turn.
        limit = 1 if self._behind else self.slow_batch
        until = time.perf_counter() + SLOW_TURN_S
        for _ in range(limit):
            taken = None
            if priority is not None and priority.size:
                self._slow_taken += 1
                if self._slow_taken % PRIORITY_SHARE[1] < PRIORITY_SHARE[0] or not lane.size:
                    taken = priority.take(1)
            if not taken:
                taken = lane.take(1)
            if not taken:
                break
            data, addr, sock = taken[0]
            counts.admitted += 1
            try:
                out = r.answer_udp(data, addr[0], checked=True)
            except Exception as exc:  # as in _readable
                r.stats.failed += 1
                r.runtime.failures.record("dns.udp", exc, peer=str(addr[0]))
                continue
            if out is not None:
                self._send(sock, out, addr)
            if time.perf_counter() >= until:
                break
        if lane.size or (priority is not None and priority.size):
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _send(self, sock: socket.socket, out: bytes, addr: Any) -> None:
        try:
            sock.sendto(out, addr)
        except OSError as exc:  # the send buffer full (BlockingIOError), or unroutable
            self.responder.stats.send_dropped += 1
            log.debug("dns.udp_send_error", error=str(exc))


_NETWORK_MEMO = 1 << 16  # sender hosts whose network is memoised
