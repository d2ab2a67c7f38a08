"""Safety rules for operator controls: what a drain, a weight or a forced state may not do.

Route 53 Application Recovery Controller guards its routing controls with assertion rules; GTM
guards its region overrides with the topology's ``safety`` section: at most
``max_regions_out`` regions out of service at once, and every residency class the policy
restricts keeps an allowed region in service (a drain must never turn "EU data stays in the EU"
into "EU data is refused"). A change is refused only for what it makes worse: a rule already
broken (a region down on its own) does not block a change that does not break it further, and
undoing a drain is never refused.

Pure: the caller gives the snapshot in force, the overrides before and after the change.
"""

from __future__ import annotations

from collections.abc import Mapping

from gtm.decision.snapshot import HealthState, Snapshot
from gtm.fleet.region_state import Force, Override


def out_of_service(
    snapshot: Snapshot, overrides: Mapping[str, Override], now: float
) -> frozenset[str]:
    """Regions that take no new clients: an operator's drain, force down or weight 0, or a
    health state of down or draining not forced up."""
    out = set()
    for region in snapshot.regions:
        held = overrides.get(region)
        override = held.effective(now) if held is not None else None
        if override is not None:
            if override.force is Force.DOWN or override.drain or override.weight == 0:
                out.add(region)
                continue
            if override.force is Force.UP:
                continue
        health = snapshot.health.get(region)
        if health is not None and health.state in (HealthState.DOWN, HealthState.DRAINING):
            out.add(region)
    return frozenset(out)


def broken_rules(snapshot: Snapshot, out: frozenset[str]) -> list[str]:
    """The safety rules broken with ``out`` out of service, each said plainly."""
    safety = snapshot.topology.safety
    broken = []
    limit = (
        safety.max_regions_out if safety.max_regions_out is not None else len(snapshot.regions) // 2
    )
    if len(out) > limit:
        broken.append(
            f"{len(out)} regions out of service at once ({', '.join(sorted(out))}); "
            f"the limit is {limit}"
        )
    if safety.keep_every_class_served:
        policy = snapshot.policy
        for cls in sorted(policy.known_classes):
            allowed = policy.evaluate(frozenset({cls}), None, None, None).allowed
            if allowed is None:
                continue
            regions = allowed & set(snapshot.regions)
            if regions and not regions - out:
                broken.append(
                    f"residency class {cls} would have no allowed region in service "
                    f"(allowed: {', '.join(sorted(regions))})"
                )
    return broken


def check(
    snapshot: Snapshot,
    before: Mapping[str, Override],
    after: Mapping[str, Override],
    now: float,
) -> list[str]:
    """The rules the change from ``before`` to ``after`` would break that were not broken
    already; empty: the change is safe."""
    out_before = out_of_service(snapshot, before, now)
    out_after = out_of_service(snapshot, after, now)
    if out_after <= out_before:
        return []  # every rule is monotone in the regions out: nothing got worse
    was = set(broken_rules(snapshot, out_before))
    return [rule for rule in broken_rules(snapshot, out_after) if rule not in was]


__all__ = ["broken_rules", "check", "out_of_service"]
