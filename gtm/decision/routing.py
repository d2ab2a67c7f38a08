"""``decide(request, snapshot, now) -> Decision``: which region serves a client.

Pure: it reads the immutable snapshot, the request and the clock value it is given, and nothing
else (the GeoIP database is memory-mapped and memoised; it does no I/O a caller waits on). The
steps follow DESIGN.md "The decision":

1. candidates  the regions that serve the service, in configured order
2. residency   every matching policy rule narrows the allowed set; nothing adds a region back
               (an ECS from a resolver the policy does not trust is judged together with the
               resolver's own address: it can narrow the set, never widen it)
3. health      down, draining, zero-weight and "cannot take work" regions drop out
4. rank        a configured latency map first, then great-circle distance divided by weight
5. capacity    a region being re-admitted after an outage takes back a growing share of its
               clients, and a region over its high watermark sheds the share of clients that
               brings it back to its low watermark, to the next allowed region with fresh
               headroom; both choose clients by a stable hash of their network
6. outcome     the region, its addresses, a TTL and a verdict for every candidate

Steps 1-4 do not depend on the individual client and are memoised per snapshot
(:mod:`gtm.decision.plan`); step 5 and the outcome are worked out per query.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from ipaddress import IPv4Network, IPv6Network

from gtm.decision import memos
from gtm.decision.geoip import Location
from gtm.decision.geometry import great_circle_km
from gtm.decision.model import (
    Basis,
    Candidate,
    Channel,
    Decision,
    DecisionRequest,
    IPAddress,
    IPNetwork,
    Outcome,
    Reason,
    Status,
)
from gtm.decision.plan import Head, Plan, decision_head, plan_for
from gtm.decision.policy import Place
from gtm.decision.snapshot import RegionView, Snapshot

# The client network recorded in the audit log and hashed for spillover: /24 and /56 by default
# (privacy: the audit never holds a full client address; stability: one resolver's clients move
# together).
V4_CLIENT_PREFIX = 24
V6_CLIENT_PREFIX = 56
_V6_SHIFT = 128 - V6_CLIENT_PREFIX


_NETWORKS: dict[tuple[int, int], IPNetwork] = {}
# About 300 bytes a memoised network, at most a share of the memory budget (gtm.decision.memos);
# under a random-subnet flood it clears often: a miss costs an ipaddress object, never memory.


def client_network(address: IPAddress, ecs: IPNetwork | None) -> IPNetwork:
    """The client network the audit records and spillover hashes: the ECS subnet when given,
    truncated to at most /24 (v4) or /56 (v6)."""
    if ecs is not None and ecs.prefixlen > 0:
        cap = V4_CLIENT_PREFIX if ecs.version == 4 else V6_CLIENT_PREFIX
        if ecs.prefixlen <= cap:
            return ecs
        address = ecs.network_address
    # Memoised: constructing ipaddress networks costs more than the rest of a warm decision,
    # and the same client networks recur constantly.
    key = (address.version, int(address) >> (8 if address.version == 4 else _V6_SHIFT))
    net = _NETWORKS.get(key)
    if net is None:
        if len(_NETWORKS) >= memos.LIMITS.networks:
            _NETWORKS.clear()
        if address.version == 4:
            net = IPv4Network((key[1] << 8, V4_CLIENT_PREFIX))
        else:
            net = IPv6Network((key[1] << _V6_SHIFT, V6_CLIENT_PREFIX))
        _NETWORKS[key] = net
    return net


def spill_point(network: IPNetwork, region: str) -> float:
    """A stable number in [0, 1) for a client network: the same network always lands on the same
    side of a spill share, so raising the share only ever moves more networks, never different
    ones."""
    key = network.network_address.packed + bytes([network.prefixlen]) + region.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64


def spill_share(utilisation: float, low_watermark: float, max_share: float) -> float:
    """The share of a spilling region's clients to move: what brings it back to the low
    watermark (shedding (u - low)/u of the load leaves low), capped at ``max_share``."""
    if utilisation <= low_watermark or utilisation <= 0:
        return 0.0
    return min(max_share, (utilisation - low_watermark) / utilisation)


def residency_basis(snapshot: Snapshot, client: IPAddress, ecs: IPNetwork | None) -> Basis:
    """Which address residency is judged on for a request from ``client`` carrying ``ecs``."""
    if ecs is None or ecs.prefixlen == 0:
        return Basis.ADDRESS  # an ECS of prefix 0 says nothing about the client (RFC 7871 7.1.2)
    return Basis.ECS if client in snapshot.policy.trusted_resolvers else Basis.ECS_AND_ADDRESS


def resolver_place(
    snapshot: Snapshot, client: IPAddress, ecs: IPNetwork | None, ecs_location: Location
) -> Place | None:
    """The place of the resolver ``client`` when residency must be judged on it as well as on
    its ``ecs`` (located at ``ecs_location``): the ECS is not trusted, some rule reads client
    geography, and the two places differ. None when the ECS's place alone decides.

    Answer caches keyed by the ECS add this to their key: two resolvers sending the same ECS
    may get different answers."""
    return resolver_place_on(snapshot, client, residency_basis(snapshot, client, ecs), ecs_location)


def resolver_place_on(
    snapshot: Snapshot, client: IPAddress, basis: Basis, ecs_location: Location
) -> Place | None:
    """:func:`resolver_place` with the residency basis already known (it depends on the
    sender and the policy only: a caller answering many ECS subnets from one resolver works it
    out once)."""
    if basis is not Basis.ECS_AND_ADDRESS or not snapshot.policy.uses_location:
        return None
    at = snapshot.geo.locate(client)
    if at.country == ecs_location.country and at.continent == ecs_location.continent:
        return None
    return (at.country, at.continent)


def decide(request: DecisionRequest, snapshot: Snapshot, now: float) -> Decision:
    """Decide which region serves ``request``; see the module docstring for the steps."""
    ecs = request.ecs
    net = client_network(request.client, ecs)
    basis = residency_basis(snapshot, request.client, ecs)
    location = snapshot.geo.locate(
        ecs.network_address if ecs is not None and basis is not Basis.ADDRESS else request.client
    )
    resolver = resolver_place_on(snapshot, request.client, basis, location)
    service = snapshot.services.get(request.service)
    if service is None:
        return Decision(
            Outcome.NO_SERVICE,
            None,
            (),
            (),
            (),
            None,
            0,
            (),
            {},
            None,
            tuple(sorted(request.residency_classes)),
            (),
            None,
            location,
            net,
            0,
            snapshot.versions,
            basis,
        )
    plan = plan_for(
        snapshot, service, request.residency_classes, request.tenant, location, now, resolver
    )
    head = plan.head
    assert head is not None  # plan_for always fills it
    if plan.outcome is not Outcome.ANSWER:
        return Decision(*head, location, net, 0, snapshot.versions, basis)

    # 5. Re-admission, then capacity / spillover, per client network.
    # While a share splits clients by network (re-admission or spillover of the chosen
    # region), every answer's scope is the client network, the ones kept as well as the ones
    # moved: another network under the same GeoIP network may be on the other side.
    chosen = plan.healthy[0]
    health = snapshot.health.get(chosen.id)
    readmitting = health is not None and health.admitted < 1.0 and len(plan.healthy) > 1
    if (
        readmitting
        and health is not None
        # The highest points come back first: the spill share (below) sheds the lowest, so a
        # region that spills while it ramps up does not send away the clients just readmitted.
        and spill_point(net, chosen.id) <= 1.0 - health.admitted
    ):
        held = _held_back_head(plan, health.admitted, snapshot)
        scope = _scope(location, net, ecs, plan.location_dependent, spilled=True)
        return Decision(*held, location, net, scope, snapshot.versions, basis, True)
    spill = snapshot.topology.routing.spillover
    cap = snapshot.capacity.get(chosen.id)
    sharing = cap is not None and cap.spilling and now - cap.reported_at <= spill.stale_after_s
    if (
        cap is None
        or not sharing
        or spill_point(net, chosen.id)
        >= spill_share(cap.utilisation, spill.low_watermark, spill.max_share)
    ):
        split = readmitting or sharing
        scope = _scope(location, net, ecs, plan.location_dependent, spilled=split)
        return Decision(*head, location, net, scope, snapshot.versions, basis, split)

    spilled = _spilled_head(plan, cap.utilisation, snapshot, now)
    scope = _scope(location, net, ecs, plan.location_dependent, spilled=True)
    return Decision(*spilled, location, net, scope, snapshot.versions, basis, True)


def _spilled_head(plan: Plan, utilisation: float, snapshot: Snapshot, now: float) -> Head:
    """The decision head of a client that spills from the plan's first region: the same for
    every such client of this plan in this snapshot, while the reports it read stay fresh."""
    memo = snapshot.spills.get(id(plan))
    if memo is not None and memo[0] is plan and memo[1] < now <= memo[2]:
        return memo[3]  # type: ignore[no-any-return]
    chosen = plan.healthy[0]
    spill = snapshot.topology.routing.spillover
    target, valid_after, valid_until = _spill_target(plan.healthy[1:], snapshot, now)
    if target is None:
        candidates = _replace(
            plan.candidates,
            Candidate(
                chosen.id,
                Status.CHOSEN,
                Reason.OVERLOADED_NO_HEADROOM,
                f"utilisation {utilisation:.2f}, no allowed region with headroom",
            ),
        )
        head = decision_head(plan, Outcome.ANSWER, plan.answered, candidates, plan.ttl)
    else:
        share = spill_share(utilisation, spill.low_watermark, spill.max_share)
        candidates = _replace(
            _replace(
                plan.candidates,
                Candidate(
                    chosen.id,
                    Status.ELIGIBLE,
                    Reason.SPILLED,
                    f"utilisation {utilisation:.2f}, spilling {share:.0%}",
                ),
            ),
            Candidate(target.id, Status.CHOSEN, Reason.SPILL_TARGET, f"from {chosen.id}"),
        )
        ttl = min(plan.ttl, snapshot.topology.routing.degraded_ttl)
        head = decision_head(plan, Outcome.ANSWER, (target,), candidates, ttl)
    if len(snapshot.spills) >= memos.LIMITS.plans // 4:  # each holds its plan (memos.py)
        snapshot.spills.clear()
    # Holding the plan in the entry keeps its id from being reused by another plan.
    snapshot.spills[id(plan)] = (plan, valid_after, valid_until, head)
    return head


def _held_back_head(plan: Plan, admitted: float, snapshot: Snapshot) -> Head:
    """A client its recovering best region has not re-admitted yet stays on the next healthy
    allowed region, where failover had sent it (rule 1: plan.healthy is inside the allowed set).
    Rare and brief, so not memoised."""
    chosen, target = plan.healthy[0], plan.healthy[1]
    candidates = _replace(
        _replace(
            plan.candidates,
            Candidate(
                chosen.id, Status.ELIGIBLE, Reason.READMITTING, f"re-admitted {admitted:.0%}"
            ),
        ),
        Candidate(target.id, Status.CHOSEN, Reason.READMIT_HOLD, f"while {chosen.id} returns"),
    )
    ttl = min(plan.ttl, snapshot.topology.routing.degraded_ttl)
    return decision_head(plan, Outcome.ANSWER, (target,), candidates, ttl)


def _spill_target(
    rest: Sequence[RegionView], snapshot: Snapshot, now: float
) -> tuple[RegionView | None, float, float]:
    """The next region with proven headroom, and the window in which that answer holds."""
    spill = snapshot.topology.routing.spillover
    valid_after, valid_until = -math.inf, math.inf
    for region in rest:
        cap = snapshot.capacity.get(region.id)
        if cap is None:
            continue
        expiry = cap.reported_at + spill.stale_after_s
        if now > expiry:
            valid_after = max(valid_after, expiry)
            continue
        valid_until = min(valid_until, expiry)
        # Only a region that proves headroom with a fresh report takes spilled clients.
        if not cap.spilling and cap.utilisation < spill.high_watermark:
            return region, valid_after, valid_until
    return None, valid_after, valid_until


def _replace(candidates: tuple[Candidate, ...], new: Candidate) -> tuple[Candidate, ...]:
    return tuple(new if c.region == new.region else c for c in candidates)


def _scope(
    location: Location,
    net: IPNetwork,
    ecs: IPNetwork | None,
    location_dependent: bool,
    spilled: bool,
) -> int:
    if not location_dependent:
        return 0
    scope = location.network.prefixlen if location.network is not None else net.prefixlen
    if spilled:
        scope = max(scope, net.prefixlen)  # the spill hash is over the client network
    if ecs is not None:
        scope = min(scope, ecs.prefixlen)
    return scope


__all__ = [
    "Basis",
    "Candidate",
    "Channel",
    "Decision",
    "DecisionRequest",
    "Outcome",
    "Reason",
    "Status",
    "client_network",
    "decide",
    "great_circle_km",
    "residency_basis",
    "resolver_place",
    "resolver_place_on",
    "spill_point",
    "spill_share",
]
