"""Properties of decide() over random topologies, policies, health and capacity states."""

from __future__ import annotations

import dataclasses
import math
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gtm.decision.answer_window import AnswerWindow, time_boundary
from gtm.decision.geoip import GeoDatabase
from gtm.decision.model import Decision
from gtm.decision.policy import PolicyDocument, Verdict, compile_policy
from gtm.decision.routing import Channel, DecisionRequest, Outcome, decide
from gtm.decision.snapshot import HealthState, RegionHealth, Snapshot, next_capacity
from gtm.decision.topology import Service, parse_topology

NOW = 10_000.0
JURISDICTIONS = ["A", "B", "C"]
CLIENTS = [
    "198.51.100.9",
    "203.0.113.7",
    "192.0.2.3",
    "100.64.3.3",
    "100.65.9.9",
    "100.66.1.1",
    "100.70.0.3",
    "100.70.0.20",
    "100.73.4.4",
    "100.99.1.1",
    "2001:db8:aaaa::1",
    "2001:db8:bbbb::2",
    "2001:db8:cccc::3",
]


@st.composite
def worlds(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 6))
    regions = [
        {
            "id": f"r{i}",
            "name": f"R{i}",
            "lat": draw(st.floats(-80, 80)),
            "lon": draw(st.floats(-179, 179)),
            "jurisdiction": draw(st.sampled_from(JURISDICTIONS)),
            "ipv4": [f"192.0.2.{100 + i}"],
            "base_url": f"http://127.0.0.1:{9000 + i}",
            "weight": draw(st.sampled_from([1.0, 1.0, 2.0, 0.5, 0.0])),
        }
        for i in range(n)
    ]
    ids = [r["id"] for r in regions]
    served = draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    residency = draw(st.sampled_from([None, "rc"]))
    topology = {
        "zone": {
            "apex": "t.example.",
            "soa": {"mname": "ns.t.example.", "rname": "h.t.example.", "serial": 1},
            "nameservers": [{"name": "ns.t.example.", "ipv4": ["192.0.2.1"]}],
        },
        "regions": regions,
        "services": [
            {
                "id": "svc",
                "dns_names": ["svc.t.example."],
                "regions": served,
                "residency_class": residency,
            }
        ],
        "routing": {
            "unknown_health_is_up": draw(st.booleans()),
            "unknown_location": draw(st.sampled_from([None, (0.0, 0.0)])),
            "spillover": {"high_watermark": 0.85, "low_watermark": 0.7, "stale_after_s": 10},
        },
    }
    groups = {j: [r["id"] for r in regions if r["jurisdiction"] == j] for j in JURISDICTIONS}
    groups = {j: members for j, members in groups.items() if members}
    rules = [
        {
            "id": "class-rule",
            "match": {"residency_class": ["rc"]},
            "allow": {
                "jurisdictions": draw(
                    st.lists(st.sampled_from(sorted(groups)), min_size=1, unique=True)
                )
            },
        }
    ]
    if draw(st.booleans()):
        rules.append(
            {
                "id": "tenant-rule",
                "match": {"tenant": ["t1"]},
                "allow": {"regions": draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))},
                "on_unavailable": draw(st.sampled_from(["reject", "fail_static"])),
            }
        )
    if draw(st.booleans()):
        rules.append(
            {
                "id": "geo-rule",
                "match": {"client_continent": ["EU"]},
                "allow": {"regions": draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))},
                "on_unavailable": draw(st.sampled_from(["reject", "fail_static"])),
            }
        )
    policy = {
        "version": "p",
        "jurisdictions": groups,
        "rules": rules,
        "default": {"on_unavailable": draw(st.sampled_from(["reject", "fail_static"]))},
    }
    health = {
        r: (draw(st.sampled_from(list(HealthState))), draw(st.sampled_from([1.0, 0.5, 0.0])))
        for r in ids
        if draw(st.booleans())
    }
    # Operator weight overrides (gtm region weight), 0 taking a region out.
    weights = {r: draw(st.sampled_from([0.0, 0.5, 3.0])) for r in ids if draw(st.booleans())}
    capacity = {}
    for r in ids:
        if draw(st.booleans()):
            capacity[r] = (
                draw(st.floats(0, 1.6)),
                draw(st.floats(0, 30)),
                draw(st.booleans()),
                draw(st.booleans()),
            )
    client = draw(st.sampled_from(CLIENTS))
    return {
        "topology": topology,
        "policy": policy,
        "health": health,
        "weights": weights,
        "capacity": capacity,
        "client": client,
        "ecs": draw(st.booleans()),
        "tenant": draw(st.sampled_from([None, "t1"])),
        "extra_class": draw(st.sampled_from([None, None, "rc"])),
    }


@pytest.fixture(scope="module")
def geo(geoip_path: Path) -> GeoDatabase:
    return GeoDatabase(geoip_path)


def build(world: dict[str, Any], geo: GeoDatabase) -> tuple[Snapshot, DecisionRequest]:
    topo = parse_topology(world["topology"])
    policy = compile_policy([("p.yaml", PolicyDocument.model_validate(world["policy"]))])
    spill = topo.routing.spillover
    capacity = {}
    for region, (u, age, ok, was_spilling) in world["capacity"].items():
        prev = next_capacity(None, 2.0 if was_spilling else 0.0, NOW - age, ok, spill)
        capacity[region] = next_capacity(prev, u, NOW - age, ok, spill)
    snap = Snapshot(
        1,
        topo,
        policy,
        geo,
        {r: RegionHealth(s, 0.0, "", a) for r, (s, a) in world["health"].items()},
        capacity,
        world["weights"],
    )
    client = ip_address(world["client"])
    ecs = None
    if world["ecs"]:
        ecs = ip_network(f"{client}/{24 if client.version == 4 else 56}", strict=False)
    req = DecisionRequest(
        Channel.DNS,
        client,
        "svc",
        "svc.t.example.",
        ecs=ecs,
        tenant=world["tenant"],
        residency_classes=frozenset({world["extra_class"]} - {None}),
    )
    return snap, req


def healthy(snap: Snapshot, region_id: str) -> bool:
    region = snap.regions[region_id]
    state = snap.health.get(region_id)
    s = state.state if state else HealthState.UNKNOWN
    if region.weight == 0 or s in (HealthState.DOWN, HealthState.DRAINING):
        return False
    if s is HealthState.UNKNOWN and not snap.topology.routing.unknown_health_is_up:
        return False
    cap = snap.capacity.get(region_id)
    return not (cap and not cap.can_take_work and NOW - cap.reported_at <= 10)


def expected(
    snap: Snapshot, req: DecisionRequest, d: Decision
) -> tuple[Service, set[str], Verdict, set[str]]:
    """What the policy says independently of decide(): the classes, the verdict and the
    regions the answer must stay within."""
    svc = snap.topology.service("svc")
    assert svc is not None
    classes = set(req.residency_classes) | ({svc.residency_class} - {None})
    verdict = snap.policy.evaluate(
        frozenset(classes), req.tenant, d.location.country, d.location.continent
    )
    allowed = set(svc.regions) if verdict.allowed is None else set(svc.regions) & verdict.allowed
    return svc, classes, verdict, allowed


SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(world=worlds())
def test_answers_never_leave_the_allowed_set(world: dict[str, Any], geo: GeoDatabase) -> None:
    snap, req = build(world, geo)
    d = decide(req, snap, NOW)
    svc, _classes, _verdict, allowed = expected(snap, req, d)
    assert set(d.regions) <= allowed
    if d.region is not None:
        assert d.region in allowed
    answered = {str(a) for r in d.regions for a in snap.topology.region(r).ipv4}
    assert set(d.ipv4) == answered
    # Every served region has exactly one verdict.
    assert [c.region for c in d.candidates] == list(svc.regions)


@SETTINGS
@given(world=worlds())
def test_restricted_traffic_fails_closed_when_no_allowed_region_is_up(
    world: dict[str, Any],
    geo: GeoDatabase,
) -> None:
    snap, req = build(world, geo)
    d = decide(req, snap, NOW)
    _svc, classes, verdict, allowed = expected(snap, req, d)
    any_up = any(healthy(snap, r) for r in allowed)
    if d.outcome is Outcome.ANSWER:
        assert d.region is not None
        assert healthy(snap, d.region)
    if classes and not any_up:
        assert d.outcome in (Outcome.FAIL_CLOSED, Outcome.DENIED)
        assert d.ipv4 == ()
        assert d.ipv6 == ()
        assert d.region is None
    if verdict.restricted:
        assert d.outcome is not Outcome.FAIL_STATIC
    if not allowed:
        assert d.outcome is Outcome.DENIED


@SETTINGS
@given(world=worlds(), other_resolver=st.sampled_from(CLIENTS))
def test_same_client_network_same_answer(
    world: dict[str, Any],
    other_resolver: str,
    geo: GeoDatabase,
) -> None:
    # Every resolver trusted: an untrusted one's own place takes part in residency (the
    # properties of that are tests/gtm/decision/test_ecs_trust.py's).
    trusting = world["policy"] | {"client_subnet": {"trusted_resolvers": ["0.0.0.0/0", "::/0"]}}
    world = world | {"ecs": True, "policy": trusting}
    snap, req = build(world, geo)
    first = decide(req, snap, NOW)
    assert decide(req, snap, NOW) == first
    # Another trusted resolver asking for the same client subnet gets the same answer.
    if ip_address(other_resolver).version == req.client.version:
        moved = DecisionRequest(
            req.channel,
            ip_address(other_resolver),
            req.service,
            req.name,
            req.ecs,
            req.residency_classes,
            req.tenant,
        )
        again = decide(moved, snap, NOW)
        assert (again.outcome, again.regions, again.ttl) == (
            first.outcome,
            first.regions,
            first.ttl,
        )


@SETTINGS
@given(
    world=worlds(),
    region=st.integers(0, 5),
    utilisation=st.floats(0, 1.6),
    can_take_work=st.booleans(),
    later=st.floats(0, 15),
    staleness=st.floats(0, 15),
)
def test_a_successor_in_the_same_epoch_decides_alike(
    world: dict[str, Any],
    region: int,
    utilisation: float,
    can_take_work: bool,
    later: float,
    staleness: float,
    geo: GeoDatabase,
) -> None:
    """What lets the answering paths keep their cached answers across a capacity report: when
    the successor keeps the decision epoch, an answer decided from the old snapshot at any time
    its window held is the successor's answer, at every instant of the successor's window."""
    snap, _ = build(world, geo)
    snap = dataclasses.replace(snap, built_at=NOW)
    ids = [r.id for r in snap.topology.regions]
    target = ids[region % len(ids)]
    arrived = NOW + later
    capacity = dict(snap.capacity)
    capacity[target] = next_capacity(
        capacity.get(target),
        utilisation,
        arrived - staleness,
        can_take_work,
        snap.topology.routing.spillover,
    )
    successor = snap.evolve(arrived, capacity=capacity)
    if successor.epoch != snap.epoch:
        event("new epoch")
        return  # the paths drop their caches
    # One step cannot keep the epoch past the old window (a report of the old snapshot turning
    # stale in between starts a new one); chains that do are the quiet-spell test's below.
    event("same epoch")
    until = time_boundary(successor, arrived)
    instants = [arrived, arrived + 0.001, min(until - 0.001, arrived + 60)]
    for client in CLIENTS:
        for use_ecs in (False, True):
            req = build(world | {"client": client, "ecs": use_ecs}, geo)[1]
            cached = decide(req, snap, NOW)
            for t in instants:
                if t < until:
                    assert decide(req, successor, t) == cached, (client, t)


def two_regions() -> dict[str, Any]:
    """Two regions of one jurisdiction reporting capacity, stale after 10 s."""
    return {
        "topology": {
            "zone": {
                "apex": "t.example.",
                "soa": {"mname": "ns.t.example.", "rname": "h.t.example.", "serial": 1},
                "nameservers": [{"name": "ns.t.example.", "ipv4": ["192.0.2.1"]}],
            },
            "regions": [
                {"id": r, "name": r, "lat": 0.0, "lon": lon, "jurisdiction": "A",
                 "ipv4": [f"192.0.2.{100 + i}"], "base_url": f"http://127.0.0.1:{9000 + i}"}
                for i, (r, lon) in enumerate((("r0", 0.0), ("r1", 10.0)))
            ],
            "services": [{"id": "svc", "dns_names": ["svc.t.example."], "regions": ["r0", "r1"]}],
            "routing": {
                "spillover": {"high_watermark": 0.85, "low_watermark": 0.7, "stale_after_s": 10}
            },
        },
        "policy": {"version": "p", "jurisdictions": {"A": ["r0", "r1"]}, "rules": [],
                   "default": {"on_unavailable": "fail_static"}},
        "health": {}, "weights": {}, "capacity": {}, "client": CLIENTS[0], "ecs": False,
        "tenant": None, "extra_class": None,
    }  # fmt: skip


def test_routine_reports_keep_the_epoch_and_decisive_ones_start_one(geo: GeoDatabase) -> None:
    world = two_regions()
    snap = dataclasses.replace(build(world, geo)[0], built_at=NOW)
    spill = snap.topology.routing.spillover

    def report(s: Snapshot, region: str, u: float, at: float, ok: bool = True) -> Snapshot:
        cap = dict(s.capacity)
        cap[region] = next_capacity(cap.get(region), u, at, ok, spill)
        return s.evolve(at, capacity=cap)

    first = report(snap, "r0", 0.3, NOW + 1)  # a region's first report: a new input
    assert first.epoch == first.version != snap.epoch
    routine = report(report(first, "r0", 0.5, NOW + 2), "r0", 0.2, NOW + 3)
    assert routine.epoch == first.epoch and routine.versions.snapshot == first.epoch
    assert routine.version == first.version + 2
    hot = report(routine, "r0", 0.9, NOW + 4)  # over the high watermark: it starts spilling
    assert hot.epoch == hot.version
    hotter = report(hot, "r0", 0.95, NOW + 5)  # a spilling region's share moves with it
    assert hotter.epoch == hotter.version
    refusing = report(routine, "r0", 0.3, NOW + 4, ok=False)
    assert refusing.epoch == refusing.version
    # Nothing for longer than the staleness limit: the old report turned stale in between.
    late = report(routine, "r0", 0.3, NOW + 3 + 11)
    assert late.epoch == late.version
    # Health, weights, policy: always a new epoch.
    down = routine.evolve(NOW + 4, health={"r1": RegionHealth(HealthState.DOWN, NOW + 4)})
    assert down.epoch == down.version


def test_cached_answers_outlive_a_quiet_spell_while_routine_reports_keep_the_epoch(
    geo: GeoDatabase,
) -> None:
    """Answers cached, then nobody asks for 20 s (twice the staleness limit) while both regions
    keep reporting routinely: the answers still hold, and the window keeps them. When a
    region falls silent instead, its report turns stale in between and they are dropped."""
    world = two_regions()
    base, req = build(world, geo)
    spill = base.topology.routing.spillover

    def report(s: Snapshot, region: str, at: float) -> Snapshot:
        cap = dict(s.capacity)
        cap[region] = next_capacity(cap.get(region), 0.3 + (at % 3) / 10, at, True, spill)
        return s.evolve(at, capacity=cap)

    def reports(first: Snapshot, until: float, silent_from: float = math.inf) -> Snapshot:
        snap, at = first, NOW + 2
        while at <= until:
            snap = report(snap, "r0", at)
            if at < silent_from:
                snap = report(snap, "r1", at)
            at += 1
        return snap

    filled = report(report(dataclasses.replace(base, built_at=NOW), "r0", NOW), "r1", NOW + 1)
    window = AnswerWindow()
    assert not window.advance(filled, NOW + 1.5)  # the first snapshot: nothing cached yet
    cached = decide(req, filled, NOW + 1.5)
    assert window.until == NOW + 10  # r0's first report turns stale then

    later = reports(filled, NOW + 21)
    assert later.epoch == filled.epoch
    assert window.advance(later, NOW + 21.5)
    assert decide(req, later, NOW + 21.5) == cached

    # The successor's own reports bound it: its last ones (NOW + 21) are fresh until NOW + 31.
    for at, holds in ((NOW + 30.5, True), (NOW + 31.5, False)):
        window = AnswerWindow()
        window.advance(filled, NOW + 1.5)
        assert window.advance(later, at) is holds

    window = AnswerWindow()
    window.advance(filled, NOW + 1.5)
    quiet = reports(filled, NOW + 21, silent_from=NOW + 5)  # r1 stale from NOW + 14
    assert quiet.epoch != filled.epoch
    assert not window.advance(quiet, NOW + 21.5)
