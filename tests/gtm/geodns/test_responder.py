"""The answering path's caches and counters, and the rate limiter, closer up than over dig."""

from __future__ import annotations

import collections
import socket
import time
from ipaddress import ip_address
from pathlib import Path

import dns.message
import pytest
from prometheus_client import REGISTRY, generate_latest

from gtm.audit import query as audit_query
from gtm.audit.database import make_async_engine
from gtm.decision.snapshot import RegionCapacity
from gtm.geodns.groups import UDP_RECEIVE_BUFFER
from gtm.geodns.ratelimit import Limit, ResponseRateLimiter, network_key

from .conftest import StartNode, port_of, raw_udp, tcp, udp
from .test_server import addresses, q

_RMEM = Path("/proc/sys/net/core/rmem_max")
RMEM_MAX = int(_RMEM.read_text()) if _RMEM.exists() else None


async def test_repeated_answers_are_counted_at_the_flush(start_node: StartNode) -> None:
    """Repeats come from the exact-query cache: the first answer is counted at once, the
    repeats are tallied on the entry and reach the counters and the audit at the next flush,
    every one of them, over UDP (IPv4 and IPv6) and TCP."""
    # No periodic flush during the queries (on a loaded machine they can take over a second),
    # and no journal: its ticks (ten a second) drain the tallies into the counters too, and
    # one between two queries made the "repeats wait" counts below flaky (2-5 instead of 1,
    # in 1-4 runs out of 8). The one flush is the test's own.
    node = await start_node(audit_flush_interval_s=3600, audit_journal_interval_s=0)
    stats = node.dns_stats
    for _ in range(5):
        assert addresses(await udp(node, q(ecs=("198.51.100.0", 24)))) == {"192.0.2.40"}
        assert addresses(await udp(node, q("chat.gtm.example.", "AAAA"), host="::1"))
        assert addresses(await tcp(node, q()))
    assert stats.queries["udp", "A", "NOERROR"] == 1  # the repeats wait for the flush
    assert stats.queries["udp", "AAAA", "NOERROR"] == 1
    assert stats.queries["tcp", "A", "NOERROR"] == 1
    assert stats.cache_hits == 0 and stats.cache_misses == 3
    await node.runtime.writer.flush()
    assert stats.queries["udp", "A", "NOERROR"] == 5
    assert stats.queries["udp", "AAAA", "NOERROR"] == 5
    assert stats.queries["tcp", "A", "NOERROR"] == 5
    assert stats.cache_hits == 12 and stats.cache_misses == 3
    exported = generate_latest(REGISTRY).decode()
    assert "gtm_dns_cache_hits_total 12.0" in exported
    assert "gtm_dns_cache_misses_total 3.0" in exported
    assert 'gtm_dns_responses_total{qtype="A",rcode="NOERROR",transport="udp"} 5.0' in exported
    engine = make_async_engine(node.runtime.settings.database_url)
    try:
        assert await audit_query.total_count(engine) == 15
    finally:
        await engine.dispose()


async def test_cached_answers_follow_a_capacity_report_turning_stale(
    start_node: StartNode,
) -> None:
    """Spillover reads fresh reports only: when one turns stale the decision changes without a
    new snapshot, and answers from either cache level must change with it."""
    node = await start_node()
    assert node.dns is not None
    responder = node.dns.responder
    now = time.time()
    node.runtime.swap(
        capacity={
            "eu-central": RegionCapacity(0.97, now, True),
            "eu-west": RegionCapacity(0.30, now, False),  # headroom, proven fresh
        }
    )
    # Client networks in 100.72.0.0/13 are all in Frankfurt (nearest: eu-central).
    queries = [q(ecs=(f"100.72.{i}.0", 24)) for i in range(60)]

    async def regions() -> collections.Counter[str]:
        answers = collections.Counter[str]()
        for query in queries:
            (address,) = addresses(await udp(node, query))
            answers[address] += 1
        return answers

    fresh = await regions()
    assert fresh["192.0.2.40"] < 60 and fresh["192.0.2.30"] > 0  # a share spills to eu-west
    hits = responder.stats.cache_misses
    assert await regions() == fresh  # repeats: the same answers, from the exact-query cache
    assert responder.stats.cache_misses == hits
    stale_after = node.runtime.store.current.topology.routing.spillover.stale_after_s
    responder.clock = lambda: time.time() + stale_after + 1
    assert await regions() == {"192.0.2.40": 60}  # the stale report is ignored


async def test_the_udp_receive_buffer_is_widened(start_node: StartNode) -> None:
    node = await start_node()
    assert node.dns is not None
    if RMEM_MAX is None:
        pytest.skip("Linux only")
    # The kernel caps the request at rmem_max and reports twice what it grants.
    expected = 2 * min(UDP_RECEIVE_BUFFER, RMEM_MAX)
    for sock in node.dns.udp_sockets():
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= expected
    # ...and still answers on both families.
    assert port_of(node, 4) and port_of(node, 6)
    assert addresses(await udp(node, q(), host="::1"))


def test_network_keys_are_the_slash_24_and_slash_56() -> None:
    assert network_key(ip_address("192.0.2.1")) == network_key(ip_address("192.0.2.254"))
    assert network_key(ip_address("192.0.2.1")) != network_key(ip_address("192.0.3.1"))
    assert network_key(ip_address("2001:db8:0:ff::1")) == network_key(ip_address("2001:db8::1"))
    assert network_key(ip_address("2001:db8:0:100::1")) != network_key(ip_address("2001:db8::1"))
    assert network_key(ip_address("0.0.0.1")) != network_key(ip_address("::1"))


def test_rate_limiter_burst_refill_and_slip() -> None:
    now = [1000.0]
    limiter = ResponseRateLimiter(10.0, burst=3.0, slip=2, clock=lambda: now[0])
    key = network_key(ip_address("192.0.2.7"))
    assert [limiter.check_key(key) for _ in range(3)] == [Limit.ANSWER] * 3  # the burst
    # Past it: every second limited response slips (truncated), the others are dropped.
    assert [limiter.check_key(key) for _ in range(4)] == [
        Limit.DROP,
        Limit.SLIP,
        Limit.DROP,
        Limit.SLIP,
    ]
    assert (limiter.limited, limiter.slipped) == (4, 2)
    # Another network is untouched; check() on an address is check_key() on its network.
    assert limiter.check(ip_address("192.0.3.7")) is Limit.ANSWER
    assert limiter.check(ip_address("192.0.2.200")) is Limit.DROP
    now[0] += 0.1  # one token refilled
    assert limiter.check_key(key) is Limit.ANSWER
    assert limiter.check_key(key) is not Limit.ANSWER
    now[0] += 60  # a long pause refills only up to the burst
    assert [limiter.check_key(key) for _ in range(4)][-1] is not Limit.ANSWER


async def test_rate_limited_repeats_are_dropped_even_when_cached(start_node: StartNode) -> None:
    """The limiter runs before the exact-query cache: a cached answer is no way around it."""
    # Loopback is exempt by default (it cannot be spoofed from outside); not here.
    node = await start_node(dns_rate_limit=1.0, dns_rate_slip=0, dns_rate_limit_exempt=())
    wire = q(use_edns=False).to_wire()
    replies = [await raw_udp(node, wire, wait=0.05) for _ in range(10)]
    answered = [r for r in replies if r is not None]
    assert 1 <= len(answered) <= 2  # the burst, and at most one token refilled meanwhile
    assert all(dns.message.from_wire(r).answer for r in answered)
    assert node.dns_stats.rate_limited == 10 - len(answered)
