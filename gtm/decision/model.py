"""The vocabulary of a decision: what is asked (:class:`DecisionRequest`) and what is decided
(:class:`Decision`, with a :class:`Candidate` verdict and reason code for every region)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import NamedTuple

from gtm.decision.geoip import Location
from gtm.decision.policy import DnsFailure
from gtm.decision.snapshot import Versions

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network


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
    SPILLED = "spilled"  # ranked first but over its watermark: this client moved on
    OVERLOADED_NO_HEADROOM = "overloaded-no-headroom"
    RESIDENCY = "residency"
    # Allowed by the rules the ECS's place matches, dropped by those of the address it came
    # from: a resolver outside the policy's trusted_resolvers cannot loosen residency.
    UNTRUSTED_ECS = "untrusted-ecs"
    DOWN = "down"
    DRAINING = "draining"
    UNKNOWN_HEALTH = "unknown-health"
    WEIGHT_ZERO = "weight-zero"
    CANNOT_TAKE_WORK = "cannot-take-work"
    FAIL_STATIC = "fail-static"
    READMITTING = "readmitting"  # back from an outage, this client not re-admitted yet
    READMIT_HOLD = "readmit-hold"  # keeps the client while its best region is re-admitted
    FENCED = "fenced"  # this node is cut off from the fleet: restricted traffic fails closed
    # Kept in the region that served the client's session (HTTP proxy mode, gtm.front.affinity),
    # chosen among the regions this decision left allowed and healthy.
    SESSION_AFFINITY = "session-affinity"


class Basis(StrEnum):
    """Which address residency rules on client geography were judged on."""

    ADDRESS = "address"  # the connection's own address: no ECS
    ECS = "ecs"  # the ECS, sent by a trusted resolver
    # The ECS and the address of the resolver that sent it, which is not trusted: a rule that
    # either place matches applies (or refuses, per rule), so the ECS never loosens residency.
    ECS_AND_ADDRESS = "ecs+address"


@dataclass(frozen=True, slots=True)
class DecisionRequest:
    channel: Channel
    client: IPAddress
    service: str
    name: str  # the DNS qname or HTTP host, as asked
    ecs: IPNetwork | None = None  # EDNS Client Subnet (source prefix), when given
    residency_classes: frozenset[str] = frozenset()  # from a header or the tenant
    tenant: str | None = None


# Candidate and Decision are NamedTuples rather than frozen dataclasses: equally immutable, and
# several times cheaper to construct, which the answering path does for every query.
class Candidate(NamedTuple):
    region: str
    status: Status
    reason: Reason
    detail: str = ""


class Decision(NamedTuple):
    outcome: Outcome
    region: str | None  # the chosen region (None unless outcome is ANSWER)
    regions: tuple[str, ...]  # every region answered (several for fail-static)
    ipv4: tuple[str, ...]
    ipv6: tuple[str, ...]
    base_url: str | None
    ttl: int
    candidates: tuple[Candidate, ...]
    # Great-circle distance from the client to each allowed region (empty when the location is
    # unknown); one mapping shared by every decision with the same ranking.
    distances: Mapping[str, float]
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
    residency_basis: Basis = Basis.ADDRESS
    # The answer depends on the client network itself, not only on where it is: a re-admission
    # or spill share splits the chosen region's clients by a hash of their network. Answers
    # for one GeoIP location can then differ from network to network (gtm.geodns.shapes).
    by_network: bool = False
