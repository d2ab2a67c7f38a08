"""Residency policy: documents, the merged policy set, and its pure evaluation.

A policy set is every document in ``policies/`` read together. Documents name jurisdictions
(groups of regions) and rules; a rule matches on residency class, tenant and client geography
and allows a set of regions. Every matching rule constrains the request, and their allowed sets
compose by intersection: a later rule can narrow what an earlier one allowed, never widen it.

What happens when no allowed region is available is the strictest action among the matching
rules (``reject`` beats ``fail_static``), else the default's. A rule that matches a residency
class must reject: a restricted class has no catch-all answer (DESIGN.md rule 1). A class that no
rule names is allowed nowhere, so a typo in a header or a service fails closed, never open.

Client geography comes from the EDNS Client Subnet when a DNS query carries one, and anyone can
send one. The set names the resolvers whose ECS it believes (``client_subnet.trusted_resolvers``);
for a query from any other sender a geographic rule applies when it matches the ECS *or* the
sender's own address, so the places' rules compose by intersection like any others and an ECS can
narrow residency but never loosen it, or, for a rule with ``untrusted_ecs: refuse``, a request on
which the two places disagree is allowed nowhere.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gtm.decision.documents import parse_yaml, validate_document
from gtm.decision.topology import Topology
from gtm.errors import ConfigError, Problem


class Action(StrEnum):
    REJECT = "reject"  # fail closed
    FAIL_STATIC = "fail_static"  # answer with every allowed region, ignoring health


class DnsFailure(StrEnum):
    """How a DNS answer fails closed; HTTP always answers 503 with Retry-After."""

    REFUSED = "refused"
    NODATA = "nodata"
    SERVFAIL = "servfail"


class UntrustedEcs(StrEnum):
    """What a geographic rule does with an ECS from a resolver that is not trusted."""

    # The rule applies when the ECS or the resolver's address matches it: with every other rule
    # that matches either place, allowed sets intersect (the stricter of the two places).
    STRICTER = "stricter"
    # When exactly one of the two places matches the rule, the request is allowed nowhere.
    REFUSE = "refuse"


# A client's place as residency rules read it: (country, continent), either unknown.
Place = tuple[str | None, str | None]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Match(_Strict):
    """Every field given must match; a field left empty matches anything."""

    residency_class: tuple[str, ...] = ()
    tenant: tuple[str, ...] = ()
    client_country: tuple[str, ...] = Field(default=(), description="ISO 3166-1 alpha-2 codes")
    client_continent: tuple[str, ...] = Field(default=(), description="AF AN AS EU NA OC SA")

    @property
    def uses_location(self) -> bool:
        return bool(self.client_country or self.client_continent)


class Allow(_Strict):
    jurisdictions: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _something(self) -> Self:
        if not (self.jurisdictions or self.regions):
            raise ValueError("allow needs at least one jurisdiction or region")
        return self


class Rule(_Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,79}$")
    description: str = ""
    match: Match
    allow: Allow
    on_unavailable: Action = Action.REJECT
    dns_failure: DnsFailure = DnsFailure.REFUSED
    untrusted_ecs: UntrustedEcs = Field(
        default=UntrustedEcs.STRICTER,
        description="when a DNS query's ECS comes from a resolver outside"
        " client_subnet.trusted_resolvers: stricter (the rule applies if the ECS or the"
        " resolver's address matches it) or refuse (allowed nowhere when only one of them does)",
    )

    @model_validator(mode="after")
    def _restricted_fails_closed(self) -> Self:
        if self.match.residency_class and self.on_unavailable is not Action.REJECT:
            raise ValueError(
                f"rule {self.id} matches a residency class and must use on_unavailable: reject"
                " (a restricted class never fails open)"
            )
        if self.untrusted_ecs is UntrustedEcs.REFUSE and not self.match.uses_location:
            raise ValueError(
                f"rule {self.id}: untrusted_ecs: refuse needs a rule that matches client_country"
                " or client_continent (a rule that ignores the client's place cannot disagree)"
            )
        return self


class Default(_Strict):
    """What applies to requests no rejecting rule covers (unrestricted traffic)."""

    on_unavailable: Action = Action.FAIL_STATIC
    dns_failure: DnsFailure = DnsFailure.SERVFAIL


class ClientSubnet(_Strict):
    """Whose EDNS Client Subnet (RFC 7871) geographic rules believe."""

    trusted_resolvers: tuple[IPv4Network | IPv6Network, ...] = Field(
        default=(),
        description="networks of resolvers whose ECS is believed for rules on client geography;"
        " from any other sender the ECS may steer proximity but never loosens residency",
    )


class PolicyDocument(_Strict):
    """One YAML document under ``policies/``."""

    version: str = Field(min_length=1, description="a label for people; the set's hash is the id")
    description: str = ""
    jurisdictions: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    rules: tuple[Rule, ...] = ()
    default: Default | None = None
    client_subnet: ClientSubnet | None = None


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy document (checked in as ``policies/schema.json``)."""
    schema = PolicyDocument.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "GTM residency policy document"
    return schema


class NetworkSet:
    """A set of IP networks with an O(log n) membership test (merged, sorted ranges)."""

    __slots__ = ("_ends", "_starts", "networks")

    def __init__(self, networks: Iterable[IPv4Network | IPv6Network] = ()) -> None:
        self.networks = tuple(networks)
        ranges = sorted(
            (n.version, int(n.network_address), int(n.broadcast_address)) for n in self.networks
        )
        merged: list[list[int]] = []
        for version, first, last in ranges:
            start, end = (version << 128) | first, (version << 128) | last
            if merged and start <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [m[0] for m in merged]
        self._ends = [m[1] for m in merged]

    def __contains__(self, address: IPv4Address | IPv6Address) -> bool:
        if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a v4 peer on a dual-stack socket
        key = (address.version << 128) | int(address)
        i = bisect_right(self._starts, key) - 1
        return i >= 0 and key <= self._ends[i]

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __repr__(self) -> str:
        return f"NetworkSet({[str(n) for n in self.networks]})"


@dataclass(frozen=True, slots=True)
class CompiledRule:
    rule: Rule
    allowed: frozenset[str]
    classes: frozenset[str]
    tenants: frozenset[str]
    countries: frozenset[str]
    continents: frozenset[str]

    def matches(
        self,
        classes: frozenset[str],
        tenant: str | None,
        country: str | None,
        continent: str | None,
    ) -> bool:
        if self.classes and not (self.classes & classes):
            return False
        if self.tenants and tenant not in self.tenants:
            return False
        # An unknown location never matches a geographic rule: it cannot be proven to apply.
        if self.countries and country not in self.countries:
            return False
        return not (self.continents and continent not in self.continents)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the policy says about one request."""

    allowed: frozenset[str] | None  # None: unconstrained (every candidate stays)
    matched_rules: tuple[str, ...]
    action: Action
    dns_failure: DnsFailure
    unknown_classes: tuple[str, ...]  # classes no rule names: allowed nowhere
    # Judged on two places (an untrusted ECS and its resolver's address): the rules only one
    # of them matched, and of those the ones that refuse on such a disagreement.
    disputed: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()

    @property
    def restricted(self) -> bool:
        return self.action is Action.REJECT


@dataclass(frozen=True, slots=True)
class PolicySet:
    """Every policy document, merged and compiled for evaluation."""

    documents: tuple[tuple[str, PolicyDocument], ...]
    jurisdictions: dict[str, frozenset[str]]
    rules: tuple[CompiledRule, ...]
    default: Default
    version: str
    known_classes: frozenset[str]
    uses_location: bool  # some rule matches on client geography
    # Resolvers whose ECS geographic rules believe (client_subnet.trusted_resolvers).
    trusted_resolvers: NetworkSet = field(default_factory=NetworkSet)

    def evaluate(
        self,
        classes: frozenset[str],
        tenant: str | None,
        country: str | None,
        continent: str | None,
        resolver: Place | None = None,
    ) -> Verdict:
        """Apply every matching rule; allowed sets intersect.

        ``resolver``: the place of a resolver whose ECS (``country``, ``continent``) is not
        trusted. A rule then matches when either place matches it (the stricter of the two),
        and a rule with ``untrusted_ecs: refuse`` that only one place matches allows nothing.

        >>> policy = load_policy([Path("policies")])  # the bundled documents
        >>> verdict = policy.evaluate(frozenset({"eu-personal"}), None, "DE", "EU")
        >>> sorted(verdict.allowed)
        ['eu-central', 'eu-west']
        """
        allowed: frozenset[str] | None = None
        matched: list[str] = []
        disputed: list[str] = []
        refused: list[str] = []
        action = self.default.on_unavailable
        dns_failure = self.default.dns_failure
        rejecting = False
        for compiled in self.rules:
            here = compiled.matches(classes, tenant, country, continent)
            there = here if resolver is None else compiled.matches(classes, tenant, *resolver)
            if not (here or there):
                continue
            rule = compiled.rule
            matched.append(rule.id)
            rule_allows = compiled.allowed
            if here != there:
                disputed.append(rule.id)
                if rule.untrusted_ecs is UntrustedEcs.REFUSE:
                    refused.append(rule.id)
                    rule_allows = frozenset()
            allowed = rule_allows if allowed is None else allowed & rule_allows
            if rule.on_unavailable is Action.REJECT and not rejecting:
                rejecting = True
                action = Action.REJECT
                dns_failure = rule.dns_failure
        if refused and not rejecting:
            # Allowed nowhere is a refusal whatever the rule does when its regions are down.
            action, dns_failure = Action.REJECT, DnsFailure.REFUSED
        unknown = tuple(sorted(classes - self.known_classes))
        if unknown:
            allowed = frozenset()
            action = Action.REJECT
            if not rejecting:
                dns_failure = DnsFailure.REFUSED
        return Verdict(
            allowed, tuple(matched), action, dns_failure, unknown, tuple(disputed), tuple(refused)
        )


def compile_policy(documents: Sequence[tuple[str, PolicyDocument]]) -> PolicySet:
    """Merge documents into one set; :class:`ConfigError` lists every conflict."""
    problems: list[Problem] = []
    jurisdictions: dict[str, frozenset[str]] = {}
    where_defined: dict[str, str] = {}
    default: Default | None = None
    default_source = ""
    client_subnet: ClientSubnet | None = None
    client_subnet_source = ""
    for source, doc in documents:
        for name, regions in doc.jurisdictions.items():
            group = frozenset(regions)
            if name in jurisdictions and jurisdictions[name] != group:
                problems.append(
                    Problem(
                        source,
                        f"jurisdictions.{name}",
                        f"conflicts with the definition in {where_defined[name]}",
                    )
                )
            jurisdictions[name] = group
            where_defined.setdefault(name, source)
        if doc.default is not None:
            if default is not None:
                problems.append(
                    Problem(source, "default", f"a default is already set in {default_source}")
                )
            default, default_source = doc.default, source
        if doc.client_subnet is not None:
            # One place says whose ECS is believed, as one place holds the default: a list
            # merged from several documents would let any of them widen the trust.
            if client_subnet is not None:
                problems.append(
                    Problem(
                        source,
                        "client_subnet",
                        f"client_subnet is already set in {client_subnet_source}",
                    )
                )
            client_subnet, client_subnet_source = doc.client_subnet, source

    compiled: list[CompiledRule] = []
    seen_ids: dict[str, str] = {}
    for source, doc in documents:
        for i, rule in enumerate(doc.rules):
            loc = f"rules[{i}]"
            if rule.id in seen_ids:
                problems.append(
                    Problem(
                        source,
                        f"{loc}.id",
                        f"rule id {rule.id!r} is also used in {seen_ids[rule.id]}",
                    )
                )
            seen_ids[rule.id] = source
            allowed = set(rule.allow.regions)
            for j, name in enumerate(rule.allow.jurisdictions):
                if name not in jurisdictions:
                    problems.append(
                        Problem(
                            source,
                            f"{loc}.allow.jurisdictions[{j}]",
                            f"unknown jurisdiction {name!r}",
                        )
                    )
                else:
                    allowed |= jurisdictions[name]
            m = rule.match
            compiled.append(
                CompiledRule(
                    rule,
                    frozenset(allowed),
                    frozenset(m.residency_class),
                    frozenset(m.tenant),
                    frozenset(c.upper() for c in m.client_country),
                    frozenset(c.upper() for c in m.client_continent),
                )
            )
    if problems:
        raise ConfigError(problems)

    canonical = json.dumps(
        [_canonical(doc) for _, doc in sorted(documents, key=lambda d: d[0])],
        sort_keys=True,
    ).encode()
    return PolicySet(
        documents=tuple(documents),
        jurisdictions=jurisdictions,
        rules=tuple(compiled),
        default=default or Default(),
        version=hashlib.sha256(canonical).hexdigest()[:16],
        known_classes=frozenset(c for r in compiled for c in r.classes),
        uses_location=any(r.rule.match.uses_location for r in compiled),
        trusted_resolvers=NetworkSet(client_subnet.trusted_resolvers if client_subnet else ()),
    )


def _canonical(doc: PolicyDocument) -> dict[str, Any]:
    """The document as its set's version hashes it. Fields added since versions were first
    recorded are left out while they hold their defaults, so a document that does not use them
    keeps the version its audit rows name (the compliance report finds policies by version)."""
    data = doc.model_dump(mode="json")
    if data.get("client_subnet") is None:
        data.pop("client_subnet", None)
    for rule in data["rules"]:
        if rule.get("untrusted_ecs") == UntrustedEcs.STRICTER.value:
            rule.pop("untrusted_ecs")
    return data


def topology_problems(policy: PolicySet, topology: Topology) -> list[Problem]:
    """References from the policy set to the topology that do not resolve."""
    problems: list[Problem] = []
    for source, doc in policy.documents:
        for name, regions in doc.jurisdictions.items():
            for j, region in enumerate(regions):
                if not topology.has_region(region):
                    problems.append(
                        Problem(source, f"jurisdictions.{name}[{j}]", f"unknown region {region!r}")
                    )
        for i, rule in enumerate(doc.rules):
            for j, region in enumerate(rule.allow.regions):
                if not topology.has_region(region):
                    problems.append(
                        Problem(
                            source, f"rules[{i}].allow.regions[{j}]", f"unknown region {region!r}"
                        )
                    )
    for i, svc in enumerate(topology.services):
        if svc.residency_class and svc.residency_class not in policy.known_classes:
            problems.append(
                Problem(
                    "topology",
                    f"services[{i}].residency_class",
                    f"class {svc.residency_class!r} is named by no policy rule (it would be allowed"
                    " nowhere)",
                )
            )
    return problems


def policy_files(paths: Iterable[Path]) -> list[Path]:
    """Expand directories to their ``*.yaml``/``*.yml`` files, in name order."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.suffix in {".yaml", ".yml"}))
        else:
            files.append(path)
    return files


def load_policy(paths: Iterable[Path], topology: Topology | None = None) -> PolicySet:
    """Read, validate and merge policy documents; every problem in every file at once."""
    files = policy_files(paths)
    if not files:
        raise ConfigError([Problem("policies", "", "no policy documents found")])
    problems: list[Problem] = []
    sources: list[tuple[str, str]] = []
    for path in files:
        try:
            sources.append((str(path), path.read_text(encoding="utf-8")))
        except OSError as exc:
            problems.append(Problem(str(path), "", f"cannot read file: {exc.strerror}"))
    if problems:
        raise ConfigError(problems)
    return parse_policies(sources, topology)


def parse_policies(
    sources: Sequence[tuple[str, str]], topology: Topology | None = None
) -> PolicySet:
    """Validate and merge policy documents given as (name, YAML text): files, or documents
    published through the shared database."""
    if not sources:
        raise ConfigError([Problem("policies", "", "no policy documents found")])
    problems: list[Problem] = []
    documents: list[tuple[str, PolicyDocument]] = []
    for name, text in sources:
        try:
            documents.append(
                (name, validate_document(PolicyDocument, parse_yaml(text, name), name))
            )
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    policy = compile_policy(documents)
    if topology is not None:
        problems = topology_problems(policy, topology)
        if problems:
            raise ConfigError(problems)
    return policy
