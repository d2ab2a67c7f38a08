"""The ECS path (gtm.geodns.shapes): queries that differ only in ID and client subnet are
answered from one rendering per location class, byte for byte what the full path gives, and
audited per GeoIP network as the full path audits them."""

from __future__ import annotations

import gc
import random
import struct
import time
from ipaddress import IPv4Address, IPv6Address, ip_network
from pathlib import Path

import dns.edns
import dns.message
import dns.rcode
import pytest

from gtm.decision.geoip import default_database_path
from gtm.errors import GeoIPError
from gtm.geodns.precision import widened
from gtm.geodns.responder import udp_limit
from gtm.geodns.shapes import Face, Placed, Shape
from gtm.geodns.wire import Query, parse_query
from gtm.geodns.zone import answer
from tests.conftest import POLICIES
from tests.support.geoip import WORLD, build_city_db

from .conftest import StartNode, raw_udp, udp
from .test_ecs_residency import EU_V4, US_V4, addresses, de_rule
from .test_precision import _rows
from .test_server import q


def _geolite() -> Path:
    try:
        return default_database_path()
    except GeoIPError:
        pytest.skip("the bundled GeoLite2-City (the 'geolite' extra) is not installed")


def _subnets(
    seed: int,
    n: int,
    v6: int,
    v4_sources: tuple[int, ...] = (24,),
    v6_sources: tuple[int, ...] = (56,),
) -> list[tuple[str, int]]:
    """Random client subnets, each with a source length drawn from the family's list."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first = rng.choice([o for o in range(1, 224) if o not in (10, 127)])
        source = rng.choice(v4_sources)
        value = (first << 24) | (rng.getrandbits(16) << 8)
        out.append((str(IPv4Address(value >> (32 - source) << (32 - source))), source))
    for _ in range(v6):
        source = rng.choice(v6_sources)
        value = (0x2A00 << 112) | (rng.getrandbits(44) << 72)
        out.append((str(IPv6Address(value >> (128 - source) << (128 - source))), source))
    return out


async def test_the_ecs_path_answers_and_audits_as_the_full_path(start_node: StartNode) -> None:
    # A budget whose backlog of new rows holds them all: none folded here (test_budget.py).
    node = await start_node(
        geoip_path=_geolite(), audit_flush_interval_s=3600, dns_cache_budget_mb=256
    )
    responder = node.dns.responder  # type: ignore[union-attr]
    snapshot = node.runtime.store.current
    client = IPv4Address("127.0.0.1")
    expected_rows: dict[str, int] = {}
    # Whole-octet sources as most resolvers send, and others (/20, /36): every ECS source up
    # to the audit's precision takes the ECS path.
    subnets = _subnets(
        seed=3, n=1500, v6=150, v4_sources=(24, 24, 22, 20, 17), v6_sources=(56, 48, 36)
    )
    for subnet, source in subnets:
        query = q(ecs=(subnet, source))
        wire = query.to_wire()
        got = await udp(node, query)
        parsed = parse_query(wire)
        assert isinstance(parsed, Query)
        full = answer(parsed, client, snapshot, time.time(), udp_limit(parsed.edns))
        # Byte for byte: ID, flags, question, answers and TTLs, the ECS echo and its scope.
        assert got.to_wire() == dns.message.from_wire(full.wire).to_wire(), subnet
        record = full.record
        decision = full.decision
        assert decision is not None and decision.location.network is not None
        if decision.scope_prefix and decision.location.network.prefixlen <= source:
            record = widened(record, decision.location.network)
        expected_rows[record.client_network] = expected_rows.get(record.client_network, 0) + 1
    # One rendering per location class (and one per class the full path met first), not one
    # per subnet: the ECS path answered nearly all of them.
    assert responder.stats.cache_misses < len(subnets) // 4
    got_rows = await _rows(node)  # the ECS recorded at the client's precision too
    assert got_rows == expected_rows
    assert all(ip_network(n).prefixlen <= 56 for n in got_rows)


async def test_an_untrusted_senders_subnets_never_loosen_residency_on_the_ecs_path(
    start_node: StartNode, tmp_path: Path
) -> None:
    """The shape belongs to its sender: the same US subnets get US answers from a trusted
    resolver and EU ones from an untrusted German sender (a "DE stays in the EU" rule judged on
    the sender's place too, DESIGN.md rule 1), one subnet after another on the ECS path,
    whichever sender asked first."""
    world = {
        **WORLD,
        "127.0.0.0/24": ("DE", "EU", 50.11, 8.68),
        "127.0.1.0/24": ("DE", "EU", 52.52, 13.40),
        "8.8.0.0/16": ("US", "NA", 37.39, -122.08),
    }
    node = await start_node(
        policies=(POLICIES, de_rule(tmp_path, "stricter")),
        geoip_path=build_city_db(tmp_path / "senders.mmdb", world),
        audit_flush_interval_s=3600,
    )
    snapshot = node.runtime.store.current
    # Twice over: the second round is answered from the memo of subnets, which must key them
    # by sender (shape) too.
    senders = (("127.0.1.2", US_V4), ("127.0.0.2", EU_V4), ("127.0.1.3", US_V4))
    for sender, region in senders * 2:
        for i in range(0, 256, 5):
            query = q(ecs=(f"8.8.{i}.0", 24))
            got = await udp(node, query, source=sender)
            assert addresses(got) <= region, (sender, i)
            parsed = parse_query(query.to_wire())
            assert isinstance(parsed, Query)
            full = answer(
                parsed, IPv4Address(sender), snapshot, time.time(), udp_limit(parsed.edns)
            )
            assert got.to_wire() == dns.message.from_wire(full.wire).to_wire()


async def test_subnets_asked_for_again_are_answered_from_memory_and_counted(
    start_node: StartNode,
) -> None:
    """A resolver population cycling through its clients' subnets: the second round needs no
    GeoIP lookup (the memo keeps each subnet's answer), gives the same bytes and is counted."""
    node = await start_node(geoip_path=_geolite(), audit_flush_interval_s=3600)
    geo = node.runtime.store.current.geo
    subnets = _subnets(seed=5, n=300, v6=30)
    first: dict[str, bytes] = {}
    for subnet, source in subnets:
        first[subnet] = (await udp(node, q(ecs=(subnet, source)))).to_wire()[2:]

    def unreachable(version: int, value: int) -> object:
        raise AssertionError("a GeoIP lookup for a subnet the memo holds")

    geo.where = unreachable  # type: ignore[method-assign]
    for subnet, source in subnets:
        again = (await udp(node, q(ecs=(subnet, source)))).to_wire()[2:]
        assert again == first[subnet], subnet
    del geo.where
    await node.runtime.writer.flush()
    rows = await _rows(node)
    assert sum(rows.values()) == 2 * len(subnets)


async def test_folded_rows_keep_their_records_from_one_seal_window_to_the_next(
    start_node: StartNode,
) -> None:
    """A flood's folded rows are mostly the same from one window to the next: their records
    (and the rows rendered from them) are kept, not made again each window."""
    node = await start_node(geoip_path=_geolite(), audit_flush_interval_s=3600)
    responder = node.dns.responder  # type: ignore[union-attr]
    subnets = _subnets(seed=9, n=60, v6=0)
    kept: list[list[object]] = []  # the folded rows' records, held (ids could be reused)
    for _window in range(2):
        # A seal first (the last window's folded rows written; at the first, whatever the
        # start left): its own take drains the responder, which starts its backlog count
        # again there. Set full before that drain, the count was reset under the test by the
        # first journal tick after the start (a flaky fold count).
        await node.runtime.writer.flush()
        responder._new_decisions = responder.budget.audit_records  # the backlog full
        before = node.dns_stats.folded
        for subnet, source in subnets:
            await udp(node, q(ecs=(subnet, source)))
        assert node.dns_stats.folded - before == len(subnets)
        kept.append(sorted((e.record for e in responder._folds.values()), key=id))
    await node.runtime.writer.flush()
    assert kept[0] and len(kept[1]) == len(kept[0])
    assert all(a is b for a, b in zip(kept[0], kept[1], strict=True))
    rows = await _rows(node)
    assert sum(rows.values()) == 2 * len(subnets)
    assert all(net.endswith("/8") for net in rows)


async def test_bits_past_a_source_prefix_are_refused_on_the_ecs_path_too(
    start_node: StartNode,
) -> None:
    """A source that is not a whole octet (/20) leaves bits of its last octet that must be
    zero (RFC 7871 §6). Once the ECS path knows the shape, a query of it with such a bit set
    is still FORMERR, as the full path answers it, never answered as the subnet it spells."""
    node = await start_node(geoip_path=_geolite())
    responder = node.dns.responder  # type: ignore[union-attr]
    for subnet in ("81.2.64.0", "81.2.80.0"):  # the slow path makes the shape, then the ECS path
        assert addresses(await udp(node, q(ecs=(subnet, 20))))
    assert responder._shape_count == 1
    before = node.dns_stats.cache_misses
    assert addresses(await udp(node, q(ecs=("81.2.96.0", 20))))
    assert node.dns_stats.cache_misses == before  # answered on the ECS path
    wire = bytearray(q(ecs=("81.2.96.0", 20)).to_wire())
    wire[-1] |= 0x01  # 81.2.96.1/20: a bit past the prefix
    reply = await raw_udp(node, bytes(wire))
    assert reply is not None
    message = dns.message.from_wire(reply)
    assert message.id == int.from_bytes(wire[:2], "big")
    assert message.rcode() == dns.rcode.FORMERR and not message.answer
    await node.runtime.writer.flush()
    assert node.runtime.writer.counted == 4  # the FORMERR counted too


def test_a_shape_is_taken_only_when_the_ecs_option_really_ends_the_message() -> None:
    """A cookie option after the ECS whose last bytes copy an ECS option (code, length, family,
    source, scope, the same address) must not make a shape: the bytes a later query changes
    there are not its client subnet (review finding)."""
    address = bytes((198, 51, 100))
    fake = struct.pack("!HHHBB", 8, 7, 1, 24, 0) + address
    cookie = dns.edns.GenericOption(10, bytes(8) + fake)
    ecs = dns.edns.ECSOption("198.51.100.0", 24)
    crafted = dns.message.make_query(
        "chat.gtm.example.", "A", use_edns=0, options=[ecs, cookie]
    ).to_wire()
    parsed = parse_query(crafted)
    assert isinstance(parsed, Query) and crafted.endswith(fake)
    assert Shape.of(crafted, parsed, IPv4Address("127.0.0.1"), 1232) is None
    plain = q(ecs=("198.51.100.0", 24)).to_wire()
    parsed = parse_query(plain)
    assert isinstance(parsed, Query)
    assert Shape.of(plain, parsed, IPv4Address("127.0.0.1"), 1232) is not None


def test_a_dropped_rendering_and_its_faces_go_without_the_cycle_collector() -> None:
    """The responder's tables drop renderings (and the memo their faces) all through a
    random-subnet flood. They must be freed then, by reference counting: the heap keeper
    freezes what survives a young collection (gtm.heap), so a rendering and its faces in a
    reference cycle would wait minutes for a full collection, outside the memory budget."""
    serial = 0x5EED
    gc.disable()
    try:
        for _ in range(50):
            placed = Placed(b"body", True, None, None, ("udp", "A", "NOERROR"), False, serial)  # type: ignore[arg-type]
            faces = [placed.face(length, 32) for length in (16, 20, 24)]
            assert placed.face(20, 32) is faces[1]  # one face per prefix length while it lives
            del placed, faces
        left = [o for o in gc.get_objects() if type(o) is Face and o.placed.serial == serial]
        assert left == []
    finally:
        gc.enable()
