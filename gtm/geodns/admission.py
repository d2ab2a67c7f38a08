"""Admission of the DNS slow path: fair queues per sender network for the queries no cache
answers (DESIGN.md rule 9: work that misses every cache is admitted per sender after cached
answers, so a flood costs its sender, not other clients).

The UDP listener (:mod:`gtm.geodns.server`) answers every query a cache holds as it reads it;
one that would need parsing, a GeoIP lookup or a rendering (a new client subnet, a new name) is
offered here under its sender's network (/24, /56) instead, and a drain that runs once per loop
turn takes a bounded batch, one query per network in turn (round robin). So a network flooding
new subnets or names gets the slow path's capacity only in its share, however fast it sends;
queries beyond a network's queue bound, or the bound of all queues together, are dropped and
counted by reason, never silently. A large resolver alone on an idle node is not capped: its
queue may grow past its bound while no other network waits, and drains at the slow path's full
speed; only when others wait too does it get a share (and gives up its oldest queries past its
bound to make room for them).

Pure logic: no socket, no clock. Queue memory is bounded by ``total`` queries (each its bytes
and the sender's address).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from ipaddress import IPv6Address, ip_address
from typing import Generic, TypeVar

from gtm.geodns.ratelimit import network_key

T = TypeVar("T")

# Reasons a query waiting for the slow path is dropped (the label of gtm_dns_slow_dropped).
NETWORK_FULL = "network_full"  # its sender network's queue was at its bound
TOTAL_FULL = "total_full"  # all queues together were at their bound
SHUTDOWN = "shutdown"  # still queued when the listener stopped
# Dropped as read, before any cache was looked at: its network had its share of a read batch
# while the reader was behind (gtm.geodns.udp.TURN_SHARE).
OVER_SHARE = "over_share"
# Dropped as read: on an established network's socket behind a flood, a datagram without a
# valid DNS cookie from a network whose clients bring one (forged in its name, most likely:
# gtm.geodns.udp).
UNPROVEN = "unproven"


def sender_network(host: str) -> Hashable:
    """The network a UDP sender's queries wait under, from the host string its socket gives:
    an IPv4 /24 (as its first three octets), an IPv6 /56 (gtm.geodns.ratelimit.network_key);
    an IPv4 sender on a dual-stack socket under its own /24, not one /56 for them all.

    >>> sender_network("192.0.2.7") == sender_network("::ffff:192.0.2.9")
    True
    >>> sender_network("2001:db8:0:ff::1") == sender_network("2001:db8::1%eth0")
    True
    """
    if ":" not in host:
        return host[: host.rfind(".")]
    address = ip_address(host.split("%", 1)[0])
    mapped = address.ipv4_mapped if isinstance(address, IPv6Address) else None
    if mapped is not None:
        return sender_network(str(mapped))
    return network_key(address)


class LaneCounts:
    """Counters of every lane of a DNS server, summed (the stats' ``lane``; plain integers on
    the answering path, turned into metrics when Prometheus scrapes)."""

    __slots__ = ("admitted", "deferred", "dropped", "peak", "queued")

    def __init__(self) -> None:
        # Queries queued for the slow path: each is then admitted, pushed out (a drop counted
        # as NETWORK_FULL), dropped at shutdown, or still queued.
        self.deferred = 0
        self.admitted = 0  # queries taken from the queues and answered the slow way
        self.dropped: Counter[str] = Counter()  # by reason
        self.queued = 0  # waiting now
        self.peak = 0  # the most ever waiting at once in one lane


class SlowLane(Generic[T]):
    """Per-network FIFO queues drained round robin, bounded per network and in all.

    A network alone in the lane may queue past its bound, up to the total (a large resolver on
    an otherwise idle node is not capped); once others wait, it takes no more, and a newcomer
    that finds the total full takes the place of its oldest query (counted as
    :data:`NETWORK_FULL`: it was past its network's bound).

    >>> lane: SlowLane[str] = SlowLane(per_network=2, total=3)
    >>> [lane.offer(k, q) for k, q in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1")]]
    [True, True, True, True]
    >>> lane.offer("a", "a4"), lane.take(3)
    (False, ['a2', 'b1', 'a3'])
    """

    __slots__ = ("_borrower", "_queues", "_turns", "counts", "per_network", "size", "total")

    def __init__(self, per_network: int, total: int, counts: LaneCounts | None = None) -> None:
        if per_network < 1 or total < 1:
            raise ValueError("queue bounds must be positive")
        self.per_network = per_network
        self.total = total
        self.counts = counts if counts is not None else LaneCounts()
        self._queues: dict[Hashable, deque[T]] = {}
        # The networks with queries waiting, in the order they are served next.
        self._turns: deque[Hashable] = deque()
        # The network whose queue is past its bound (it grew so while alone): at most one.
        self._borrower: Hashable | None = None
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def networks(self) -> int:
        """How many sender networks have queries waiting."""
        return len(self._queues)

    def full(self, network: Hashable) -> bool:
        """Whether an offer from ``network`` would be dropped for its own queue: at its bound
        while other networks wait, or at the total alone."""
        queue = self._queues.get(network)
        if queue is None or len(queue) < self.per_network:
            return False
        return len(self._queues) > 1 or len(queue) >= self.total

    def offer(self, network: Hashable, item: T) -> bool:
        """Queue ``item`` under its sender ``network``; False (counted) when it is dropped."""
        counts = self.counts
        queues = self._queues
        queue = queues.get(network)
        waiting = 0 if queue is None else len(queue)
        if waiting >= self.per_network and (len(queues) > 1 or waiting >= self.total):
            counts.dropped[NETWORK_FULL] += 1
            return False
        if self.size >= self.total:
            if not self._push_out(network):
                counts.dropped[TOTAL_FULL] += 1
                return False
            queue = queues.get(network)
        if queue is None:
            queue = queues[network] = deque()
            self._turns.append(network)
        queue.append(item)
        if len(queue) > self.per_network:
            self._borrower = network
        self.size += 1
        counts.deferred += 1
        counts.queued += 1
        if self.size > counts.peak:
            counts.peak = self.size
        return True

    def _push_out(self, network: Hashable) -> bool:
        """Make room for ``network`` (within its bound) by dropping the oldest query of the
        network past its bound, if any; whether room was made."""
        borrower = self._borrower
        if borrower is None or borrower == network:
            return False
        queue = self._queues[borrower]
        queue.popleft()
        if len(queue) <= self.per_network:
            self._borrower = None
        self.size -= 1
        self.counts.queued -= 1
        self.counts.dropped[NETWORK_FULL] += 1
        return True

    def take(self, n: int) -> list[T]:
        """Up to ``n`` queued items, one per network in turn."""
        out: list[T] = []
        turns, queues = self._turns, self._queues
        while turns and len(out) < n:
            network = turns.popleft()
            queue = queues[network]
            out.append(queue.popleft())
            if queue:
                turns.append(network)
            else:
                del queues[network]
            if network == self._borrower and len(queue) <= self.per_network:
                self._borrower = None
        self.size -= len(out)
        self.counts.queued -= len(out)
        return out

    def clear(self) -> int:
        """Drop everything queued (counted as :data:`SHUTDOWN`); how many were dropped."""
        n = self.size
        self._queues.clear()
        self._turns.clear()
        self._borrower = None
        self.size = 0
        self.counts.queued -= n
        self.counts.dropped[SHUTDOWN] += n
        return n
