"""Residency policy: documents, the merged policy set, and its pure evaluation.

A policy set is every document in ``policies/`` read together. Documents name jurisdictions
(groups of regions) and rules; a rule matches on residency class, tenant and client geography
and allows a set of regions. Every matching rule constrains the request, and their allowed sets
compose by intersection: a later rule can narrow what an earlier one allowed, never widen it.

What happens when no allowed region is available is the strictest action among the matching
rules (``reject`` beats ``fail_static``), else the default's. A rule that matches a residency
class must reject: a restricted class has no catch-all answer (DESIGN.md rule 1). A class that no
rule names is allowed nowhere, so a typo in a header or a service fails closed, never open.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
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

    @model_validator(mode="after")
    def _restricted_fails_closed(self) -> Self:
        if self.match.residency_class and self.on_unavailable is not Action.REJECT:
            raise ValueError(
                f"rule {self.id} matches a residency class and must use on_unavailable: reject"
                " (a restricted class never fails open)"
            )
        return self


class Default(_Strict):
    """What applies to requests no rejecting rule covers (unrestricted traffic)."""

    on_unavailable: Action = Action.FAIL_STATIC
    dns_failure: DnsFailure = DnsFailure.SERVFAIL


class PolicyDocument(_Strict):
    """One YAML document under ``policies/``."""

    version: str = Field(min_length=1, description="a label for people; the set's hash is the id")
    description: str = ""
    jurisdictions: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    rules: tuple[Rule, ...] = ()
    default: Default | None = None


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy document (checked in as ``policies/schema.json``)."""
    schema = PolicyDocument.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "GTM residency policy document"
    return schema


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

    def evaluate(
        self,
        classes: frozenset[str],
        tenant: str | None,
        country: str | None,
        continent: str | None,
    ) -> Verdict:
        """Apply every matching rule; allowed sets intersect.

        >>> verdict = policy.evaluate(frozenset({"eu-personal"}), None, "DE", "EU")
        >>> sorted(verdict.allowed)
        ['eu-central', 'eu-west']
        """
        allowed: frozenset[str] | None = None
        matched: list[str] = []
        action = self.default.on_unavailable
        dns_failure = self.default.dns_failure
        rejecting = False
        for compiled in self.rules:
            if not compiled.matches(classes, tenant, country, continent):
                continue
            matched.append(compiled.rule.id)
            allowed = compiled.allowed if allowed is None else allowed & compiled.allowed
            if compiled.rule.on_unavailable is Action.REJECT and not rejecting:
                rejecting = True
                action = Action.REJECT
                dns_failure = compiled.rule.dns_failure
        unknown = tuple(sorted(classes - self.known_classes))
        if unknown:
            allowed = frozenset()
            action = Action.REJECT
            if not rejecting:
                dns_failure = DnsFailure.REFUSED
        return Verdict(allowed, tuple(matched), action, dns_failure, unknown)


def compile_policy(documents: Sequence[tuple[str, PolicyDocument]]) -> PolicySet:
    """Merge documents into one set; :class:`ConfigError` lists every conflict."""
    problems: list[Problem] = []
    jurisdictions: dict[str, frozenset[str]] = {}
    where_defined: dict[str, str] = {}
    default: Default | None = None
    default_source = ""
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
        [doc.model_dump(mode="json") for _, doc in sorted(documents, key=lambda d: d[0])],
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
    )


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
