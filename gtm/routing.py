"""``decide(request, snapshot, now) -> Decision``: which region serves a client.

Pure: it reads the immutable snapshot, the request and the clock value it is given, and nothing
else (the GeoIP database is memory-mapped and memoised; it does no I/O a caller waits on). The
steps follow DESIGN.md "The decision":

1. candidates  the regions that serve the service, in configured order
2. residency   every matching policy rule narrows the allowed set; nothing adds a region back
3. health      down, draining, zero-weight and "cannot take work" regions drop out
4. rank        a configured latency map first, then great-circle distance divided by weight
5. capacity    a region over its high watermark sheds the share of clients (by a stable hash of
               their network) that brings it back to its low watermark, to the next allowed
               region with fresh headroom
6. outcome     the region, its addresses, a TTL and a verdict for every candidate

Every region gets a :class:`Candidate` verdict with a reason code, so a decision explains itself.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from gtm.geoip import UNKNOWN, Location
from gtm.policy import DnsFailure, Verdict
from gtm.snapshot import HealthState, Snapshot, Versions
from gtm.topology import Region, Service

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

EARTH_RADIUS_KM = 6371.0088

# The client network recorded in the audit log and hashed for spillover: /24 and /56 by default
# (privacy: the audit never holds a full client address; stability: one resolver's clients move
# together).
V4_CLIENT_PREFIX = 24
V6_CLIENT_PREFIX = 56


class Channel(StrEnum):
    DNS = "dns"
    HTTP = "http"
    API = "api"


class Outcome(StrEnum):
    ANSWER = "answer"  # one region chosen
    FAIL_STATIC = "fail_static"  # no allowed region healthy; every allowed region answered
    FAIL_CLOSED = "fail_closed"  # no allowed region healthy; restricted: refuse
    DENIED = "denied"  # the request's class is allowed nowhere (HTTP 451)
    NO_SERVICE = "no_service"  # the name is not a configured service


class Status(StrEnum):
    CHOSEN = "chosen"
    ELIGIBLE = "eligible"  # allowed and healthy, ranked below the chosen region
    DROPPED = "dropped"


class Reason(StrEnum):
    NEAREST = "nearest"
    PREFERRED = "latency-map"
    CONFIG_ORDER = "config-order"  # location unknown, no fallback point: configured order
    SPILL_TARGET = "spill-target"
    FARTHER = "farther"
    SPILLED = "spilled"  # chosen by rank but over its watermark: this client moved on
    OVERLOADED_NO_HEADROOM = "overloaded-no-headroom"
    RESIDENCY = "residency"
    DOWN = "down"
    DRAINING = "draining"
    UNKNOWN_HEALTH = "unknown-health"
    WEIGHT_ZERO = "weight-zero"
    CANNOT_TAKE_WORK = "cannot-take-work"
    FAIL_STATIC = "fail-static"


@dataclass(frozen=True, slots=True)
class DecisionRequest:
    channel: Channel
    client: IPAddress
    service: str
    name: str  # the DNS qname or HTTP host, as asked
    ecs: IPNetwork | None = None  # EDNS Client Subnet (source prefix), when given
    residency_classes: frozenset[str] = frozenset()  # from a header or the tenant
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    region: str
    status: Status
    reason: Reason
    distance_km: float | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    region: str | None  # the chosen region (None unless outcome is ANSWER)
    regions: tuple[str, ...]  # every region answered (several for fail-static)
    ipv4: tuple[str, ...]
    ipv6: tuple[str, ...]
    base_url: str | None
    ttl: int
    candidates: tuple[Candidate, ...]
    service: str | None
    residency_classes: tuple[str, ...]
    matched_rules: tuple[str, ...]
    dns_failure: DnsFailure | None  # how DNS fails closed (FAIL_CLOSED / DENIED)
    location: Location
    client_network: IPNetwork  # truncated for privacy; the spillover hash key
    # Prefix length over which this answer holds (the ECS scope): 0 when the answer does not
    # depend on where the client is.
    scope_prefix: int
    versions: Versions


def client_network(address: IPAddress, ecs: IPNetwork | None) -> IPNetwork:
    """The client network the audit records and spillover hashes: the ECS subnet when given,
    truncated to at most /24 (v4) or /56 (v6)."""
    if ecs is not None and ecs.prefixlen > 0:
        cap = V4_CLIENT_PREFIX if ecs.version == 4 else V6_CLIENT_PREFIX
        return ecs.supernet(new_prefix=cap) if ecs.prefixlen > cap else ecs
    if address.version == 4:
        return IPv4Network((int(address) >> 8 << 8, V4_CLIENT_PREFIX))
    shift = 128 - V6_CLIENT_PREFIX
    return IPv6Network((int(address) >> shift << shift, V6_CLIENT_PREFIX))


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance; accurate to ~0.5% (the Earth is not a sphere), ample for ranking."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


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


def decide(request: DecisionRequest, snapshot: Snapshot, now: float) -> Decision:
    """Decide which region serves ``request``; see the module docstring for the steps."""
    topo = snapshot.topology
    net = client_network(request.client, request.ecs)
    service = topo.service(request.service)
    use_ecs = request.ecs is not None and request.ecs.prefixlen > 0
    location = (
        snapshot.geo.locate(request.ecs.network_address)  # type: ignore[union-attr]
        if use_ecs
        else snapshot.geo.locate(request.client)
    )
    if service is None:
        return _decision(
            snapshot, Outcome.NO_SERVICE, (), (), request, None, (), None, location, net, 0, 0
        )

    classes = set(request.residency_classes)
    if service.residency_class:
        classes.add(service.residency_class)
    verdict = snapshot.policy.evaluate(
        frozenset(classes), request.tenant, location.country, location.continent
    )
    candidates: dict[str, Candidate] = {}

    # 2. Residency: the hard filter.
    allowed: list[Region] = []
    for region_id in service.regions:
        if verdict.allowed is not None and region_id not in verdict.allowed:
            candidates[region_id] = Candidate(
                region_id, Status.DROPPED, Reason.RESIDENCY, detail=_residency_detail(verdict)
            )
        else:
            allowed.append(topo.region(region_id))
    if not allowed:
        return _decision(
            snapshot,
            Outcome.DENIED,
            (),
            _ordered(candidates, service),
            request,
            service,
            sorted(classes),
            verdict,
            location,
            net,
            0,
            0,
        )

    # 4. Rank every allowed region (before health, so a failover can be recognised).
    ranked, rank_reason, distances = _rank(allowed, location, snapshot)
    location_dependent = len(allowed) > 1 or snapshot.policy.uses_location

    # 3. Health.
    healthy: list[Region] = []
    for region in ranked:
        reason = _health_problem(region, snapshot, now)
        if reason is None:
            healthy.append(region)
        else:
            candidates[region.id] = Candidate(
                region.id, Status.DROPPED, reason, distances.get(region.id)
            )
    if not healthy:
        return _unavailable(
            snapshot,
            request,
            service,
            sorted(classes),
            verdict,
            location,
            net,
            allowed,
            candidates,
            distances,
            location_dependent,
        )

    # 5. Capacity / spillover.
    chosen, chosen_reason = healthy[0], rank_reason
    spill = topo.routing.spillover
    cap = snapshot.capacity.get(chosen.id)
    spilled_from: str | None = None
    if cap is not None and cap.spilling and now - cap.reported_at <= spill.stale_after_s:
        share = spill_share(cap.utilisation, spill.low_watermark, spill.max_share)
        if spill_point(net, chosen.id) < share:
            target = _spill_target(healthy[1:], snapshot, now)
            if target is None:
                chosen_reason = Reason.OVERLOADED_NO_HEADROOM
            else:
                candidates[chosen.id] = Candidate(
                    chosen.id,
                    Status.ELIGIBLE,
                    Reason.SPILLED,
                    distances.get(chosen.id),
                    detail=f"utilisation {cap.utilisation:.2f}, spilling {share:.0%}",
                )
                spilled_from = chosen.id
                chosen, chosen_reason = target, Reason.SPILL_TARGET

    candidates[chosen.id] = Candidate(
        chosen.id,
        Status.CHOSEN,
        chosen_reason,
        distances.get(chosen.id),
        detail=f"from {spilled_from}" if spilled_from else "",
    )
    for region in healthy:
        candidates.setdefault(
            region.id,
            Candidate(region.id, Status.ELIGIBLE, Reason.FARTHER, distances.get(region.id)),
        )

    # A client not served by its best allowed region is failing over or spilling: a short TTL
    # brings it back soon.
    degraded = chosen.id != ranked[0].id
    ttl = min(service.ttl, topo.routing.degraded_ttl) if degraded else service.ttl
    scope = _scope(location, net, request, location_dependent, spilled_from is not None)
    return _decision(
        snapshot,
        Outcome.ANSWER,
        (chosen,),
        _ordered(candidates, service),
        request,
        service,
        sorted(classes),
        verdict,
        location,
        net,
        ttl,
        scope,
    )


def _residency_detail(verdict: Verdict) -> str:
    if verdict.unknown_classes:
        return "class named by no rule: " + ",".join(verdict.unknown_classes)
    return "not allowed by " + ",".join(verdict.matched_rules)


def _rank(
    allowed: list[Region], location: Location, snapshot: Snapshot
) -> tuple[list[Region], Reason, dict[str, float]]:
    routing = snapshot.topology.routing
    order: tuple[str, ...] = ()
    if routing.latency_map:
        order = routing.latency_map.get(
            f"country:{location.country}", ()
        ) or routing.latency_map.get(f"continent:{location.continent}", ())
    point: tuple[float, float] | None = None
    if location.lat is not None and location.lon is not None:
        point = (location.lat, location.lon)
    elif routing.unknown_location is not None:
        point = routing.unknown_location
    distances: dict[str, float] = {}
    if point is not None:
        for region in allowed:
            distances[region.id] = great_circle_km(point[0], point[1], region.lat, region.lon)

    def key(item: tuple[int, Region]) -> tuple[int, float, int]:
        index, region = item
        preferred = order.index(region.id) if region.id in order else len(order)
        if point is None:
            return (preferred, 0.0, index)
        # Weight 0 is dropped by the health step; guard the division regardless.
        return (preferred, distances[region.id] / max(region.weight, 1e-9), index)

    ranked = [r for _, r in sorted(enumerate(allowed), key=key)]
    if order and ranked[0].id in order:
        reason = Reason.PREFERRED
    elif point is None:
        reason = Reason.CONFIG_ORDER
    else:
        reason = Reason.NEAREST
    return ranked, reason, distances


def _health_problem(region: Region, snapshot: Snapshot, now: float) -> Reason | None:
    if region.weight == 0:
        return Reason.WEIGHT_ZERO
    health = snapshot.health.get(region.id)
    state = health.state if health is not None else HealthState.UNKNOWN
    if state is HealthState.DOWN:
        return Reason.DOWN
    if state is HealthState.DRAINING:
        return Reason.DRAINING
    if state is HealthState.UNKNOWN and not snapshot.topology.routing.unknown_health_is_up:
        return Reason.UNKNOWN_HEALTH
    cap = snapshot.capacity.get(region.id)
    stale_after = snapshot.topology.routing.spillover.stale_after_s
    # Only a fresh report may take a region out; a stale one is ignored, not trusted.
    if cap is not None and not cap.can_take_work and now - cap.reported_at <= stale_after:
        return Reason.CANNOT_TAKE_WORK
    return None


def _spill_target(rest: Sequence[Region], snapshot: Snapshot, now: float) -> Region | None:
    spill = snapshot.topology.routing.spillover
    for region in rest:
        cap = snapshot.capacity.get(region.id)
        # Only a region that proves headroom with a fresh report takes spilled clients.
        if (
            cap is not None
            and not cap.spilling
            and now - cap.reported_at <= spill.stale_after_s
            and cap.utilisation < spill.high_watermark
        ):
            return region
    return None


def _unavailable(
    snapshot: Snapshot,
    request: DecisionRequest,
    service: Service,
    classes: list[str],
    verdict: Verdict,
    location: Location,
    net: IPNetwork,
    allowed: list[Region],
    candidates: dict[str, Candidate],
    distances: dict[str, float],
    location_dependent: bool,
) -> Decision:
    """No allowed region is healthy: fail closed if restricted, else the policy's action."""
    if verdict.restricted:
        return _decision(
            snapshot,
            Outcome.FAIL_CLOSED,
            (),
            _ordered(candidates, service),
            request,
            service,
            classes,
            verdict,
            location,
            net,
            0,
            0,
        )
    # Fail static: every allowed region answers (still inside the allowed set, rule 1).
    for region in allowed:
        candidates[region.id] = Candidate(
            region.id,
            Status.CHOSEN,
            Reason.FAIL_STATIC,
            distances.get(region.id),
            detail=candidates[region.id].reason.value,
        )
    ttl = min(service.ttl, snapshot.topology.routing.degraded_ttl)
    return _decision(
        snapshot,
        Outcome.FAIL_STATIC,
        tuple(allowed),
        _ordered(candidates, service),
        request,
        service,
        classes,
        verdict,
        location,
        net,
        ttl,
        0,
    )


def _scope(
    location: Location,
    net: IPNetwork,
    request: DecisionRequest,
    location_dependent: bool,
    spilled: bool,
) -> int:
    if not location_dependent:
        return 0
    scope = location.network.prefixlen if location.network is not None else net.prefixlen
    if spilled:
        scope = max(scope, net.prefixlen)  # the spill hash is over the client network
    if request.ecs is not None:
        scope = min(scope, request.ecs.prefixlen)
    return scope


def _ordered(candidates: dict[str, Candidate], service: Service) -> tuple[Candidate, ...]:
    return tuple(candidates[r] for r in service.regions if r in candidates)


def _decision(
    snapshot: Snapshot,
    outcome: Outcome,
    regions: tuple[Region, ...],
    candidates: tuple[Candidate, ...],
    request: DecisionRequest,
    service: Service | None,
    classes: Sequence[str],
    verdict: Verdict | None,
    location: Location,
    net: IPNetwork,
    ttl: int,
    scope: int,
) -> Decision:
    failed = outcome in (Outcome.FAIL_CLOSED, Outcome.DENIED)
    return Decision(
        outcome=outcome,
        region=regions[0].id if outcome is Outcome.ANSWER else None,
        regions=tuple(r.id for r in regions),
        ipv4=tuple(str(a) for r in regions for a in r.ipv4),
        ipv6=tuple(str(a) for r in regions for a in r.ipv6),
        base_url=str(regions[0].base_url).rstrip("/") if outcome is Outcome.ANSWER else None,
        ttl=ttl,
        candidates=candidates,
        service=service.id if service is not None else None,
        residency_classes=tuple(classes),
        matched_rules=verdict.matched_rules if verdict is not None else (),
        dns_failure=verdict.dns_failure if (failed and verdict is not None) else None,
        location=location,
        client_network=net,
        scope_prefix=scope,
        versions=snapshot.versions,
    )


__all__ = [
    "UNKNOWN",
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
    "spill_point",
    "spill_share",
]
