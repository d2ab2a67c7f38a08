"""The compliance report of a time window, recomputed rather than trusted.

For every decision row in the window: answers per jurisdiction (of the region answered), per
residency class and per service; and whether the answer was *allowed*, recomputed from the
row's recorded inputs (residency classes, tenant, the client's country and continent) under
the policy version the row names, found among the stored document versions or this node's own
files. A row whose policy version cannot be found is counted as unverifiable, never as allowed.
Beside that: the policy versions in force and who proposed and approved each, operator actions
(region events with an actor), unclean-stop gaps, and the chains' verification against their
checkpoints outside the database.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.checkpoints import CheckpointSink
from gtm.audit.schema import (
    decisions,
    document_versions,
    region_events,
)
from gtm.audit.verify import Verification, verify
from gtm.control.state import ControlState
from gtm.decision.documents import parse_yaml
from gtm.decision.policy import PolicySet, parse_policies
from gtm.decision.topology import parse_topology
from gtm.errors import GTMError

_PAGE = 5000
_EXAMPLES = 20


@dataclass
class PolicyInForce:
    policy_version: str
    answers: int = 0
    first_us: int | None = None
    last_us: int | None = None
    proposals: list[dict[str, Any]] = field(default_factory=list)  # id, author, approvers, when


@dataclass
class Compliance:
    from_us: int
    to_us: int
    store: str | None
    answers: int = 0
    rows: int = 0
    by_jurisdiction: Counter[str] = field(default_factory=Counter)
    by_class: Counter[str] = field(default_factory=Counter)
    by_service: Counter[str] = field(default_factory=Counter)
    by_outcome: Counter[str] = field(default_factory=Counter)
    by_region: Counter[str] = field(default_factory=Counter)
    outside_allowed: int = 0  # answers given to a region the policy did not allow (expected 0)
    outside_examples: list[dict[str, Any]] = field(default_factory=list)
    unverifiable: Counter[str] = field(default_factory=Counter)  # policy version -> answers
    policies: dict[str, PolicyInForce] = field(default_factory=dict)
    operator_actions: list[dict[str, Any]] = field(default_factory=list)
    # Refused page views (a role without a read): in the event log, not operators' actions.
    refused_reads: int = 0
    # residency class -> jurisdiction of the region that answered -> answers (the regulator's
    # first question); "(not answered)" for refusals, "(policy not available)" when unknown.
    by_class_jurisdiction: dict[str, Counter[str]] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    control_log: str = ""  # whether who-approved-what comes from a verified control log

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("by_jurisdiction", "by_class", "by_service", "by_outcome", "by_region"):
            out[key] = dict(sorted(getattr(self, key).items(), key=lambda kv: -kv[1]))
        out["unverifiable"] = dict(self.unverifiable)
        out["by_class_jurisdiction"] = {
            cls: dict(c.most_common()) for cls, c in sorted(self.by_class_jurisdiction.items())
        }
        return out


class Policies:
    """Policy versions by id, from stored document versions and given documents."""

    def __init__(self) -> None:
        self.by_version: dict[str, PolicySet] = {}
        self.documents: dict[str, str] = {}  # policy version -> a document version holding it

    def add(self, topology_text: str, policies: Mapping[str, str], document_id: str) -> None:
        try:
            topology = parse_topology(parse_yaml(topology_text, "topology"), document_id)
            policy = parse_policies(sorted(policies.items()), topology)
        except GTMError:
            return  # a version that does not parse cannot vouch for anything
        self.by_version.setdefault(policy.version, policy)
        self.documents.setdefault(policy.version, document_id)


NOT_ANSWERED = "(not answered)"  # refused, failed closed, no service: no region served it
NO_POLICY = "(policy not available)"  # the row's policy version is not stored anywhere


def _jurisdiction(policy: PolicySet, region: str) -> str:
    names = sorted(j for j, regions in policy.jurisdictions.items() if region in regions)
    return "+".join(names) if names else "(none)"


class Tally:
    """Pure: rows in, the report's figures out."""

    def __init__(self, report: Compliance, policies: Policies) -> None:
        self.report, self.policies = report, policies

    def add(self, row: Mapping[str, Any]) -> None:
        r, n = self.report, int(row["count"])
        r.rows += 1
        r.answers += n
        r.by_outcome[row["outcome"]] += n
        r.by_service[row["service"] or "(none)"] += n
        for cls in row["residency_classes"] or ["(unclassified)"]:
            r.by_class[cls] += n
        version = row["policy_version"]
        seen = r.policies.setdefault(version, PolicyInForce(version))
        seen.answers += n
        seen.first_us = min(seen.first_us or row["first_at_us"], row["first_at_us"])
        seen.last_us = max(seen.last_us or row["last_at_us"], row["last_at_us"])
        region = row["region"]
        policy = self.policies.by_version.get(version)
        if region is not None:
            r.by_region[region] += n
            if policy is not None:
                r.by_jurisdiction[_jurisdiction(policy, region)] += n
        if region is None:
            served = NOT_ANSWERED
        else:
            served = NO_POLICY if policy is None else _jurisdiction(policy, region)
        for cls in row["residency_classes"] or ["(unclassified)"]:
            r.by_class_jurisdiction.setdefault(cls, Counter())[served] += n
        if policy is None:
            r.unverifiable[version] += n
            return
        if region is None:
            return
        verdict = policy.evaluate(
            frozenset(row["residency_classes"] or ()),
            row["tenant"],
            row["country"],
            row["continent"],
        )
        allowed = verdict.allowed
        if verdict.unknown_classes or (allowed is not None and region not in allowed):
            r.outside_allowed += n
            if len(r.outside_examples) < _EXAMPLES:
                r.outside_examples.append(
                    {
                        "row": f"{row['node']}#{row['node_seq']}",
                        "name": row["name"],
                        "client_network": row["client_network"],
                        "country": row["country"],
                        "classes": list(row["residency_classes"] or ()),
                        "region": region,
                        "allowed": sorted(allowed) if allowed is not None else None,
                        "answers": n,
                    }
                )


async def _policies(engine: AsyncEngine, own: Iterable[tuple[str, Mapping[str, str]]]) -> Policies:
    found = Policies()
    for topology, texts in own:
        found.add(topology, texts, "this node's files")
    async with engine.connect() as conn:
        for row in await conn.execute(select(document_versions)):
            found.add(row.topology, dict(row.policies), row.id)
    return found


def _who_approved(report: Compliance, policies: Policies, control: ControlState | None) -> None:
    """Who wrote and who approved each version in the window, from the verified control log
    (the proposals and approvals tables are caches anyone with the database password can edit).
    ``None``: the log was refused or could not be read; the report says so."""
    if control is None:
        report.control_log = "refused or unreadable: who approved what is not shown"
        return
    report.control_log = f"verified through entry {control.seq}"
    wanted = {policies.documents[v]: v for v in report.policies if v in policies.documents}
    for p in sorted(control.proposals.values(), key=lambda p: p.id):
        if p.version not in wanted:
            continue
        report.policies[wanted[p.version]].proposals.append(
            {
                "proposal": p.id,
                "state": p.state,
                "author": control.name_of(p.author_id),
                "approvers": sorted(control.name_of(a.approver_id) for a in p.approvals),
                "reason": p.reason,
                "activated_at_us": p.activated_at_us,
            }
        )


async def _operator_actions(
    engine: AsyncEngine, report: Compliance, reads: frozenset[str] = frozenset()
) -> None:
    """Who did what to the fleet and its control plane. A refusal of an operation in ``reads``
    (a page view by a role that may not see it) changed nothing and asked to change nothing:
    counted, not listed."""
    query = (
        select(region_events)
        .where(region_events.c.actor.isnot(None))
        .where(region_events.c.at_us >= report.from_us, region_events.c.at_us < report.to_us)
        .order_by(region_events.c.at_us)
        .limit(1000)
    )
    async with engine.connect() as conn:
        for e in await conn.execute(query):
            if e.kind == "denied" and (e.detail or "").split(":", 1)[0] in reads:
                report.refused_reads += 1
                continue
            report.operator_actions.append(
                {
                    "at_us": e.at_us,
                    "region": e.region,
                    "kind": e.kind,
                    "state": e.state,
                    "actor": e.actor,
                    "reason": e.reason,
                    "detail": e.detail,
                }
            )


def _verification(result: Verification) -> dict[str, Any]:
    return {
        "breaks": [asdict(b) for b in result.breaks],
        "gaps": [asdict(g) for g in result.gaps],
        "checkpoints": result.checkpoints,
        "unanchored": result.unanchored,
        "chains": {
            name: {
                "rows": c.rows,
                "answers": c.answers,
                "anchored_through": c.anchored_seq,
                "last_seq": c.last_seq,
            }
            for name, c in sorted(result.chains.items())
        },
    }


async def compliance_report(
    engine: AsyncEngine,
    from_us: int,
    to_us: int,
    *,
    sink: CheckpointSink,
    own_documents: Iterable[tuple[str, Mapping[str, str]]] = (),
    control: ControlState | None = None,
    reads: frozenset[str] = frozenset(),
) -> Compliance:
    verification = await verify(engine, sink)
    report = Compliance(from_us, to_us, verification.store)
    policies = await _policies(engine, own_documents)
    tally = Tally(report, policies)
    last_id = 0
    while True:
        query = (
            select(decisions)
            .where(decisions.c.id > last_id)
            .where(decisions.c.last_at_us >= from_us, decisions.c.first_at_us < to_us)
            .order_by(decisions.c.id)
            .limit(_PAGE)
        )
        async with engine.connect() as conn:
            rows = [dict(r._mapping) for r in await conn.execute(query)]
        if not rows:
            break
        for row in rows:
            tally.add(row)
        last_id = rows[-1]["id"]
    _who_approved(report, policies, control)
    await _operator_actions(engine, report, reads)
    report.verification = _verification(verification)
    return report


__all__ = ["Compliance", "Policies", "Tally", "compliance_report"]
