"""Answers by jurisdiction and residency class (``gtm_answers_by_jurisdiction``), counted
where every answer of both channels is already tallied: the audit writer's sealed rows.

Every label value comes from the policy in force, never from a client, so the number of
series stays bounded however many distinct requests arrive:

- ``jurisdiction``: the policy's jurisdiction groups holding the region that answered (a
  region in several is named by all, joined with ``+``, as the compliance report does),
  ``unassigned`` for a region in none, ``none`` when no region answered (refusals, fail
  closed, NXDOMAIN, rejected input);
- ``residency_class``: the request's classes joined with ``+``, ``unclassified`` without one;
  a class no policy rule names (a client may put anything in a header) counts as ``unknown``.

A row is labelled with the policy in force when it is sealed (at most a flush interval after
its answers): around an activation that regroups regions, a second's answers may be counted
under the new groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import Counter

from gtm.audit.record import AuditRecord
from gtm.decision.policy import PolicySet
from gtm.metrics import ANSWERS_BY_JURISDICTION

NO_REGION = "none"
NO_GROUP = "unassigned"
NO_CLASS = "unclassified"
UNKNOWN_CLASS = "unknown"


def jurisdictions(policy: PolicySet) -> dict[str, str]:
    """Region -> its jurisdiction label under ``policy``."""
    groups: dict[str, list[str]] = {}
    for name, regions in policy.jurisdictions.items():
        for region in regions:
            groups.setdefault(region, []).append(name)
    return {region: "+".join(sorted(names)) for region, names in groups.items()}


def class_label(classes: Iterable[str], known: frozenset[str]) -> str:
    """The residency-class label: known classes by name, the rest as one ``unknown``.

    >>> class_label(("eu-personal", "made-up"), frozenset({"eu-personal"}))
    'eu-personal+unknown'
    """
    names = {c if c in known else UNKNOWN_CLASS for c in classes}
    return "+".join(sorted(names)) if names else NO_CLASS


class AnswersByJurisdiction:
    """The audit writer's ``on_sealed`` hook: count a sealed row's answers under its labels."""

    def __init__(self, policy: Callable[[], PolicySet]) -> None:
        self._policy = policy
        self._labelled: PolicySet | None = None
        self._regions: dict[str, str] = {}
        # Children resolved once per label set (bounded, see the module docstring).
        self._counters: dict[tuple[str, str, str], Counter] = {}

    def __call__(self, record: AuditRecord, n: int) -> None:
        policy = self._policy()
        if policy is not self._labelled:
            self._labelled, self._regions = policy, jurisdictions(policy)
        region = record.region
        jurisdiction = NO_REGION if region is None else self._regions.get(region, NO_GROUP)
        key = (
            record.channel,
            jurisdiction,
            class_label(record.residency_classes, policy.known_classes),
        )
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = ANSWERS_BY_JURISDICTION.labels(*key)
        counter.inc(n)


__all__ = ["AnswersByJurisdiction", "class_label", "jurisdictions"]
