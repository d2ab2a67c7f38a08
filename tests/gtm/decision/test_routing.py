from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from gtm.decision.routing import (
    Channel,
    DecisionRequest,
    Outcome,
    Reason,
    Status,
    client_network,
    decide,
    great_circle_km,
    spill_point,
    spill_share,
)
from gtm.decision.snapshot import HealthState, RegionCapacity, RegionHealth, Snapshot, next_capacity
from gtm.decision.topology import Spillover
from tests.support.geoip import UNKNOWN_V4

NOW = 1000.0
DE, US, JP = "198.51.100.10", "203.0.113.10", "192.0.2.10"


def ask(snapshot: Snapshot, client: str, service: str = "chat", **kw):  # type: ignore[no-untyped-def]
    req = DecisionRequest(Channel.DNS, ip_address(client), service, service, **kw)
    return decide(req, snapshot, NOW)


def with_health(snapshot: Snapshot, **states: str) -> Snapshot:
    health = {r.replace("_", "-"): RegionHealth(HealthState(s), NOW) for r, s in states.items()}
    return snapshot.evolve(NOW, health=health)


def by_region(decision):  # type: ignore[no-untyped-def]
    return {c.region: c for c in decision.candidates}


def test_nearest_region_wins(snapshot: Snapshot) -> None:
    assert ask(snapshot, DE).region == "eu-central"
    assert ask(snapshot, US).region == "us-east"
    assert ask(snapshot, JP).region == "ap-northeast"
    assert ask(snapshot, "100.64.1.1").region == "ap-south"
    d = ask(snapshot, DE)
    assert d.outcome is Outcome.ANSWER
    assert d.ipv4 == ("192.0.2.40",)
    assert d.ttl == 30
    assert d.base_url == "http://127.0.0.1:8104"
    assert by_region(d)["eu-central"].reason is Reason.NEAREST
    assert by_region(d)["us-west"].status is Status.ELIGIBLE


def test_residency_keeps_eu_data_in_the_eu_wherever_the_client_is(snapshot: Snapshot) -> None:
    for client in (US, JP, "100.64.1.1", "100.66.1.1"):
        d = ask(snapshot, client, "chat-eu")
        assert d.region in {"eu-west", "eu-central"}
        assert d.matched_rules == ("eu-personal-stays-in-eu",)
        dropped = {c.region for c in d.candidates if c.reason is Reason.RESIDENCY}
        assert dropped == {"us-east", "us-west", "ap-south", "ap-northeast"}


def test_failover_moves_to_the_next_region_with_a_short_ttl(snapshot: Snapshot) -> None:
    d = ask(with_health(snapshot, eu_central="down"), DE)
    assert d.region == "eu-west"
    assert d.ttl == 10
    assert by_region(d)["eu-central"].reason is Reason.DOWN
    d = ask(with_health(snapshot, eu_central="draining"), DE)
    assert by_region(d)["eu-central"].reason is Reason.DRAINING
    assert d.region == "eu-west"


def test_restricted_class_fails_closed_when_every_allowed_region_is_down(
    snapshot: Snapshot,
) -> None:
    snap = with_health(snapshot, eu_west="down", eu_central="down")
    d = ask(snap, DE, "chat-eu")
    assert d.outcome is Outcome.FAIL_CLOSED
    assert d.region is None
    assert d.ipv4 == ()
    assert d.ipv6 == ()
    assert d.dns_failure is not None
    assert d.dns_failure.value == "nodata"
    # The unrestricted service still answers from elsewhere.
    assert ask(snap, DE).region == "us-east"


def test_unrestricted_fails_static_inside_its_allowed_set(snapshot: Snapshot) -> None:
    states = {r.id.replace("-", "_"): "down" for r in snapshot.topology.regions}
    d = ask(with_health(snapshot, **states), DE)
    assert d.outcome is Outcome.FAIL_STATIC
    assert set(d.regions) == {r.id for r in snapshot.topology.regions}
    assert len(d.ipv4) == 6
    assert d.ttl == 10
    assert all(c.reason is Reason.FAIL_STATIC and c.detail == "down" for c in d.candidates)


def test_class_allowed_nowhere_is_denied(snapshot: Snapshot) -> None:
    d = ask(snapshot, DE, "chat", residency_classes=frozenset({"no-such-class"}))
    assert d.outcome is Outcome.DENIED
    assert d.region is None
    assert all(c.reason is Reason.RESIDENCY for c in d.candidates)
    d = ask(snapshot, DE, "chat-eu", tenant="usgov")
    assert d.outcome is Outcome.DENIED


def test_unknown_service_and_unknown_location(snapshot: Snapshot) -> None:
    assert ask(snapshot, DE, "nope").outcome is Outcome.NO_SERVICE
    d = ask(snapshot, UNKNOWN_V4)
    # The demo ranks unknown clients from the North Atlantic: Dublin is nearest.
    assert d.location.country is None
    assert d.region == "eu-west"
    routing = snapshot.topology.routing.model_copy(update={"unknown_location": None})
    topo = snapshot.topology.model_copy(update={"routing": routing})
    d = ask(snapshot.evolve(NOW, topology=topo), UNKNOWN_V4)
    assert d.region == "us-east"
    assert by_region(d)["us-east"].reason is Reason.CONFIG_ORDER


def test_weight_zero_and_unknown_health(snapshot: Snapshot) -> None:
    regions = tuple(
        r.model_copy(update={"weight": 0.0}) if r.id == "eu-central" else r
        for r in snapshot.topology.regions
    )
    topo = snapshot.topology.model_copy(update={"regions": regions})
    topo.model_post_init(None)  # rebuild the region index of the copy
    d = ask(snapshot.evolve(NOW, topology=topo), DE)
    assert d.region == "eu-west"
    assert by_region(d)["eu-central"].reason is Reason.WEIGHT_ZERO

    routing = snapshot.topology.routing.model_copy(update={"unknown_health_is_up": False})
    topo = snapshot.topology.model_copy(update={"routing": routing})
    snap = snapshot.evolve(
        NOW, topology=topo, health={"eu-west": RegionHealth(HealthState.UP, NOW)}
    )
    d = ask(snap, DE)
    assert d.region == "eu-west"
    assert by_region(d)["eu-central"].reason is Reason.UNKNOWN_HEALTH


def test_latency_map_overrides_distance(snapshot: Snapshot) -> None:
    routing = snapshot.topology.routing.model_copy(
        update={"latency_map": {"country:DE": ("eu-west",), "continent:EU": ("us-east",)}}
    )
    topo = snapshot.topology.model_copy(update={"routing": routing})
    snap = snapshot.evolve(NOW, topology=topo)
    d = ask(snap, DE)
    assert d.region == "eu-west"
    assert by_region(d)["eu-west"].reason is Reason.PREFERRED
    assert ask(snap, "100.65.1.1").region == "us-east"  # GB: continent entry


def _capacity(u: float, at: float = NOW, ok: bool = True) -> RegionCapacity:
    return next_capacity(None, u, at, ok, Spillover())


def test_capacity_says_it_cannot_take_work_only_while_fresh(snapshot: Snapshot) -> None:
    snap = snapshot.evolve(NOW, capacity={"eu-central": _capacity(0.5, ok=False)})
    d = ask(snap, DE)
    assert d.region == "eu-west"
    assert by_region(d)["eu-central"].reason is Reason.CANNOT_TAKE_WORK
    stale = snapshot.evolve(NOW, capacity={"eu-central": _capacity(0.5, at=NOW - 60, ok=False)})
    assert ask(stale, DE).region == "eu-central"


# 2048 distinct client /24s, all located in Frankfurt by the test database.
GERMAN_NETS = [f"100.{72 + i // 256}.{i % 256}.0/24" for i in range(2048)]


def spread(snap: Snapshot, service: str = "chat"):  # type: ignore[no-untyped-def]
    """Decide for every German client network (asked through a US resolver with ECS)."""
    return {net: ask(snap, US, service, ecs=ip_network(net)) for net in GERMAN_NETS}


def test_spillover_moves_the_computed_share_to_a_region_with_headroom(snapshot: Snapshot) -> None:
    snap = snapshot.evolve(
        NOW, capacity={"eu-central": _capacity(0.95), "eu-west": _capacity(0.30)}
    )
    decisions = spread(snap)
    spilled = {n for n, d in decisions.items() if d.region == "eu-west"}
    stayed = {n for n, d in decisions.items() if d.region == "eu-central"}
    assert spilled | stayed == set(GERMAN_NETS)
    share = spill_share(0.95, 0.70, 0.9)
    assert share == pytest.approx(0.25 / 0.95)
    assert len(spilled) / len(GERMAN_NETS) == pytest.approx(share, abs=0.04)
    for net in spilled:
        d = decisions[net]
        assert by_region(d)["eu-central"].reason is Reason.SPILLED
        assert by_region(d)["eu-west"].reason is Reason.SPILL_TARGET
        assert d.ttl == 10
        assert d.scope_prefix == 24
    for net in stayed:
        assert by_region(decisions[net])["eu-central"].reason is Reason.NEAREST
        # Kept, but only as far as its own /24: the GeoIP network it is in (100.72.0.0/13
        # and the like) also holds spilled /24s, so a wider ECS scope would let a resolver
        # give this answer to them.
        assert decisions[net].scope_prefix == 24

    # Stable: the same networks spill on every call while the snapshot is unchanged...
    assert {n for n, d in spread(snap).items() if d.region == "eu-west"} == spilled
    # ...and more overload only adds networks; none comes back.
    hotter = snapshot.evolve(
        NOW, capacity={"eu-central": _capacity(0.99), "eu-west": _capacity(0.30)}
    )
    spilled_more = {n for n, d in spread(hotter).items() if d.region == "eu-west"}
    assert spilled < spilled_more


def test_spillover_needs_a_fresh_target_with_headroom(snapshot: Snapshot) -> None:
    hot = _capacity(0.95)
    would_spill = {
        n
        for n in GERMAN_NETS
        if spill_point(ip_network(n), "eu-central") < spill_share(0.95, 0.7, 0.9)
    }
    assert would_spill
    cases = {
        "no report from the target": {"eu-central": hot},
        "stale target report": {"eu-central": hot, "eu-west": _capacity(0.1, at=NOW - 60)},
        "target above its high watermark": {"eu-central": hot, "eu-west": _capacity(0.9)},
    }
    for label, capacity in cases.items():
        decisions = spread(snapshot.evolve(NOW, capacity=capacity))
        assert all(d.region == "eu-central" for d in decisions.values()), label
        no_room = {
            n
            for n, d in decisions.items()
            if by_region(d)["eu-central"].reason is Reason.OVERLOADED_NO_HEADROOM
        }
        assert no_room == would_spill, label

    # A stale overload report is ignored: nobody spills, everyone is simply nearest.
    stale = snapshot.evolve(
        NOW, capacity={"eu-central": _capacity(0.99, at=NOW - 30), "eu-west": _capacity(0.1)}
    )
    assert all(by_region(d)["eu-central"].reason is Reason.NEAREST for d in spread(stale).values())


def test_spillover_of_a_restricted_class_stays_in_its_jurisdiction(snapshot: Snapshot) -> None:
    # US regions have plenty of headroom, the other EU region has none: EU data stays put.
    snap = snapshot.evolve(
        NOW,
        capacity={
            "eu-central": _capacity(0.99),
            "eu-west": _capacity(0.95),
            "us-east": _capacity(0.05),
            "us-west": _capacity(0.05),
        },
    )
    assert {d.region for d in spread(snap, "chat-eu").values()} == {"eu-central"}
    # Unrestricted traffic skips eu-west (itself spilling) and spills to us-east.
    assert {d.region for d in spread(snap, "chat").values()} == {"eu-central", "us-east"}


def test_spill_share_over_many_networks_matches_the_computed_share() -> None:
    networks = [ip_network(f"10.{i // 256}.{i % 256}.0/24") for i in range(20000)]
    share = spill_share(0.95, 0.70, 0.9)
    moved = sum(spill_point(n, "eu-central") < share for n in networks) / len(networks)
    assert moved == pytest.approx(share, abs=0.02)
    assert spill_share(0.5, 0.7, 0.9) == 0
    assert spill_share(100.0, 0.7, 0.9) == 0.9  # capped


def test_hysteresis_between_watermarks() -> None:
    w = Spillover(high_watermark=0.85, low_watermark=0.70)
    states = []
    cap = None
    for u in (0.80, 0.86, 0.80, 0.71, 0.69, 0.80):
        cap = next_capacity(cap, u, NOW, True, w)
        states.append(cap.spilling)
    assert states == [False, True, True, True, False, False]


def test_ecs_drives_location_and_scope(snapshot: Snapshot) -> None:
    # Resolver in the US, client subnet in Germany.
    d = ask(snapshot, US, ecs=ip_network("198.51.100.0/24"))
    assert d.region == "eu-central"
    assert d.location.country == "DE"
    assert d.scope_prefix == 24
    assert str(d.client_network) == "198.51.100.0/24"
    # A narrower GeoIP network than the source: scope never longer than the source.
    d = ask(snapshot, US, ecs=ip_network("100.70.0.0/26"))
    assert d.location.country == "DE"
    assert d.scope_prefix == 26
    # Source /20 wider than the database network /24: scope capped at the source... and the
    # database network is /16 for 100.64.0.0/16, so the scope is /16.
    d = ask(snapshot, US, ecs=ip_network("100.64.16.0/20"))
    assert d.location.country == "IN"
    assert d.scope_prefix == 16
    # Source prefix 0: the resolver's own address decides.
    d = ask(snapshot, US, ecs=ip_network("0.0.0.0/0"))
    assert d.location.country == "US"
    assert d.region == "us-east"


def test_scope_is_zero_when_location_does_not_matter(snapshot: Snapshot, topology) -> None:  # type: ignore[no-untyped-def]
    snap = with_health(snapshot, eu_west="down")
    d = ask(snap, US, "chat-eu", ecs=ip_network("203.0.113.0/24"))
    # Only eu-central is allowed and healthy... but eu-west is still an allowed region, so the
    # answer may depend on location once it recovers; scope reflects the allowed set.
    assert d.region == "eu-central"
    assert d.scope_prefix == 24
    one_region = topology.model_copy(
        update={
            "services": tuple(
                s.model_copy(update={"regions": ("eu-west",)}) if s.id == "chat-eu" else s
                for s in topology.services
            )
        }
    )
    one_region.model_post_init(None)
    d = ask(
        snapshot.evolve(NOW, topology=one_region), US, "chat-eu", ecs=ip_network("203.0.113.0/24")
    )
    assert d.region == "eu-west"
    assert d.scope_prefix == 0


def test_client_network_is_truncated_for_privacy() -> None:
    assert str(client_network(ip_address("198.51.100.77"), None)) == "198.51.100.0/24"
    assert str(client_network(ip_address("2001:db8:1:2:3::1"), None)) == "2001:db8:1::/56"
    assert (
        str(client_network(ip_address("1.2.3.4"), ip_network("198.51.100.64/26")))
        == "198.51.100.0/24"
    )
    assert (
        str(client_network(ip_address("1.2.3.4"), ip_network("198.51.0.0/16"))) == "198.51.0.0/16"
    )


def test_great_circle_known_distances() -> None:
    # Dublin - Frankfurt ~1090 km; London - New York ~5570 km.
    assert great_circle_km(53.35, -6.26, 50.11, 8.68) == pytest.approx(1090, rel=0.02)
    assert great_circle_km(51.51, -0.13, 40.71, -74.01) == pytest.approx(5570, rel=0.01)
    assert great_circle_km(10, 10, 10, 10) == 0


def test_decisions_record_versions(snapshot: Snapshot) -> None:
    d = ask(snapshot, DE)
    assert d.versions.snapshot == 1
    assert d.versions.policy == snapshot.policy.version
    assert d.versions.topology == snapshot.topology.fingerprint()
    assert d.versions.geoip.startswith("GeoIP2-City@")


# -- memoisation must never serve a stale answer ---------------------------------------------


def test_plans_carry_over_capacity_swaps_only_while_refusals_are_unchanged(
    snapshot: Snapshot,
) -> None:
    snap = snapshot.evolve(NOW, capacity={"eu-central": _capacity(0.5)})
    assert ask(snap, DE).region == "eu-central"
    routine = snap.evolve(NOW, capacity={"eu-central": _capacity(0.6)})
    assert routine.plans is snap.plans  # a routine report keeps the plans
    refusing = routine.evolve(NOW, capacity={"eu-central": _capacity(0.6, ok=False)})
    assert refusing.plans is not routine.plans
    d = ask(refusing, DE)
    assert d.region == "eu-west"
    assert by_region(d)["eu-central"].reason is Reason.CANNOT_TAKE_WORK
    health = refusing.evolve(NOW, health={"eu-west": RegionHealth(HealthState.DOWN, NOW)})
    assert health.plans is not refusing.plans
    assert health.ranks is refusing.ranks
    assert ask(health, DE).region == "us-east"


def test_a_refusal_report_expires_within_one_snapshot(snapshot: Snapshot) -> None:
    snap = snapshot.evolve(NOW, capacity={"eu-central": _capacity(0.5, at=NOW, ok=False)})
    req = DecisionRequest(Channel.DNS, ip_address(DE), "chat", "chat")
    assert decide(req, snap, NOW + 5).region == "eu-west"  # fresh: eu-central is out
    assert decide(req, snap, NOW + 11).region == "eu-central"  # stale: ignored, not trusted
    assert decide(req, snap, NOW + 1).region == "eu-west"  # and the memo goes both ways


def test_spill_target_expires_with_its_report(snapshot: Snapshot) -> None:
    snap = snapshot.evolve(
        NOW,
        capacity={"eu-central": _capacity(0.95, at=NOW + 100), "eu-west": _capacity(0.3, at=NOW)},
    )
    spilling = next(
        n
        for n in GERMAN_NETS
        if spill_point(ip_network(n), "eu-central") < spill_share(0.95, 0.7, 0.9)
    )
    req = DecisionRequest(Channel.DNS, ip_address(US), "chat", "chat", ecs=ip_network(spilling))
    assert decide(req, snap, NOW + 5).region == "eu-west"
    late = decide(req, snap, NOW + 20)  # eu-west's report is stale now: no proven headroom
    assert late.region == "eu-central"
    assert by_region(late)["eu-central"].reason is Reason.OVERLOADED_NO_HEADROOM
    assert decide(req, snap, NOW + 5).region == "eu-west"


def test_topology_change_resets_rankings(snapshot: Snapshot) -> None:
    ask(snapshot, DE)
    assert snapshot.ranks
    moved = tuple(
        r.model_copy(update={"lat": 51.5, "lon": -0.1}) if r.id == "eu-west" else r
        for r in snapshot.topology.regions
    )  # eu-west "moves" to London
    topo = snapshot.topology.model_copy(update={"regions": moved})
    topo.model_post_init(None)
    successor = snapshot.evolve(NOW, topology=topo)
    assert successor.ranks == {}
    assert successor.plans == {}
    d = ask(successor, DE)
    assert d.distances["eu-west"] == pytest.approx(
        great_circle_km(50.11, 8.68, 51.5, -0.1), rel=0.01
    )


def test_a_recovering_region_takes_back_a_growing_share_of_its_clients(snapshot: Snapshot) -> None:
    shares = []
    back_before: set[str] = set()
    for admitted in (0.0, 0.25, 0.5, 0.75, 1.0):
        health = {"eu-central": RegionHealth(HealthState.UP, NOW, "", admitted)}
        decisions = spread(snapshot.evolve(NOW, health=health), "chat-eu")
        back = {n for n, d in decisions.items() if d.region == "eu-central"}
        assert back_before <= back  # the clients re-admitted first stay re-admitted
        back_before = back
        shares.append(len(back) / len(GERMAN_NETS))
        for net, d in decisions.items():
            if net not in back:
                # Held on the next allowed region: EU data stays in the EU (rule 1).
                assert d.region == "eu-west" and d.ttl == 10 and d.scope_prefix == 24
                assert by_region(d)["eu-central"].reason is Reason.READMITTING
                assert by_region(d)["eu-west"].reason is Reason.READMIT_HOLD
            elif 0.0 < admitted < 1.0:
                assert d.scope_prefix == 24  # back, but its GeoIP network is split
    assert shares[0] == 0.0 and shares[-1] == 1.0
    for admitted, share in zip((0.25, 0.5, 0.75), shares[1:4], strict=True):
        assert share == pytest.approx(admitted, abs=0.08)


def test_a_recovering_region_alone_in_the_allowed_set_takes_everyone(snapshot: Snapshot) -> None:
    health = {
        "eu-central": RegionHealth(HealthState.UP, NOW, "", 0.0),
        "eu-west": RegionHealth(HealthState.DOWN, NOW),
    }
    d = ask(snapshot.evolve(NOW, health=health), US, "chat-eu", ecs=ip_network(GERMAN_NETS[0]))
    assert d.region == "eu-central"


def test_operator_weights_rerank_regions(snapshot: Snapshot) -> None:
    london = "100.65.1.1"  # Dublin (eu-west) is nearer than Frankfurt (eu-central)
    assert ask(snapshot, london).region == "eu-west"
    assert ask(snapshot.evolve(NOW, weights={"eu-central": 2.0}), london).region == "eu-central"
    zero = ask(snapshot.evolve(NOW, weights={"eu-central": 0.0}), DE)
    assert zero.region != "eu-central"
    assert by_region(zero)["eu-central"].reason is Reason.WEIGHT_ZERO
