"""The topology document: the DNS zone, the regions and the services they serve.

Loaded from YAML and validated as a whole; cross-references (a service naming an unknown region,
a DNS name outside the zone, a duplicate id) are reported together with field errors.

Example (see ``examples/demo.yaml`` for a complete one)::

    zone:
      apex: gtm.example.
      soa: {mname: ns1.gtm.example., rname: hostmaster.gtm.example., serial: 1}
      nameservers: [{name: ns1.gtm.example., ipv4: [192.0.2.53]}]
      records:                  # static records: gtm.decision.static_records
        - {name: "@", type: TXT, text: "example-site-verification=4f2a"}
        - {name: api, type: CNAME, target: chat.gtm.example.}
    regions:
      - {id: eu-west, name: Dublin, lat: 53.35, lon: -6.26, jurisdiction: EU,
         ipv4: [192.0.2.30], base_url: "https://eu-west.gtm.example"}
    services:
      - {id: chat, dns_names: [chat.gtm.example.], regions: [eu-west]}
    fleet:                      # optional: the nodes whose signed health observations count
      members:                  # public_key: 64 hex digits (raw Ed25519) or a PEM block
        - {id: gtm-1, public_key: 08ff75fff311dd786262e7cfebd37e929e3963d706aaa6683b50d4ac9c15edd1}
"""

from __future__ import annotations

import hashlib
import json
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path
from typing import Annotated, Literal, Self

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    PrivateAttr,
    field_validator,
    model_validator,
)

from gtm.decision.documents import read_yaml, validate_document
from gtm.decision.static_records import (
    MAX_RECORDS,
    StaticRecord,
    record_problems,
    untagged_location,
)
from gtm.errors import ConfigError, Problem

RegionId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]


def normalise_dns_name(value: str) -> str:
    """Lower-case, absolute (trailing dot) form used as the key of every DNS name."""
    name = value.strip().lower()
    if not name or name == ".":
        raise ValueError("a DNS name must not be empty")
    if not name.endswith("."):
        name += "."
    labels = name[:-1].split(".")
    if any(not label or len(label) > 63 for label in labels):
        raise ValueError(f"{value!r} is not a valid DNS name (empty or over-long label)")
    if len(name) > 254:
        raise ValueError(f"{value!r} is longer than 253 characters")
    return name


def in_zone(name: str, apex: str) -> bool:
    return name == apex or name.endswith("." + apex)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SOA(_Strict):
    mname: str
    rname: str
    serial: int = Field(ge=0, lt=2**32)
    refresh: int = Field(default=3600, ge=0)
    retry: int = Field(default=600, ge=0)
    expire: int = Field(default=1_209_600, ge=0)
    # RFC 2308: the negative-caching TTL is min(SOA TTL, SOA minimum).
    minimum: int = Field(default=60, ge=0)

    @field_validator("mname", "rname")
    @classmethod
    def _names(cls, v: str) -> str:
        return normalise_dns_name(v)


class NameServer(_Strict):
    name: str
    ipv4: tuple[IPv4Address, ...] = ()
    ipv6: tuple[IPv6Address, ...] = ()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return normalise_dns_name(v)


class Zone(_Strict):
    apex: str
    soa: SOA
    nameservers: tuple[NameServer, ...] = Field(min_length=1)
    ttl: int = Field(default=3600, ge=0, description="TTL of the SOA and NS records")
    # Static records (A, AAAA, CNAME, TXT, CAA, MX, SRV): gtm.decision.static_records.
    records: tuple[StaticRecord, ...] = Field(default=(), max_length=MAX_RECORDS)

    @field_validator("apex")
    @classmethod
    def _apex(cls, v: str) -> str:
        return normalise_dns_name(v)

    @field_validator("records", mode="before")
    @classmethod
    def _record_types(cls, v: object) -> object:
        # Types are case-insensitive, as in zone files ("mx" is MX).
        if isinstance(v, list | tuple):
            return [
                {**r, "type": r["type"].upper()}
                if isinstance(r, dict) and isinstance(r.get("type"), str)
                else r
                for r in v
            ]
        return v

    @model_validator(mode="after")
    def _glue(self) -> Self:
        for i, ns in enumerate(self.nameservers):
            # Glue is only needed (and only allowed to be served) for names inside the zone.
            if in_zone(ns.name, self.apex) and not (ns.ipv4 or ns.ipv6):
                raise ValueError(
                    f"nameservers[{i}] {ns.name} is inside the zone and needs glue (ipv4/ipv6)"
                )
        return self


class Region(_Strict):
    id: RegionId
    name: str
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)
    jurisdiction: str = Field(min_length=1)
    ipv4: tuple[IPv4Address, ...] = ()
    ipv6: tuple[IPv6Address, ...] = ()
    base_url: HttpUrl
    probe_url: HttpUrl | None = None
    weight: float = Field(default=1.0, ge=0, description="0 takes the region out of ranking")

    @model_validator(mode="after")
    def _answers(self) -> Self:
        if not (self.ipv4 or self.ipv6):
            raise ValueError(f"region {self.id} needs at least one answer address (ipv4/ipv6)")
        return self


class HttpFront(_Strict):
    """How the HTTP front answers for a service's hosts."""

    # redirect: 307/308 to the chosen region's base URL; proxy: forward and stream back.
    mode: Literal["redirect", "proxy"] = "redirect"
    # 307 and 308 both keep the method and body (never 302); 308 may be cached by clients.
    redirect_status: Literal[307, 308] = 307


class Service(_Strict):
    id: RegionId
    dns_names: tuple[str, ...] = ()
    http_hosts: tuple[str, ...] = ()
    regions: tuple[RegionId, ...] = Field(min_length=1)
    residency_class: str | None = None
    ttl: int = Field(default=30, ge=0, le=86_400)
    http: HttpFront = HttpFront()

    @field_validator("dns_names")
    @classmethod
    def _dns_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(normalise_dns_name(n) for n in v)

    @field_validator("http_hosts")
    @classmethod
    def _hosts(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(h.strip().lower().rstrip(".") for h in v)

    @model_validator(mode="after")
    def _reachable(self) -> Self:
        if not (self.dns_names or self.http_hosts):
            raise ValueError(f"service {self.id} needs at least one DNS name or HTTP host")
        return self


class Spillover(_Strict):
    high_watermark: float = Field(default=0.85, gt=0)
    low_watermark: float = Field(default=0.70, gt=0)
    stale_after_s: float = Field(default=10.0, gt=0)
    max_share: float = Field(default=0.9, ge=0, le=1)

    @model_validator(mode="after")
    def _order(self) -> Self:
        if self.low_watermark >= self.high_watermark:
            raise ValueError("low_watermark must be below high_watermark (hysteresis band)")
        return self


class Routing(_Strict):
    spillover: Spillover = Spillover()
    # Regions whose health has not been established yet: treated as up (cold start serves
    # traffic) unless configured otherwise.
    unknown_health_is_up: bool = True
    # TTL used while the answer is degraded (fail-static, spill) so clients come back soon.
    degraded_ttl: int = Field(default=10, ge=0)
    # A region back from down or draining takes its clients back gradually over this window (a
    # linear ramp by a stable hash of client networks), so a cold region is not hit by all of
    # its traffic at once; 0 re-admits at once.
    readmit_window_s: float = Field(default=10.0, ge=0)
    # Preferred region order for clients in a country or continent, ahead of distance. Keys are
    # "country:DE" or "continent:EU" (the prefixes keep "AS", Asia, apart from American Samoa);
    # a country entry wins over its continent's.
    latency_map: dict[
        Annotated[str, Field(pattern=r"^(country|continent):[A-Z]{2}$")], tuple[RegionId, ...]
    ] = Field(default_factory=dict)
    # Clients whose location is unknown are ranked by distance from this point when given,
    # else in the service's configured region order.
    unknown_location: tuple[float, float] | None = None


class Safety(_Strict):
    """Rules operator controls must keep (Route 53 ARC-style safety rules): a change that breaks
    one is refused unless an admin overrides it with a reason (:mod:`gtm.fleet.safety`)."""

    # Regions out of service at once (drained, forced down, weight 0, or down), at most;
    # unset: half of the regions.
    max_regions_out: int | None = Field(default=None, ge=0)
    # Every residency class the policy restricts keeps at least one allowed region in service.
    keep_every_class_served: bool = True


class Tenant(_Strict):
    """A customer, recognised on HTTP by an API-key prefix or a tenant header."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")
    api_key_prefixes: tuple[str, ...] = ()
    # Classes every request of this tenant carries, on top of the service's own.
    residency_classes: tuple[str, ...] = ()


# A node's observer id (GTM_OBSERVER_ID, else GTM_NODE_ID): what its observations are signed as.
MemberId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^\S+$")]


def public_key_bytes(text: str) -> bytes:
    """The raw 32 bytes of an Ed25519 public key given as PEM (SubjectPublicKeyInfo) or as 64
    hex digits; ValueError saying what is wrong otherwise."""
    value = text.strip()
    if value.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(value.encode())
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not a PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("not an Ed25519 public key")
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ValueError(
            "not an Ed25519 public key: give 64 hex digits (the raw key) or a PEM block"
        ) from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes (64 hex digits), not {len(raw)}")
    return raw


class FleetMember(_Strict):
    """One GTM node whose health observations count: its observer id and the public half of its
    observation signing key (``gtm.fleet.observation_seal``)."""

    id: MemberId
    public_key: str = Field(min_length=1, max_length=1000)

    @field_validator("public_key")
    @classmethod
    def _key(cls, v: str) -> str:
        public_key_bytes(v)
        return v.strip()

    def key(self) -> bytes:
        return public_key_bytes(self.public_key)


class Fleet(_Strict):
    """The fleet's membership: only these nodes' signed observations count towards a region's
    state, and a state needs a majority of them. Empty: GTM_HEALTH_MEMBERS, else the node alone
    (``gtm.fleet.observation_seal.membership``)."""

    members: tuple[FleetMember, ...] = Field(default=(), max_length=256)


class Topology(_Strict):
    zone: Zone
    regions: tuple[Region, ...] = Field(min_length=1)
    services: tuple[Service, ...] = Field(min_length=1)
    routing: Routing = Routing()
    tenants: tuple[Tenant, ...] = ()
    safety: Safety = Safety()
    fleet: Fleet = Fleet()

    _regions_by_id: dict[str, Region] = PrivateAttr(default_factory=dict)
    _by_name: dict[str, Service] = PrivateAttr(default_factory=dict)
    _by_host: dict[str, Service] = PrivateAttr(default_factory=dict)
    _by_id: dict[str, Service] = PrivateAttr(default_factory=dict)
    _fingerprint: str = PrivateAttr(default="")

    def model_post_init(self, context: object, /) -> None:
        # Indexes for the answering path, built once (the model is frozen).
        self._regions_by_id = {r.id: r for r in self.regions}
        self._by_name = {n: s for s in self.services for n in s.dns_names}
        self._by_host = {h: s for s in self.services for h in s.http_hosts}
        self._by_id = {s.id: s for s in self.services}
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        self._fingerprint = hashlib.sha256(canonical).hexdigest()[:16]

    def region(self, region_id: str) -> Region:
        return self._regions_by_id[region_id]

    def has_region(self, region_id: str) -> bool:
        return region_id in self._regions_by_id

    def service_by_dns_name(self, name: str) -> Service | None:
        return self._by_name.get(name)

    def service_by_host(self, host: str) -> Service | None:
        return self._by_host.get(host.lower().rstrip("."))

    def service(self, service_id: str) -> Service | None:
        return self._by_id.get(service_id)

    def fingerprint(self) -> str:
        """A short content hash: the topology version recorded with every decision."""
        return self._fingerprint


def _duplicates(values: list[str]) -> list[str]:
    return sorted({v for v in values if values.count(v) > 1})


def cross_reference_problems(topo: Topology) -> list[tuple[str, str]]:
    """Checks that span several parts of the document, as (location, message) pairs."""
    problems: list[tuple[str, str]] = []
    for dup in _duplicates([r.id for r in topo.regions]):
        problems.append(("regions", f"region id {dup!r} is defined more than once"))
    for dup in _duplicates([t.id for t in topo.tenants]):
        problems.append(("tenants", f"tenant id {dup!r} is defined more than once"))
    for dup in _duplicates([s.id for s in topo.services]):
        problems.append(("services", f"service id {dup!r} is defined more than once"))
    problems += _membership_problems(topo.fleet)
    seen_names: dict[str, str] = {}
    seen_hosts: dict[str, str] = {}
    for i, svc in enumerate(topo.services):
        for j, r in enumerate(svc.regions):
            if not topo.has_region(r):
                problems.append((f"services[{i}].regions[{j}]", f"unknown region {r!r}"))
        for j, name in enumerate(svc.dns_names):
            loc = f"services[{i}].dns_names[{j}]"
            if not in_zone(name, topo.zone.apex):
                problems.append((loc, f"{name} is outside the zone {topo.zone.apex}"))
            if name in seen_names:
                problems.append((loc, f"{name} is already used by service {seen_names[name]!r}"))
            seen_names[name] = svc.id
        for j, host in enumerate(svc.http_hosts):
            if host in seen_hosts:
                problems.append(
                    (
                        f"services[{i}].http_hosts[{j}]",
                        f"{host} is already used by service {seen_hosts[host]!r}",
                    )
                )
            seen_hosts[host] = svc.id
    for key, order in topo.routing.latency_map.items():
        for r in order:
            if not topo.has_region(r):
                problems.append((f"routing.latency_map.{key}", f"unknown region {r!r}"))
    zone = topo.zone
    problems += record_problems(
        zone.apex,
        zone.ttl,
        zone.records,
        seen_names,
        frozenset(ns.name for ns in zone.nameservers if in_zone(ns.name, zone.apex)),
    )
    return problems


def _membership_problems(fleet: Fleet) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for dup in _duplicates([m.id for m in fleet.members]):
        problems.append(("fleet.members", f"member id {dup!r} is listed more than once"))
    holder: dict[bytes, str] = {}
    for i, member in enumerate(fleet.members):
        raw = member.key()
        if raw in holder and holder[raw] != member.id:
            problems.append(
                (
                    f"fleet.members[{i}].public_key",
                    f"{member.id!r} has the same key as {holder[raw]!r}: each node signs with "
                    "its own key, or one node's observations would count as two votes",
                )
            )
        holder.setdefault(raw, member.id)
    return problems


def load_topology(path: Path) -> Topology:
    """Read and validate a topology file; :class:`ConfigError` lists every problem."""
    return parse_topology(read_yaml(path), str(path))


def parse_topology(data: object, source: str = "<string>") -> Topology:
    try:
        topo = validate_document(Topology, data, source)
    except ConfigError as exc:
        # A static record's errors name the record's path, not the union member tried.
        raise ConfigError(
            [Problem(p.source, untagged_location(p.location), p.message) for p in exc.problems]
        ) from exc
    problems = cross_reference_problems(topo)
    if problems:
        raise ConfigError([Problem(source, loc, msg) for loc, msg in problems])
    return topo
