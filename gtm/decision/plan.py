"""Routing plans: steps 1-4 of a decision, worked out once per snapshot and reused.

Within one snapshot, candidates, residency, health and ranking depend only on the service, the
residency classes, the tenant and the client's location (and, for an ECS the policy does not
trust, the place of the resolver that sent it), never on the individual client. A
:class:`Plan` holds their result; :func:`plan_for` memoises plans on the snapshot so a query
pays for a dictionary lookup instead of policy evaluation and great-circle arithmetic. Only
capacity spillover, which hashes the client network, is left to each query
(``gtm.decision.routing``).

A plan can also depend on the clock: a fresh "cannot take work" report drops a region only until
it goes stale. Each plan records the time window in which it holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from math import asin, sqrt
from typing import NamedTuple

from gtm.decision import memos
from gtm.decision.geoip import Location
from gtm.decision.geometry import EARTH_RADIUS_KM, UnitVector, unit_vector
from gtm.decision.model import Candidate, Outcome, Reason, Status
from gtm.decision.policy import DnsFailure, Place, Verdict
from gtm.decision.snapshot import HealthState, RegionView, Snapshot
from gtm.decision.topology import Service

# A flood of random subnets makes a location, so a plan, per GeoIP network: past the limit (a
# share of the memory budget, gtm.decision.memos) the memo is cleared and refills with the
# working set (a plan costs some tens of microseconds to make).
_DIAMETER_KM = 2 * EARTH_RADIUS_KM


# The fields of a Decision before ``location``, in order.
Head = tuple[
    Outcome,
    str | None,
    tuple[str, ...],
    tuple[str, ...],
    tuple[str, ...],
    str | None,
    int,
    tuple[Candidate, ...],
    Mapping[str, float],
    str | None,
    tuple[str, ...],
    tuple[str, ...],
    DnsFailure | None,
]


class Plan(NamedTuple):
    service: Service
    classes: tuple[str, ...]
    verdict: Verdict
    outcome: Outcome  # ANSWER, FAIL_STATIC, FAIL_CLOSED or DENIED
    healthy: tuple[RegionView, ...]  # allowed and healthy, best first
    answered: tuple[RegionView, ...]  # what is answered unless spillover changes it
    candidates: tuple[Candidate, ...]  # verdicts when ``answered`` is the answer
    distances: Mapping[str, float]
    ttl: int
    location_dependent: bool  # the answer could differ elsewhere (ECS scope > 0)
    valid_after: float  # the plan holds for valid_after < now <= valid_until
    valid_until: float
    # The first fields of the Decision this plan gives unless spillover changes it (see
    # decision_head); a query adds only what is its own (location, network, scope).
    head: Head | None = None


def decision_head(
    plan: Plan,
    outcome: Outcome,
    regions: tuple[RegionView, ...],
    candidates: tuple[Candidate, ...],
    ttl: int,
) -> Head:
    """The fields of a :class:`~gtm.decision.model.Decision` before ``location``, in order."""
    answer = outcome is Outcome.ANSWER
    failed = outcome is Outcome.FAIL_CLOSED or outcome is Outcome.DENIED
    return (
        outcome,
        regions[0].id if answer else None,
        tuple(r.id for r in regions),
        tuple(a for r in regions for a in r.ipv4),
        tuple(a for r in regions for a in r.ipv6),
        regions[0].base_url if answer else None,
        ttl,
        candidates,
        plan.distances,
        plan.service.id,
        plan.classes,
        plan.verdict.matched_rules,
        plan.verdict.dns_failure if failed else None,
    )


def _with_head(plan: Plan) -> Plan:
    return plan._replace(
        head=decision_head(plan, plan.outcome, plan.answered, plan.candidates, plan.ttl)
    )


def plan_for(
    snapshot: Snapshot,
    service: Service,
    classes: frozenset[str],
    tenant: str | None,
    location: Location,
    now: float,
    resolver: Place | None = None,
) -> Plan:
    """The plan for one kind of request; ``resolver``: the place of a resolver whose ECS the
    policy does not trust, when it differs from the ECS's (residency is judged on both)."""
    key = (
        service.id,
        classes,
        tenant,
        location.country,
        location.continent,
        location.lat,
        location.lon,
        resolver,
    )
    plan: Plan | None = snapshot.plans.get(key)
    if plan is None or not (plan.valid_after < now <= plan.valid_until):
        plan = _with_head(make_plan(snapshot, service, classes, tenant, location, now, resolver))
        if len(snapshot.plans) >= memos.LIMITS.plans:
            snapshot.plans.clear()  # bounded memory; the working set refills at once
        snapshot.plans[key] = plan
    return plan


def make_plan(
    snapshot: Snapshot,
    service: Service,
    extra_classes: frozenset[str],
    tenant: str | None,
    location: Location,
    now: float,
    resolver: Place | None = None,
) -> Plan:
    """Steps 1-4 of DESIGN.md "The decision" for one kind of request; on a fenced snapshot,
    restricted traffic fails closed or gets the degraded TTL, as the fence says (a node cut off
    from the fleet may hold a residency policy the fleet has since tightened)."""
    plan = _make_plan(snapshot, service, extra_classes, tenant, location, now, resolver)
    if snapshot.fence is None or not plan.verdict.restricted:
        return plan
    if snapshot.fence == "short_ttl":
        return plan._replace(ttl=min(plan.ttl, snapshot.topology.routing.degraded_ttl))
    candidates = tuple(
        c
        if c.status is Status.DROPPED
        else Candidate(c.region, Status.DROPPED, Reason.FENCED, "node cut off from the fleet")
        for c in plan.candidates
    )
    return plan._replace(
        outcome=Outcome.FAIL_CLOSED, healthy=(), answered=(), candidates=candidates, ttl=0
    )


def _make_plan(
    snapshot: Snapshot,
    service: Service,
    extra_classes: frozenset[str],
    tenant: str | None,
    location: Location,
    now: float,
    resolver: Place | None,
) -> Plan:
    classes = (
        extra_classes | {service.residency_class} if service.residency_class else extra_classes
    )
    verdict = _verdict(snapshot, classes, tenant, location, resolver)
    # What the ECS's place alone allows: a region it allows that the verdict drops was dropped
    # because the ECS was not believed, and its reason says so.
    believed = verdict if resolver is None else _verdict(snapshot, classes, tenant, location, None)
    sorted_classes = tuple(sorted(classes))

    # 1-2. Candidates, then residency: the hard filter. Nothing later adds a region back.
    # 4 before 3: every allowed region is ranked, so that answering from a region other than
    # the best-ranked one is recognisable as a failover (short TTL).
    ranking = _rank(snapshot, service, verdict, location)
    candidates: dict[str, Candidate] = {}
    if verdict.allowed is not None:
        detail = _residency_detail(verdict)
        untrusted = _untrusted_detail(verdict, resolver) if resolver is not None else ""
        for region_id in service.regions:
            if region_id in verdict.allowed:
                continue
            if resolver is not None and (believed.allowed is None or region_id in believed.allowed):
                candidates[region_id] = Candidate(
                    region_id, Status.DROPPED, Reason.UNTRUSTED_ECS, untrusted
                )
            else:
                candidates[region_id] = Candidate(
                    region_id, Status.DROPPED, Reason.RESIDENCY, detail
                )
    if not ranking.order:
        return Plan(
            service,
            sorted_classes,
            verdict,
            Outcome.DENIED,
            (),
            (),
            _ordered(candidates, service),
            {},
            0,
            False,
            -math.inf,
            math.inf,
        )
    location_dependent = len(ranking.order) > 1 or snapshot.policy.uses_location

    # 3. Health.
    problems = _health_table(snapshot)
    valid_after, valid_until = -math.inf, math.inf
    healthy: list[RegionView] = []
    for region in ranking.order:
        reason = problems[region.id]
        if reason is None:
            refusal = snapshot.capacity.get(region.id)
            if refusal is not None and not refusal.can_take_work:
                # Only a fresh report takes a region out; a stale one is ignored, not trusted.
                expiry = refusal.reported_at + snapshot.topology.routing.spillover.stale_after_s
                if now <= expiry:
                    reason = Reason.CANNOT_TAKE_WORK
                    valid_until = min(valid_until, expiry)
                else:
                    valid_after = max(valid_after, expiry)
        if reason is None:
            healthy.append(region)
        else:
            candidates[region.id] = Candidate(region.id, Status.DROPPED, reason)

    degraded_ttl = min(service.ttl, snapshot.topology.routing.degraded_ttl)
    if not healthy:
        if verdict.restricted:
            return Plan(
                service,
                sorted_classes,
                verdict,
                Outcome.FAIL_CLOSED,
                (),
                (),
                _ordered(candidates, service),
                ranking.distances,
                0,
                location_dependent,
                valid_after,
                valid_until,
            )
        # Fail static: every allowed region answers (still inside the allowed set, rule 1).
        for region in ranking.order:
            candidates[region.id] = Candidate(
                region.id, Status.CHOSEN, Reason.FAIL_STATIC, candidates[region.id].reason.value
            )
        answered = tuple(
            snapshot.regions[r] for r in service.regions if r in {v.id for v in ranking.order}
        )
        return Plan(
            service,
            sorted_classes,
            verdict,
            Outcome.FAIL_STATIC,
            (),
            answered,
            _ordered(candidates, service),
            ranking.distances,
            degraded_ttl,
            False,
            valid_after,
            valid_until,
        )

    chosen = healthy[0]
    candidates[chosen.id] = Candidate(chosen.id, Status.CHOSEN, ranking.reason)
    for region in healthy[1:]:
        candidates[region.id] = Candidate(region.id, Status.ELIGIBLE, Reason.FARTHER)
    # A client not served by its best allowed region is failing over: a short TTL brings it
    # back soon after the region recovers.
    ttl = degraded_ttl if chosen is not ranking.order[0] else service.ttl
    return Plan(
        service,
        sorted_classes,
        verdict,
        Outcome.ANSWER,
        tuple(healthy),
        (chosen,),
        _ordered(candidates, service),
        ranking.distances,
        ttl,
        location_dependent,
        valid_after,
        valid_until,
    )


def _verdict(
    snapshot: Snapshot,
    classes: frozenset[str],
    tenant: str | None,
    location: Location,
    resolver: Place | None,
) -> Verdict:
    # Verdicts depend on the policy and a few request attributes only: a few hundred distinct
    # keys, kept across snapshots that keep the policy.
    key = (classes, tenant, location.country, location.continent, resolver)
    verdict: Verdict | None = snapshot.verdicts.get(key)
    if verdict is None:
        verdict = snapshot.policy.evaluate(
            classes, tenant, location.country, location.continent, resolver
        )
        if len(snapshot.verdicts) >= memos.LIMITS.plans:
            snapshot.verdicts.clear()
        snapshot.verdicts[key] = verdict
    return verdict


def _residency_detail(verdict: Verdict) -> str:
    if verdict.unknown_classes:
        return "class named by no rule: " + ",".join(verdict.unknown_classes)
    return "not allowed by " + ",".join(verdict.matched_rules)


def _untrusted_detail(verdict: Verdict, resolver: Place) -> str:
    """Why a region the ECS's place allows is dropped: the resolver that sent the ECS is not
    trusted, so residency was judged on its address too."""
    place = f"{resolver[0] or '??'}/{resolver[1] or '??'}"
    if verdict.refused:
        why = "refused by " + ",".join(verdict.refused) + " (ECS and resolver disagree)"
    else:
        why = "not allowed by " + ",".join(verdict.disputed or verdict.matched_rules)
    return f"{why}; judged on the ECS and the resolver's address ({place}): ECS not trusted"


class Ranking(NamedTuple):
    order: tuple[RegionView, ...]  # the allowed regions, best first
    reason: Reason  # why the first is first
    distances: Mapping[str, float]


def _rank(snapshot: Snapshot, service: Service, verdict: Verdict, location: Location) -> Ranking:
    # Rankings depend on the topology, the allowed set and the location, not on health: kept
    # across snapshots that keep the topology.
    key = (
        service.id,
        verdict.allowed,
        location.lat,
        location.lon,
        location.country,
        location.continent,
    )
    ranking: Ranking | None = snapshot.ranks.get(key)
    if ranking is None:
        ranking = _unmemoised_rank(snapshot, service, verdict, location)
        if len(snapshot.ranks) >= memos.LIMITS.plans:
            snapshot.ranks.clear()
        snapshot.ranks[key] = ranking
    return ranking


def _unmemoised_rank(
    snapshot: Snapshot, service: Service, verdict: Verdict, location: Location
) -> Ranking:
    allowed = [
        snapshot.regions[r]
        for r in service.regions
        if verdict.allowed is None or r in verdict.allowed
    ]
    return _ranking(allowed, location, snapshot)


def _ranking(allowed: list[RegionView], location: Location, snapshot: Snapshot) -> Ranking:
    if not allowed:
        return Ranking((), Reason.NEAREST, {})
    routing = snapshot.topology.routing
    preferred: tuple[str, ...] = ()
    if routing.latency_map:
        preferred = routing.latency_map.get(
            f"country:{location.country}", ()
        ) or routing.latency_map.get(f"continent:{location.continent}", ())
    point: UnitVector | None = None
    if location.lat is not None and location.lon is not None:
        point = unit_vector(location.lat, location.lon)
    elif routing.unknown_location is not None:
        point = unit_vector(*routing.unknown_location)
    distances: dict[str, float] = {}
    keyed = []
    last = len(preferred)
    for index, region in enumerate(allowed):
        rid = region.id
        rank = preferred.index(rid) if rid in preferred else last
        score = 0.0
        if point is not None:
            # chord_km inlined (a new client place ranks every region: a flood of random
            # subnets makes tens of thousands of places), to the same float.
            (ax, ay, az), (bx, by, bz) = point, region.point
            dx, dy, dz = ax - bx, ay - by, az - bz
            km = _DIAMETER_KM * asin(min(1.0, sqrt(dx * dx + dy * dy + dz * dz) / 2))
            distances[rid] = km
            # Weight 0 is dropped by the health step; guard the division regardless.
            score = km / max(region.weight, 1e-9)
        keyed.append((rank, score, index, region))
    keyed.sort()  # the index is unique: regions themselves are never compared
    order = tuple(k[3] for k in keyed)
    if preferred and order[0].id in preferred:
        reason = Reason.PREFERRED
    elif point is None:
        reason = Reason.CONFIG_ORDER
    else:
        reason = Reason.NEAREST
    return Ranking(order, reason, distances)


_HEALTH_KEY = ("health-table",)


def _health_table(snapshot: Snapshot) -> dict[str, Reason | None]:
    """Why each region is out on health alone (None: it is in), once per snapshot."""
    table: dict[str, Reason | None] | None = snapshot.plans.get(_HEALTH_KEY)
    if table is None:
        unknown_is_up = snapshot.topology.routing.unknown_health_is_up
        table = {}
        for region in snapshot.regions.values():
            health = snapshot.health.get(region.id)
            state = health.state if health is not None else HealthState.UNKNOWN
            if region.weight == 0:
                table[region.id] = Reason.WEIGHT_ZERO
            elif state is HealthState.DOWN:
                table[region.id] = Reason.DOWN
            elif state is HealthState.DRAINING:
                table[region.id] = Reason.DRAINING
            elif state is HealthState.UNKNOWN and not unknown_is_up:
                table[region.id] = Reason.UNKNOWN_HEALTH
            else:
                table[region.id] = None
        snapshot.plans[_HEALTH_KEY] = table
    return table


def _ordered(candidates: dict[str, Candidate], service: Service) -> tuple[Candidate, ...]:
    return tuple(candidates[r] for r in service.regions if r in candidates)


def location_class(
    snapshot: Snapshot, service: Service, location: Location, resolver: Place | None
) -> tuple[object, ...]:
    """What a DNS plan (no extra residency classes, no tenant) reads of ``location``: its
    country and continent (the policy's rules, the latency map) and the order in which its
    coordinates rank the regions the verdict allows. Two locations of one class, with the same
    resolver place, get plans that differ only in their distances, so decisions that differ
    only in location, client network and scope (``gtm.geodns.shapes`` renders one answer per
    class). Costs a ranking, not memoised: the DNS responder keeps each place's class in
    tables its memory budget bounds (``gtm.geodns.shapes``) and asks again only for a place
    they no longer hold; a memo here too held eight thousand rankings with their distances
    (memray: 7 MiB) outside that budget, and hit only what the responder had dropped."""
    classes = frozenset({service.residency_class}) if service.residency_class else frozenset()
    verdict = _verdict(snapshot, classes, None, location, resolver)
    ranking = _unmemoised_rank(snapshot, service, verdict, location)
    return (
        service.id,
        location.country,
        location.continent,
        resolver,
        tuple(r.id for r in ranking.order),
        ranking.reason,
    )
