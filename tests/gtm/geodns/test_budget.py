"""Floods against the DNS path's memory budget and the audit (issue 17, DESIGN.md rule 8).

No timing here: the floods are a few hundred queries against a tiny budget, and what is checked
is what the tables hold and what the audit writes. The rates and peak memory under real floods
(5k, 200k and 2M subnets, random names) are ``bench/dns/flood.py``'s.
"""

from __future__ import annotations

import dataclasses
import doctest
import random
import time
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from pathlib import Path

import dns.message
import dns.rcode

from gtm.admin.replay import replay
from gtm.audit import query as audit_query
from gtm.decision import geoip, memos, routing
from gtm.decision.memos import MemoLimits
from gtm.geodns import wire
from gtm.geodns.budget import SHARES, Admitted, Budget, Generations
from gtm.geodns.ratelimit import Limit, ResponseRateLimiter, network_key
from gtm.geodns.render import compress
from gtm.geodns.responder import Responder, udp_limit
from gtm.geodns.wire import Query, parse_query
from gtm.geodns.zone import answer
from gtm.node import Node
from gtm.settings import Settings
from tests.support.geoip import WORLD, build_city_db

from .conftest import StartNode, audited, raw_udp, tcp, udp
from .test_server import addresses, q
from .test_shapes import _geolite

WITHIN_S = 30.0  # a reply's timeout: generous on a busy machine, not a measured time
TINY_MB = 0.05  # a few dozen entries per table (gtm.geodns.budget)


def responder_of(node: Node) -> Responder:
    assert node.dns is not None
    return node.dns.responder


def random_subnets(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [str(IPv4Address(rng.getrandbits(24) << 8)) for _ in range(n)]


def test_generations_keep_what_is_used_and_never_exceed_the_limit() -> None:
    table: Generations[int, str] = Generations(limit=10)
    table.put(-1, "hot")
    for i in range(1000):
        table.put(i, "once")
        assert len(table) <= 10
        if i % 3 == 0:
            assert table.get(-1) == "hot"  # used every few insertions: never dropped
    assert table.get(0) is None  # seen once, long ago: gone with its generation


def test_admitted_holds_a_share_of_a_cycled_working_set_too_large_for_it() -> None:
    """A large resolver population, or a random-subnet flood looping over its set, asks for
    more subnets in turn than the memo holds. Two generations then never hit (each entry is
    dropped before its turn comes again); Admitted keeps what it took and hits on that."""
    generations: Generations[int, int] = Generations(limit=100)
    admitted: Admitted[int, int] = Admitted(limit=100)
    hits = {"generations": 0, "admitted": 0}
    for _ in range(3):
        for key in range(150):
            if generations.get(key) is not None:
                hits["generations"] += 1
            else:
                generations.put(key, key)
            if admitted.map.get(key) is not None:
                hits["admitted"] += 1
            else:
                admitted.put(key, key)
            assert len(generations) <= 100 and len(admitted) <= 100
    assert hits["generations"] == 0
    assert hits["admitted"] == 2 * 100  # the first 100, on the second and third rounds


def test_admitted_starts_afresh_when_the_population_moves_on() -> None:
    admitted: Admitted[int, str] = Admitted(limit=10)
    for key in range(10):
        admitted.put(key, "old")
    for key in range(100, 119):  # 19 misses: still the old population
        admitted.put(key, "new")
    assert admitted.map.get(0) == "old" and admitted.map.get(100) is None
    admitted.put(119, "new")  # the 20th miss: twice what it holds
    assert admitted.map == {119: "new"}
    for key in range(120, 129):
        admitted.put(key, "new")
    assert len(admitted) == 10 and admitted.map.get(0) is None


async def test_the_memo_of_subnets_keeps_no_more_renderings_alive_than_its_budget(
    start_node: StartNode,
) -> None:
    """The memo's faces keep their renderings (answers with their audit records) alive after
    the tables that bound them let go. A sender making a new query shape for each subnet (here:
    another EDNS buffer size each time; spoofed senders would do as well) made every memo entry
    pin another rendering: hundreds of megabytes within the memo's limit. Past twice the class
    budget of renderings the memo starts afresh."""
    node = await start_node(dns_cache_budget_mb=TINY_MB)
    responder = responder_of(node)
    # Room for every shape and subnet of the test: only renderings bound what the memo pins.
    responder.budget = dataclasses.replace(
        responder.budget, shapes=4096, subnet_entries=10**5, audit_records=10**5
    )
    responder._subnets = Admitted(10**5)
    limit = 2 * responder.budget.class_entries
    subnets = random_subnets(12 * limit, seed=11)
    for i in range(0, len(subnets), 2):
        # The slow path answers the first and makes the shape; the ECS path, the second.
        for subnet in subnets[i : i + 2]:
            query = q(ecs=(subnet, 24))
            query.use_edns(0, payload=600 + i, options=query.options)
            assert addresses(await udp(node, query))  # answered, wherever the subnet is
        alive = {id(face.placed) for face in responder._subnets.map.values()}
        assert len(alive) <= limit + 1, i
    await node.runtime.writer.flush()
    assert node.runtime.writer.counted == len(subnets)  # every answer counted


async def test_distinct_subnets_keep_every_cache_within_its_budget(
    start_node: StartNode,
) -> None:
    budget = Budget.from_mb(TINY_MB)
    node = await start_node(dns_cache_budget_mb=TINY_MB)
    responder = responder_of(node)
    hot = q(ecs=("198.51.100.0", 24))
    hits_before = None
    for i, subnet in enumerate(random_subnets(400, seed=1)):
        if i % 8 == 0:
            # Drain the audit backlog as the writer would: a budget this small sheds new
            # decisions past a dozen or so (test_new_decisions_past_the_audit_budget_...).
            await node.runtime.writer.flush()
        reply = await udp(node, q(ecs=(subnet, 24)))
        assert reply.rcode() == dns.rcode.NOERROR
        exact, rendered = responder.cached_entries()
        assert exact <= budget.exact_entries and rendered <= budget.rendered_entries, i
        if i % 4 == 0:  # a busy resolver's client keeps asking among the flood
            assert addresses(await udp(node, hot)) == {"192.0.2.40"}
            if i == 40:
                await node.runtime.writer.flush()
                hits_before = node.dns_stats.cache_hits
    await node.runtime.writer.flush()
    # The hot query stayed cached through the flood: its repeats were hits, not re-renders.
    assert hits_before is not None and node.dns_stats.cache_hits - hits_before >= 80
    # Every answer is still counted (DESIGN.md rule 2), whatever was evicted.
    assert node.runtime.writer.counted == 400 + 100


async def test_a_random_name_flood_makes_a_bounded_number_of_audit_rows(
    start_node: StartNode,
) -> None:
    # One seal, the test's own: a timed one in the middle would write a record answered on both
    # sides of it twice (a row per window), and the count below is of records.
    node = await start_node(dns_cache_budget_mb=TINY_MB, audit_flush_interval_s=3600)
    rng = random.Random(7)
    flood = 600
    for i in range(flood):
        label = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
        # Names under the zone, outside it, and a few random types: all attacker entropy.
        name = f"{label}.gtm.example." if i % 3 else f"{label}.example.net."
        rdtype = rng.choice(["A", "AAAA", "TXT", f"TYPE{rng.randrange(1000, 60000)}"])
        ecs = (random_subnets(1, seed=i)[0], 24) if i % 2 else None
        await udp(node, q(name, rdtype, ecs=ecs))
    # Malformed packets with random names in the question: aggregated too.
    for i in range(50):
        bad = bytearray(q(f"x{i}y{rng.random()}.gtm.example.", use_edns=False).to_wire())
        assert await raw_udp(node, bytes(bad) + b"\x00") is not None  # trailing byte: FORMERR
    rows = await audited(
        node, "SELECT name, outcome, query_type, client_network, count FROM decisions"
    )
    # One row per (zone, outcome, type known by name or "other", response, sender bucket):
    # a handful, not one per name. The sender is loopback: one bucket. The flood's types are
    # A, AAAA, TXT (known by name since the zone has static records) and random others: at
    # most 3 zone/outcome/response shapes x 2 names x 4 types.
    assert len(rows) <= 24, rows
    assert {r.name for r in rows} <= {"*.gtm.example.", "*."}
    assert {r.client_network for r in rows} == {"127.0.0.0/16"}
    assert sum(r.count for r in rows) == flood + 50  # every answer counted


async def test_names_that_do_not_exist_share_one_rendering_byte_for_byte(
    start_node: StartNode,
) -> None:
    """A random-name flood under the zone: every answer is the one answer() gives that name
    (question, flags, SOA, OPT and ECS echo: the same bytes, compressed), from one rendering
    per query shape, sender bucket and name length rather than one per name (compressed
    names after the question point past it), with no first-level entry per name; and
    each sender's answers are counted on its own bucket's row, whatever the ECS. A name asked
    for again by the same sender gets its first-level entry."""
    node = await start_node(audit_flush_interval_s=3600)
    responder = responder_of(node)
    snapshot = node.runtime.store.current
    rng = random.Random(11)
    senders = ("127.0.0.1", "127.1.0.1")  # two /16 buckets
    per_sender = 160
    shapes = 5
    keys: set[tuple[str, int, int]] = set()
    for sender in senders:
        for i in range(per_sender):
            length = rng.choice((5, 17, 40))  # names of a few lengths: renderings shared
            label = "".join(rng.choice("abcdefghijKLMNOPQRS0123456789-") for _ in range(length))
            name = f"x{label}.{'deep.' * (i % 3)}Gtm.Example."
            kind = i % shapes
            if kind == 0:
                query = q(name, "A")
            elif kind == 1:
                query = q(name, "AAAA", use_edns=0, payload=1232)
            elif kind == 2:
                # Random ECS subnets (the same ones from both senders): patched into one
                # rendering, counted on the sender's row.
                query = q(name, "A", ecs=(random_subnets(1, seed=i)[0], 24))
            elif kind == 3:
                query = q(name, "A", ecs=(f"2a00:{i:x}::", 56))
            else:
                query = q(name, "A", ecs=("0.0.0.0", 0))  # a client that opted out
            wire = query.to_wire()
            got = await raw_udp(node, wire, wait=WITHIN_S, source=sender)
            parsed = parse_query(wire)
            assert isinstance(parsed, Query)
            full = answer(parsed, ip_address(sender), snapshot, time.time(), udp_limit(parsed.edns))
            assert full.rcode == dns.rcode.NXDOMAIN
            assert got == compress(full.wire), name
            keys.add((sender, kind, len(parsed.qname)))
    # One rendering per (sender bucket, query shape, name length), not one per name.
    assert responder.stats.cache_misses <= len(keys) <= len(senders) * shapes * 9
    assert responder.cached_entries()[0] == 0  # no first-level entry (nor sender table)
    again = q("typo.gtm.example.", "A").to_wire()
    for _ in range(3):
        assert await raw_udp(node, again, wait=WITHIN_S) is not None
    assert responder.cached_entries()[0] == 1 + 1  # the name asked again, its sender's table
    await node.runtime.writer.flush()
    rows = await audited(node, "SELECT name, client_network, count FROM decisions")
    by_bucket: dict[str, int] = {}
    for row in rows:
        assert row.name == "*.gtm.example."
        by_bucket[row.client_network] = by_bucket.get(row.client_network, 0) + row.count
    assert by_bucket == {"127.0.0.0/16": per_sender + 3, "127.1.0.0/16": per_sender}


async def test_random_types_make_a_bounded_number_of_metric_labels(
    start_node: StartNode,
) -> None:
    node = await start_node()
    for t in random.Random(3).sample(range(1000, 60000), 200):
        await udp(node, q("chat.gtm.example.", f"TYPE{t}"))
    await node.runtime.writer.flush()
    assert {k[1] for k in node.dns_stats.queries} <= {"other"}


def test_spoofed_random_sources_do_not_flush_a_limited_network() -> None:
    """Before, a full table was cleared and the limited network started afresh with a full
    burst: a flood from random spoofed sources was a way around the limit."""
    now = [1000.0]
    limiter = ResponseRateLimiter(1.0, burst=2.0, slip=0, clock=lambda: now[0], max_entries=64)
    victim = network_key(ip_address("192.0.2.7"))
    assert [limiter.check_key(victim) for _ in range(3)][-1] is Limit.DROP
    rng = random.Random(5)
    for _ in range(5000):
        limiter.check(IPv4Address(rng.getrandbits(32)))
        assert len(limiter) <= 64
        assert limiter.check_key(victim) is Limit.DROP  # still over its limit, every time


def test_exempt_networks_are_never_limited() -> None:
    limiter = ResponseRateLimiter(1.0, burst=1.0, slip=0, exempt=(ip_network("127.0.0.0/8"),))
    assert all(limiter.check_host("127.0.0.1") is Limit.ANSWER for _ in range(10))
    assert [limiter.check_host("192.0.2.1") for _ in range(2)] == [Limit.ANSWER, Limit.DROP]


def test_rate_limiting_is_on_by_default_and_spares_loopback() -> None:
    settings = Settings()
    assert settings.dns_rate_limit > 0
    assert "127.0.0.0/8" in settings.dns_rate_limit_exempt


async def _per_subnet_node(start_node: StartNode, tmp_path: Path, subnets: list[str]) -> Node:
    """A node on a tiny budget whose GeoIP database gives each subnet a network (and a place)
    of its own, so each is a new decision; no timed flush and no early wake: the backlog only
    drains when the test flushes."""
    world = {
        **WORLD,
        **{f"{s}/24": ("DE", "EU", 50.0 + i / 100, 8.68) for i, s in enumerate(subnets)},
    }
    node = await start_node(
        dns_cache_budget_mb=TINY_MB,
        audit_flush_interval_s=3600,
        audit_max_pending=10**6,
        geoip_path=build_city_db(tmp_path / "per-subnet.mmdb", world),
    )
    await node.runtime.writer.flush()  # whatever start-up counted
    return node


async def _answers_by_client(node: Node) -> dict[str, int]:
    """Answers for chat.gtm.example. in the audit store, by recorded client network."""
    rows = await audited(
        node,
        "SELECT client_network, SUM(count) FROM decisions"
        " WHERE name = 'chat.gtm.example.' GROUP BY client_network",
    )
    return {network: int(n) for network, n in rows}


async def test_new_decisions_past_the_audit_budget_are_folded_until_the_writer_drains(
    start_node: StartNode, tmp_path: Path
) -> None:
    """Each decision for a client network not seen before is a new audit row. Past the budget's
    backlog of them (before: the backlog grew with the flood, 823 MiB after 40 s of random
    subnets; then: such queries were shed unanswered), the ECS path counts new networks'
    answers per decision and client /8 until the writer seals (gtm.geodns.shapes): every query
    is answered and counted, on a bounded number of rows."""
    # Decisions are made (and audited) per GeoIP network (gtm.geodns.precision).
    limit = Budget.from_mb(TINY_MB).audit_records
    subnets = [f"100.{64 + i // 200}.{i % 200}.0" for i in range(limit + 40)]
    node = await _per_subnet_node(start_node, tmp_path, subnets)
    assert responder_of(node).budget.audit_records == limit
    writer = node.runtime.writer
    counted = writer.counted
    for subnet in subnets:
        assert addresses(await udp(node, q(ecs=(subnet, 24)))) == {"192.0.2.40"}
    rows = await _answers_by_client(node)
    assert writer.counted - counted == len(subnets)  # every answer counted
    # The first ``limit`` networks have rows of their own; the rest share the /8's row.
    assert len(rows) == limit + 1
    assert rows["100.0.0.0/8"] == 40
    assert node.dns_stats.folded == 40
    assert all(rows[f"{s}/24"] == 1 for s in subnets[:limit])
    # The writer has sealed: a network counted on the /8's row gets a row of its own again.
    await udp(node, q(ecs=(subnets[-1], 24)))
    after = await _answers_by_client(node)
    assert after["100.0.0.0/8"] == 40 and after[f"{subnets[-1]}/24"] == 1
    # A query without ECS needing a new decision meanwhile (TCP: the full path) is folded by
    # its sender's address, and its row claims no ECS.
    responder_of(node)._new_decisions = limit  # the backlog full again
    await tcp(node, q())
    plain = await audited(
        node, "SELECT ecs_prefix FROM decisions WHERE client_network = '127.0.0.0/8'"
    )
    assert plain == [(None,)]
    # Searching for a client of the flood finds the folded row; its replay says what it is.
    found, _ = await audit_query.search(
        node.runtime.engine,
        audit_query.Filters(client_network=f"{subnets[-2]}/24", name="chat.gtm.example."),
    )
    assert [r["client_network"] for r in found] == ["100.0.0.0/8"]
    replayed = replay(found[0], node.runtime.store.current, time.time())
    assert any("folded row" in note for note in replayed.notes)


async def test_a_flood_past_even_the_folded_budget_is_answered_on_one_row_per_decision(
    start_node: StartNode, tmp_path: Path
) -> None:
    """Folded rows are bounded too: past ``fold_entries`` of them (decisions times /8s) in one
    seal window, answers are counted on the decision's row for every client (0.0.0.0/0). No
    query is dropped (before: such queries went unanswered, and a closed-loop client stalled
    on each one: goodput fell to a tenth)."""
    budget = Budget.from_mb(TINY_MB)
    # One /24 (a GeoIP network of its own) in each of many /8s: a precise row each up to the
    # audit limit, then a folded /8 row each up to the fold limit, then the /0 row.
    firsts = [f for f in range(1, 224) if f not in (10, 100, 127)]
    firsts = firsts[: budget.audit_records + budget.fold_entries + 7]
    subnets = [f"{first}.1.2.0" for first in firsts]
    node = await _per_subnet_node(start_node, tmp_path, subnets)
    writer = node.runtime.writer
    counted = writer.counted
    for subnet in subnets:
        assert addresses(await udp(node, q(ecs=(subnet, 24)))) == {"192.0.2.40"}
    rows = await _answers_by_client(node)
    assert writer.counted - counted == len(subnets)
    assert sum(1 for n in rows if n.endswith("/24")) == budget.audit_records
    assert sum(1 for n in rows if n.endswith("/8")) == budget.fold_entries
    assert rows["0.0.0.0/0"] == 7
    assert node.dns_stats.folded == budget.fold_entries + 7


def test_the_shares_of_the_budget_make_the_whole_of_it() -> None:
    """Every table's share, the GeoIP memos' included, adds up to the configured figure."""
    assert abs(sum(SHARES) - 1.0) < 1e-9


def slow_path_memos(node: Node) -> dict[str, int]:
    """Entries held now by each memo of the slow path (gtm.decision.memos, gtm.geodns.wire)."""
    snapshot = node.runtime.store.current
    geo = snapshot.geo
    return {
        "plans": len(snapshot.plans),
        "rankings": len(snapshot.ranks),
        "verdicts": len(snapshot.verdicts),
        "client networks": len(routing._NETWORKS),
        "GeoIP networks": len(geoip._NETWORKS),
        "GeoIP locations": len(geo._buckets4) + len(geo._buckets6) + len(geo._exact),
        "names": len(wire._NAMES),
        "OPT records": len(wire._OPTS),
        "senders": len(wire._ADDRESSES),
    }


async def test_queries_the_fast_paths_cannot_take_keep_the_slow_paths_memos_in_the_budget(
    start_node: StartNode,
) -> None:
    """ECS sources longer than the audit's precision (/32, /64) go past the ECS path to the
    slow path, which memoises their OPT records, GeoIP locations and networks, and a plan and
    ranking per place; queries without ECS from many senders fill the sender and client-network
    memos. Those memos had fixed caps (8,192 plans, 16,384 of the rest: some 35 MiB filled by
    such a flood) outside the budget; each is now bounded by its share."""
    # The process-wide memos as a new process starts them (earlier tests filled them).
    for memo in (routing._NETWORKS, geoip._NETWORKS, wire._NAMES, wire._OPTS, wire._ADDRESSES):
        memo.clear()
    # The bundled GeoLite2: random subnets land in thousands of places (the test database has
    # a handful).
    node = await start_node(dns_cache_budget_mb=TINY_MB, geoip_path=_geolite())
    limits = MemoLimits.from_mb(TINY_MB)
    parsed = Budget.from_mb(TINY_MB).parsed_entries
    bound = {
        "plans": limits.plans,
        "rankings": limits.plans,
        "verdicts": limits.plans,
        "client networks": limits.networks,
        "GeoIP networks": limits.networks,
        "GeoIP locations": limits.locations,
        "names": parsed,
        "OPT records": parsed,
        "senders": parsed,
    }
    rng = random.Random(3)
    flood = 6 * limits.networks
    peak = dict.fromkeys(bound, 0)
    for i in range(flood):
        source = None
        if i % 3 == 0:  # no ECS, from a sender of its own on loopback (all of 127/8 is local)
            source = str(IPv4Address((127 << 24) | rng.getrandbits(24)))
            query = q()
        elif i % 3 == 1:
            query = q(ecs=(str(IPv4Address(rng.getrandbits(32))), 32))
        else:
            query = q(ecs=(str(IPv6Address(rng.getrandbits(64) << 64)), 64))
        reply = await udp(node, query, source=source)
        assert reply.rcode() == dns.rcode.NOERROR and addresses(reply), i
        for memo, held in slow_path_memos(node).items():
            assert held <= bound[memo], (memo, held, i)
            peak[memo] = max(peak[memo], held)
    # The flood filled the memos it is made to fill, up to their bounds.
    full = ("plans", "rankings", "client networks", "OPT records", "senders")
    assert {memo: peak[memo] for memo in full} == {memo: bound[memo] for memo in full}
    # Cleared one short of the bound: a split bucket adds two entries at once.
    assert peak["GeoIP locations"] >= bound["GeoIP locations"] - 2
    await node.runtime.writer.flush()
    assert node.runtime.writer.counted == flood  # every answer counted (rule 2)


def test_memo_limits_are_shares_of_the_budget_less_its_reserve() -> None:
    small, default, large = (MemoLimits.from_mb(mb) for mb in (16, 64, 256))
    assert small.plans < default.plans < large.plans
    # Within their shares at any size, of what is left after the reserve for what no table
    # holds: what they cost, at the bytes an entry was measured at.
    for mb, limits in ((16, small), (64, default), (256, large)):
        cost = (
            limits.plans * memos.PLAN_ENTRY_BYTES
            + limits.locations * memos.LOCATION_ENTRY_BYTES
            + 2 * limits.networks * memos.NETWORK_ENTRY_BYTES
        )
        assert cost <= sum(memos.MEMO_SHARES) * (mb - memos.RESERVE_MB) * (1 << 20)
        assert cost > 0.99 * sum(memos.MEMO_SHARES) * (mb - memos.RESERVE_MB) * (1 << 20)


def test_the_memo_modules_examples_hold() -> None:
    assert doctest.testmod(memos).failed == 0
