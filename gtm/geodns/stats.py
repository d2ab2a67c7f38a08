"""Counters of the DNS listeners.

Plain integers on the answering path (a Prometheus child's ``inc()`` takes a lock and a label
lookup per query); a collector turns them into metrics when Prometheus scrapes. Answers given
from the exact-query cache are tallied on their cache entry and folded into ``queries``,
``cache_hits`` and ``truncated`` when the audit writer drains the tallies (each flush), so those
counters trail the answers by up to a flush interval, and always equal what the audit counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from gtm.geodns.admission import NETWORK_FULL, OVER_SHARE, SHUTDOWN, TOTAL_FULL, LaneCounts
from gtm.geodns.established import DEMOTED, EXPIRED, PROMOTED, EstablishedNetworks


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


class DnsCollector(Collector):
    def __init__(self, stats: DnsStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
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
        for reason in (NETWORK_FULL, TOTAL_FULL, SHUTDOWN, OVER_SHARE):
            dropped.add_metric([reason], s.lane.dropped[reason])
        yield dropped
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


def register(stats: DnsStats) -> DnsCollector:
    collector = DnsCollector(stats)
    REGISTRY.register(collector)
    return collector


def unregister(collector: DnsCollector) -> None:
    REGISTRY.unregister(collector)
