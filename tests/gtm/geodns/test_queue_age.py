"""How long queries wait in the UDP sockets before the listener reads them
(``gtm_dns_udp_queue_age_seconds``, by lane), over real sockets on loopback.

The test runs in the node's own loop: it sends, then holds the loop (a blocking sleep, which is
the wait being measured, not a stand-in for readiness) so the datagrams age in the kernel's
buffer by at least that long before the listener can read them. A loaded machine only makes
them older, and every bound asserted is a lower one."""

from __future__ import annotations

import socket
import struct
import time

import pytest
from prometheus_client.core import HistogramMetricFamily

from gtm.geodns.stats import (
    ESTABLISHED,
    GENERAL,
    QUEUE_AGE_BUCKETS,
    SO_TIMESTAMPNS,
    Ages,
    DnsCollector,
    DnsStats,
    age_of_stamp,
)
from gtm.node import Node

from .conftest import StartNode, port_of
from .test_established import establish, listener
from .test_fairness import CACHED, receive, sender, with_id

HELD_S = 0.2  # how long the loop is held once the queries are sent


def test_the_age_is_now_less_the_kernels_stamp() -> None:
    stamp = struct.pack("@qq", 1_700_000_000, 250_000_000)
    assert age_of_stamp([(1, SO_TIMESTAMPNS, stamp)], 1_700_000_000.75) == pytest.approx(0.5)
    assert age_of_stamp([], 1_700_000_000.0) is None  # no stamp: nothing observed
    assert age_of_stamp([(1, SO_TIMESTAMPNS, stamp[:8])], 1_700_000_000.0) is None  # cut short
    # The wall clock stepped back after the stamp: no wait, not a negative one.
    assert age_of_stamp([(1, SO_TIMESTAMPNS, stamp)], 1_699_999_999.0) == 0.0


def test_ages_export_as_cumulative_buckets_with_their_sum() -> None:
    ages = Ages()
    for seconds in (0.0001, 0.0003, 0.3, 9.0):  # a bound itself falls in its own bucket
        ages.observe(seconds)
    buckets = dict(ages.cumulative())
    assert buckets["0.0001"] == 1
    assert buckets["0.0005"] == 2
    assert buckets["0.25"] == 2
    assert buckets["0.5"] == 3
    assert buckets["2.5"] == 3
    assert buckets["+Inf"] == 4
    assert len(buckets) == len(QUEUE_AGE_BUCKETS) + 1
    stats = DnsStats()
    stats.queue_age[GENERAL] = ages
    family = next(
        f for f in DnsCollector(stats).collect() if f.name == "gtm_dns_udp_queue_age_seconds"
    )
    assert isinstance(family, HistogramMetricFamily)
    samples = {(s.name, s.labels.get("lane"), s.labels.get("le")): s.value for s in family.samples}
    assert samples[("gtm_dns_udp_queue_age_seconds_bucket", GENERAL, "+Inf")] == 4
    assert samples[("gtm_dns_udp_queue_age_seconds_sum", GENERAL, None)] == pytest.approx(9.3004)
    assert samples[("gtm_dns_udp_queue_age_seconds_count", ESTABLISHED, None)] == 0


async def held_queries(node: Node, source: str, first_id: int) -> None:
    """Five cached queries from ``source``, held in the buffer for HELD_S, then answered."""
    with sender(source) as sock:
        for i in range(5):
            sock.sendto(with_id(CACHED, first_id + i), ("127.0.0.1", port_of(node)))
        time.sleep(HELD_S)  # noqa: ASYNC251 - the loop held: the queries wait in the buffer
        answers = await receive(sock, 5)
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == [first_id + i for i in range(5)]


def older_than(ages: Ages, seconds: float) -> int:
    """Observations above the largest bucket bound below ``seconds``."""
    below = max(i for i, bound in enumerate(QUEUE_AGE_BUCKETS) if bound < seconds)
    return sum(ages.counts[below + 1 :])


async def test_queries_held_in_the_buffer_are_counted_as_old_in_their_own_lane(
    start_node: StartNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gtm.geodns import udp

    monkeypatch.setattr(udp, "TICK_S", 3600.0)  # the test runs the set's ticks itself
    node = await start_node(dns_listen=("127.0.0.1:0",))
    assert node.dns is not None and node.dns.split
    fair = listener(node)
    ages = fair.responder.stats.queue_age
    await establish(node, "127.0.5.1")

    async def held(source: str, first_id: int) -> None:
        await held_queries(node, source, first_id)

    def counts() -> dict[str, tuple[int, int]]:
        """Per lane: observations in all, and those older than HELD_S."""
        return {
            lane: (sum(ages[lane].counts), older_than(ages[lane], HELD_S))
            for lane in (ESTABLISHED, GENERAL)
        }

    before = counts()
    # A network never seen: a general socket. The five queries are read in one batch, which
    # is observed once, by its oldest datagram (its socket's last observation, if any, was
    # more than STAMP_EVERY_S before: the loop was held).
    await held("127.1.9.1", 64_000)
    after_general = counts()
    assert after_general[GENERAL] == (before[GENERAL][0] + 1, before[GENERAL][1] + 1)
    assert after_general[ESTABLISHED] == before[ESTABLISHED]
    await held("127.0.5.1", 64_100)  # the established network: its protected socket
    after = counts()
    assert after[ESTABLISHED] == (before[ESTABLISHED][0] + 1, before[ESTABLISHED][1] + 1)
    assert after[GENERAL] == after_general[GENERAL]


async def test_with_the_measure_off_nothing_is_stamped_or_observed(start_node: StartNode) -> None:
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_queue_age=False)
    fair = listener(node)
    assert all(
        state.sock.getsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS) == 0 for state in fair._sockets
    )
    await held_queries(node, "127.1.9.1", 64_200)
    ages = fair.responder.stats.queue_age
    assert sum(ages[GENERAL].counts) == sum(ages[ESTABLISHED].counts) == 0
