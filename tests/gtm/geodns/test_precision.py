"""Answers and audit rows per GeoIP network (gtm.geodns.precision): many client /24s in one
database network cost one rendering and one audit row, each response still echoes its own
subnet, and a network a spill share splits goes back to one per /24."""

from __future__ import annotations

import time
from pathlib import Path

from gtm.audit import query as audit_query
from gtm.decision.snapshot import RegionCapacity
from tests.support.geoip import WORLD, build_city_db

from .conftest import StartNode, audited, udp
from .test_server import addresses, ecs_of, q

# The test GeoIP database puts all of 100.72.0.0/13 in Frankfurt (tests/support/geoip.py).
CHAT = "chat.gtm.example."
FRANKFURT = [f"100.{72 + i // 256}.{i % 256}.0" for i in range(0, 2048, 41)]


async def _rows(node, name: str = "chat.gtm.example.") -> dict[str, int]:  # type: ignore[no-untyped-def]
    rows = await audited(
        node,
        "SELECT client_network, ecs_prefix, count FROM decisions"
        " WHERE name = :name AND query_type = 'A'",
        {"name": name},
    )
    out: dict[str, int] = {}
    for network, ecs, count in rows:
        assert ecs == network  # the ECS is recorded at the same precision
        out[network] = out.get(network, 0) + count
    return out


async def test_subnets_of_one_geoip_network_share_a_rendering_and_a_row(
    start_node: StartNode,
) -> None:
    node = await start_node(audit_flush_interval_s=3600)
    responder = node.dns.responder  # type: ignore[union-attr]
    misses = responder.stats.cache_misses
    for subnet in FRANKFURT:
        r = await udp(node, q(ecs=(subnet, 24)))
        assert addresses(r) == {"192.0.2.40"}  # eu-central
        echo = ecs_of(r)
        # Each response echoes its own subnet, with the network's scope.
        assert echo is not None and echo.address == subnet and echo.srclen == 24
        assert echo.scopelen == 13
    assert responder.stats.cache_misses - misses == 1
    assert await _rows(node) == {"100.72.0.0/13": len(FRANKFURT)}
    # Searching the audit for one of those clients finds the network's row.
    for client in ("100.72.41.0/24", "100.73.1.9"):
        found, _ = await audit_query.search(
            node.runtime.engine, audit_query.Filters(client_network=client, name=CHAT)
        )
        assert [r["client_network"] for r in found] == ["100.72.0.0/13"], client
    elsewhere, _ = await audit_query.search(
        node.runtime.engine, audit_query.Filters(client_network="100.80.0.0/24", name=CHAT)
    )
    assert elsewhere == []


async def test_a_network_split_by_a_spill_share_is_rendered_and_audited_per_subnet(
    start_node: StartNode,
) -> None:
    node = await start_node(audit_flush_interval_s=3600)
    now = time.time()
    node.runtime.swap(
        capacity={
            "eu-central": RegionCapacity(0.97, now, True),
            "eu-west": RegionCapacity(0.30, now, False),
        }
    )
    regions = set()
    for subnet in FRANKFURT:
        r = await udp(node, q(ecs=(subnet, 24)))
        regions |= addresses(r)
        echo = ecs_of(r)
        assert echo is not None and echo.address == subnet and echo.scopelen == 24
    assert regions == {"192.0.2.40", "192.0.2.30"}  # some kept, some spilled
    rows = await _rows(node)
    assert rows == {f"{subnet}/24": 1 for subnet in FRANKFURT}


async def test_a_geoip_network_narrower_than_the_subnet_keeps_the_subnet(
    start_node: StartNode,
) -> None:
    """100.70.0.0/24 holds two /28 networks (Berlin, New York): an ECS /24 is located by its
    first address and the subnet itself is the unit, as before."""
    node = await start_node(audit_flush_interval_s=3600)
    r = await udp(node, q(ecs=("100.70.0.0", 24)))
    echo = ecs_of(r)
    assert echo is not None and echo.address == "100.70.0.0"
    assert await _rows(node) == {"100.70.0.0/24": 1}


async def test_a_row_shared_by_a_geoip_network_names_no_one_clients_longer_ecs(
    start_node: StartNode, tmp_path: Path
) -> None:
    """ECS sources longer than the audit's client precision (/32) in a GeoIP network of /24 or
    narrower: the answer is rendered once for the network and every client in it is counted on
    its row, so the row's ECS prefix is the network's. Before, it kept the first client's /32,
    and the others were counted on a row naming that one address."""
    world = {
        **WORLD,
        "100.64.1.0/24": ("DE", "EU", 50.11, 8.68),
        "100.64.2.0/28": ("DE", "EU", 52.52, 13.40),
    }
    node = await start_node(
        audit_flush_interval_s=3600, geoip_path=build_city_db(tmp_path / "city.mmdb", world)
    )
    for prefix in ("100.64.1", "100.64.2"):
        for last in (1, 2, 3):
            reply = await udp(node, q(ecs=(f"{prefix}.{last}", 32)))
            assert addresses(reply) == {"192.0.2.40"}
            echo = ecs_of(reply)
            assert echo is not None and echo.address == f"{prefix}.{last}" and echo.srclen == 32
    rows = await audited(
        node,
        "SELECT client_network, ecs_prefix, count FROM decisions"
        " WHERE name = :name AND query_type = 'A' ORDER BY client_network",
        {"name": CHAT},
    )
    # The client at the audit's /24 at most; the ECS at the network the answer held for.
    assert [tuple(r) for r in rows] == [
        ("100.64.1.0/24", "100.64.1.0/24", 3),
        ("100.64.2.0/24", "100.64.2.0/28", 3),
    ]
