"""Counters of the DNS listeners.

Plain integers on the answering path (a Prometheus child's ``inc()`` takes a lock and a label
lookup per query); a collector turns them into metrics when Prometheus scrapes. Answers given
from the exact-query cache are tallied on their cache entry and folded into ``queries``,
``cache_hits`` and ``truncated`` when the audit writer drains the tallies (each flush), so those
counters trail the answers by up to a flush interval, and always equal what the audit counted.
"""

from __future__ import annotations

import socket
import struct
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from gtm.geodns.admission import (
    NETWORK_FULL,
    OVER_SHARE,
    SHUTDOWN,
    TOTAL_FULL,
    UNPROVEN,
    LaneCounts,
)
from gtm.geodns.established import DEMOTED, EXPIRED, PROMOTED, EstablishedNetworks

# SO_TIMESTAMPNS (<asm-generic/socket.h>; Python's socket module does not name it): the kernel
# then stamps each datagram with the time it was queued, handed back as SCM_TIMESTAMPNS (the
# same number) in recvmsg's ancillary data, two native longs (seconds, nanoseconds).
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")
STAMP_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)  # recvmsg's room for the stamp
# Upper bounds (seconds) of the UDP queue-age histogram: from a short loop turn to the timeouts
# resolvers give up at (1-2 s), where an answer no longer matters.
QUEUE_AGE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
ESTABLISHED = "established"  # the protected sockets of a split group (gtm.geodns.established)
GENERAL = "general"  # every other socket


def age_of_stamp(ancillary: Sequence[tuple[int, int, bytes]], now_s: float) -> float | None:
    """How long a datagram waited in its socket: ``now_s`` (``time.time()``) less the time the
    kernel queued it, from recvmsg's ancillary data; None without a stamp. A wall clock
    stepped back since counts as no wait rather than a negative one."""
    for _level, kind, payload in ancillary:
        if kind == SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
            seconds, nanoseconds = _TIMESPEC.unpack_from(payload)
            return max(0.0, now_s - (int(seconds) + int(nanoseconds) * 1e-9))
    return None


class Ages:
    """A histogram of waits kept as plain integers: an observation costs a bisection and two
    additions (a Prometheus child's ``observe()`` takes a lock); the collector exports it."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(QUEUE_AGE_BUCKETS) + 1)  # the last: above every bound
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(QUEUE_AGE_BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        """(upper bound, observations at or below it), as Prometheus exposes buckets."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*QUEUE_AGE_BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


COOKIE_RESULTS = ("new", "valid", "invalid", "badcookie")


class DnsStats:
    def __init__(self) -> None:
        self.queries: Counter[tuple[str, str, str]] = Counter()  # (transport, qtype, rcode)
        self.truncated = 0
        self.dropped = 0  # unreadable packets and responses sent to us
        self.cache_hits = 0
        self.cache_misses = 0
        self.rate_limited = 0
        self.slipped = 0
        self.tcp_connections = 0
        self.tcp_refused = 0
        self.tcp_messages = 0  # messages read over TCP (each answered, or its connection closed)
        # Answers counted on folded audit rows (per decision and client bucket) because new
        # client networks came faster than the audit writer sealed them (gtm.geodns.shapes).
        self.folded = 0
        # Queries that raised on the answering path (a bug): sent nothing (gtm.failures counts
        # them by exception type too).
        self.failed = 0
        # The slow path's admission per sender network (gtm.geodns.admission).
        self.lane = LaneCounts()
        self.tcp_lane = LaneCounts()  # TCP messages waiting for the slow path (gtm.geodns.tcp)
        # UDP responses the kernel would not take (send buffer full): not sent.
        self.send_dropped = 0
        # Datagrams the kernel dropped at the UDP listeners' full receive buffers, read from
        # the sockets when scraped (the DNS server sets it; the kernel keeps the count).
        self.receive_drops: Callable[[], int] = lambda: 0
        # The established sender networks of the UDP listeners (gtm.geodns.established), one
        # set per listen address; empty where the kernel took no split program.
        self.established: list[EstablishedNetworks] = []
        # How long the oldest datagram had waited in a UDP socket when the listener began a
        # read of it (gtm.geodns.udp; at most once a millisecond per socket), by lane: how far
        # behind the reader was, as the sender saw it, which a flood pushes up on the general
        # sockets and, if the protection works, not on the established networks' own.
        self.queue_age: dict[str, Ages] = {ESTABLISHED: Ages(), GENERAL: Ages()}
        # DNS cookies checked on the slow path (gtm.geodns.cookies), by what the query brought:
        # a client cookie alone ("new"), a valid server cookie ("valid"), one not ours or out
        # of date ("invalid"); and those answered BADCOOKIE ("badcookie", with
        # GTM_DNS_REQUIRE_COOKIE). A repeat of exact bytes answered from the first level
        # is not checked again.
        self.cookies: Counter[str] = Counter()


class DnsCollector(Collector):
    def __init__(self, stats: DnsStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats
        queries = CounterMetricFamily(
            "gtm_dns_responses", "DNS responses sent", labels=["transport", "qtype", "rcode"]
        )
        for (transport, qtype, rcode), n in sorted(s.queries.items()):
            queries.add_metric([transport, qtype, rcode], n)
        yield queries
        for name, doc, value in (
            ("gtm_dns_truncated", "UDP responses sent truncated (TC)", s.truncated),
            ("gtm_dns_dropped", "packets dropped without an answer", s.dropped),
            ("gtm_dns_cache_hits", "answers served from the rendered-answer cache", s.cache_hits),
            ("gtm_dns_cache_misses", "answers rendered afresh", s.cache_misses),
            ("gtm_dns_rate_limited", "responses over the rate limit", s.rate_limited),
            ("gtm_dns_rate_limit_slipped", "rate-limited responses sent truncated", s.slipped),
            (
                "gtm_dns_tcp_refused",
                "TCP connections refused at the cap, or closed for a newcomer of a smaller network",
                s.tcp_refused,
            ),
            ("gtm_dns_tcp_messages", "DNS messages read over TCP connections", s.tcp_messages),
            ("gtm_dns_folded", "answers counted on folded audit rows (a client bucket)", s.folded),
            ("gtm_dns_failed", "queries that raised while answered: nothing sent", s.failed),
            (
                "gtm_dns_slow_deferred",
                "UDP queries no cache held, queued for the slow path per sender network",
                s.lane.deferred,
            ),
            (
                "gtm_dns_slow_admitted",
                "queued UDP queries taken from the queues and answered the slow way",
                s.lane.admitted,
            ),
            ("gtm_dns_send_dropped", "UDP responses the send buffer refused", s.send_dropped),
            (
                "gtm_dns_receive_dropped",
                "UDP queries the kernel dropped at a full receive buffer, before they were read "
                "(each sender network fills its own socket's: gtm.geodns.steering)",
                s.receive_drops(),
            ),
            (
                "gtm_dns_tcp_slow_deferred",
                "TCP messages no first-level cache held, queued per sender network",
                s.tcp_lane.deferred,
            ),
            (
                "gtm_dns_tcp_slow_admitted",
                "queued TCP messages taken from the queues and answered the slow way",
                s.tcp_lane.admitted,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        dropped = CounterMetricFamily(
            "gtm_dns_slow_dropped",
            "UDP queries dropped before the slow path, by reason (gtm.geodns.admission)",
            labels=["reason"],
        )
        for reason in (NETWORK_FULL, TOTAL_FULL, SHUTDOWN, OVER_SHARE, UNPROVEN):
            dropped.add_metric([reason], s.lane.dropped[reason])
        yield dropped
        cookies = CounterMetricFamily(
            "gtm_dns_cookies",
            "DNS cookies checked on the slow path, by what the query brought (gtm.geodns.cookies)",
            labels=["result"],
        )
        for result in COOKIE_RESULTS:
            cookies.add_metric([result], s.cookies[result])
        yield cookies
        yield GaugeMetricFamily(
            "gtm_dns_slow_queued", "UDP queries waiting for the slow path", value=s.lane.queued
        )
        yield GaugeMetricFamily(
            "gtm_dns_tcp_slow_queued",
            "TCP messages waiting for the slow path",
            value=s.tcp_lane.queued,
        )
        yield GaugeMetricFamily(
            "gtm_dns_tcp_connections", "open TCP connections", value=s.tcp_connections
        )
        yield GaugeMetricFamily(
            "gtm_dns_established_networks",
            "sender networks steered to the protected UDP sockets (gtm.geodns.established)",
            value=sum(len(e) for e in s.established),
        )
        changes = CounterMetricFamily(
            "gtm_dns_established_changes",
            "sender networks established, expired (idle) or demoted (over their share)",
            labels=["change"],
        )
        for change in (PROMOTED, EXPIRED, DEMOTED):
            changes.add_metric([change], sum(e.changes[change] for e in s.established))
        yield changes
        ages = HistogramMetricFamily(
            "gtm_dns_udp_queue_age_seconds",
            "how long the oldest query in a UDP socket had waited when a read of it began "
            "(the kernel's receive stamp), by lane: established (the protected sockets) or "
            "general",
            labels=["lane"],
        )
        for lane, histogram in s.queue_age.items():
            ages.add_metric([lane], histogram.cumulative(), histogram.total)
        yield ages


def register(stats: DnsStats) -> DnsCollector:
    collector = DnsCollector(stats)
    REGISTRY.register(collector)
    return collector


def unregister(collector: DnsCollector) -> None:
    REGISTRY.unregister(collector)
