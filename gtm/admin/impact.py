"""What a draft would change: recorded traffic replayed through ``decide()`` under both versions.

The audit store holds the inputs of every answer (name, client network, ECS, residency classes,
tenant) with a count. :func:`analyse` decides each distinct input twice, under the snapshot in
force and under the same snapshot with the draft's topology and policies (same health and
capacity, so only the documents differ), and weighs every difference by the answers it stands
for: answers that would move to another region, newly fail closed, newly be answered, and,
marked as the ones a compliance officer must read first, answers that would be served in
another jurisdiction than before.

Pure: no database, no clock; the caller reads the inputs (:func:`gtm.audit.query.decision_inputs`)
and builds the snapshots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from ipaddress import ip_network

from gtm.audit.query import RecordedInput
from gtm.decision.model import Channel, Decision, DecisionRequest, Outcome
from gtm.decision.routing import decide
from gtm.decision.snapshot import Snapshot

# Outcomes that answer no client: a refusal, or a name the documents no longer serve.
_REFUSED = (Outcome.FAIL_CLOSED, Outcome.DENIED, Outcome.NO_SERVICE)
_EXAMPLES = 20
Leak = tuple[str, str, str]  # residency class, from jurisdiction(s), to jurisdiction(s)


@dataclass(frozen=True, slots=True)
class Change:
    example: str  # "node#node_seq" of a recorded row with these inputs
    name: str
    client_network: str
    residency_classes: tuple[str, ...]
    tenant: str | None
    answers: int
    before: str  # region, or the outcome when none
    after: str
    left_jurisdiction: bool


@dataclass
class Impact:
    inputs: int = 0
    answers: int = 0
    moved: int = 0  # answers whose region would change
    newly_refused: int = 0  # answered before, refused after (fail closed, denied, no service)
    newly_answered: int = 0  # refused before, answered after
    left_jurisdiction: int = 0  # answered in a region of another jurisdiction than before
    by_service: dict[str, Counter[str]] = field(default_factory=dict)
    by_class: dict[str, Counter[str]] = field(default_factory=dict)
    by_move: Counter[str] = field(default_factory=Counter)  # "eu-west -> us-east": answers
    # (residency class, jurisdiction(s) it was answered in, jurisdiction(s) it would be): the
    # answers that would leave, named as an approver must acknowledge them.
    leaks: Counter[Leak] = field(default_factory=Counter)
    examples: list[Change] = field(default_factory=list)


def _request(inp: RecordedInput) -> DecisionRequest:
    network = ip_network(inp.client_network, strict=False)
    ecs = ip_network(inp.ecs_prefix, strict=False) if inp.ecs_prefix else None
    return DecisionRequest(
        Channel(inp.channel),
        network.network_address,
        inp.service,
        inp.name,
        ecs,
        frozenset(inp.residency_classes),
        inp.tenant,
    )


def _where(decision: Decision) -> str:
    if decision.outcome is Outcome.ANSWER and decision.region is not None:
        return decision.region
    return decision.outcome.value


def _jurisdictions(snapshot: Snapshot) -> dict[str, frozenset[str]]:
    """Region -> the jurisdictions it belongs to, as the snapshot's policy names them."""
    out: dict[str, set[str]] = {}
    for name, regions in snapshot.policy.jurisdictions.items():
        for region in regions:
            out.setdefault(region, set()).add(name)
    return {region: frozenset(names) for region, names in out.items()}


def analyse(
    inputs: Iterable[RecordedInput], before: Snapshot, after: Snapshot, now: float
) -> Impact:
    impact = Impact()
    home: Mapping[str, frozenset[str]] = _jurisdictions(before)
    changes: list[Change] = []
    for inp in inputs:
        impact.inputs += 1
        impact.answers += inp.answers
        request = _request(inp)
        was = decide(request, before, now)
        will = decide(request, after, now)  # a service the draft drops: NO_SERVICE
        old, new = _where(was), _where(will)
        if old == new:
            continue
        n = inp.answers
        refused_before, refused_after = was.outcome in _REFUSED, will.outcome in _REFUSED
        # Another jurisdiction: both regions belong to some, and to no common one (a region in
        # none is not claimed to have left anything).
        was_home = home.get(was.region or "", frozenset())
        will_home = home.get(will.region or "", frozenset())
        left = bool(was_home) and bool(will_home) and not was_home & will_home
        moved = was.region is not None and will.region is not None
        impact.moved += n if moved else 0
        impact.newly_refused += n if refused_after and not refused_before else 0
        impact.newly_answered += n if refused_before and not refused_after else 0
        impact.left_jurisdiction += n if left else 0
        impact.by_move[f"{old} -> {new}"] += n
        if left:
            for cls in inp.residency_classes or ("(none)",):
                impact.leaks[(cls, "/".join(sorted(was_home)), "/".join(sorted(will_home)))] += n
        kinds = Counter(
            {
                "moved": n if moved else 0,
                "newly_refused": n if refused_after and not refused_before else 0,
                "newly_answered": n if refused_before and not refused_after else 0,
                "left_jurisdiction": n if left else 0,
            }
        )
        impact.by_service.setdefault(inp.service, Counter()).update(kinds)
        for cls in inp.residency_classes or ("(none)",):
            impact.by_class.setdefault(cls, Counter()).update(kinds)
        changes.append(
            Change(
                inp.example,
                inp.name,
                inp.client_network,
                inp.residency_classes,
                inp.tenant,
                n,
                old,
                new,
                left,
            )
        )
    # The examples a reviewer reads first: answers leaving their jurisdiction, then the most
    # answers.
    changes.sort(key=lambda c: (not c.left_jurisdiction, -c.answers))
    impact.examples = changes[:_EXAMPLES]
    return impact


# The traffic an activation's leak check replays (the impact page's default day).
LEAK_WINDOW_S = 86400.0


def leak_name(leak: Leak) -> str:
    """How an acknowledgement names one leak: ``eu-personal EU→US``. Counts are not part of the
    name: they grow while a reviewer reads, and the ones seen are recorded with the activation."""
    cls, was, will = leak
    return f"{cls} {was}→{will}"


def leak_key(leaks: Iterable[Leak]) -> str:
    """The acknowledgement that names every leak, as the console and the CLI send it."""
    return "; ".join(sorted({leak_name(x) for x in leaks}))


def unacknowledged(leaks: Iterable[Leak], acknowledgement: str) -> list[Leak]:
    """The leaks ``acknowledgement`` does not name (``;``-separated names; ``->`` may stand for
    ``→``, as a terminal types it). A name of no current leak is ignored: the leak went away."""
    named = {
        " ".join(part.replace("->", "→").split())
        for part in acknowledgement.split(";")
        if part.strip()
    }
    return sorted(x for x in set(leaks) if leak_name(x) not in named)


__all__ = [
    "LEAK_WINDOW_S",
    "Change",
    "Impact",
    "Leak",
    "analyse",
    "leak_key",
    "leak_name",
    "unacknowledged",
]
