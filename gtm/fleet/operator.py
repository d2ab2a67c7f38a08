"""Operator controls over regions: drain, weight, force up/down, each with who and why.

Changes go to the shared database (``region_overrides``, one row per region, and an event in
``region_events`` in the same transaction); every node picks them up on its next state sync
(:mod:`gtm.fleet.state_sync`, half a second by default). The CLI and the admin API call the
same functions; the admin API guards them with the safety rules (:mod:`gtm.fleet.safety`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace

from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.fleet import shared_state
from gtm.fleet.region_state import Force, Override

# Where a change is made from, in the events' node column: not one of the serving nodes.
OPERATOR_NODE = "operator"

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# Longer than anything is meant to last (an override, a token, a wait), and short enough that
# a time this far ahead still fits the database's integers.
LONGEST_S = 3650 * 86400


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``2h``, ``1d`` -> seconds, at most ten years; ValueError otherwise."""
    match = _DURATION.match(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h, 1d)")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds > LONGEST_S:
        raise ValueError(f"not a duration: {text!r} (ten years at most)")
    return seconds


class Unchanged:
    """Marks a field an amendment leaves as it is (None is a value: "no weight")."""


UNCHANGED = Unchanged()


def amended(
    existing: Override | None,
    region: str,
    *,
    actor: str,
    reason: str,
    now: float,
    drain: bool | Unchanged = UNCHANGED,
    weight: float | Unchanged | None = UNCHANGED,
    force: Force | Unchanged | None = UNCHANGED,
    force_for_s: float | None = None,
    expires_for_s: float | None = None,
) -> Override | None:
    """What a region's override becomes when part of it changes, keeping the parts still in
    force (None: nothing left). Pure; ValueError for a change that cannot be made."""
    if not reason.strip():
        raise ValueError("say why: --why is required")
    if isinstance(force, Force) and force_for_s is None:
        raise ValueError("a forced state needs an expiry (--for)")
    base = existing.effective(now) if existing is not None else None
    if base is None:
        base = Override(region)
    new = replace(base, actor=actor, reason=reason, set_at=now)
    if not isinstance(drain, Unchanged):
        new = replace(new, drain=drain)
    if not isinstance(weight, Unchanged):
        if weight is not None and weight < 0:
            raise ValueError("a weight is 0 (no traffic) or more")
        new = replace(new, weight=weight)
    if not isinstance(force, Unchanged):
        new = replace(
            new,
            force=force,
            force_until=None if force is None or force_for_s is None else now + force_for_s,
        )
    if expires_for_s is not None:
        new = replace(new, expires_at=now + expires_for_s)
    elif not new.drain and new.weight is None:
        new = replace(new, expires_at=None)
    if new.force is None:
        new = replace(new, force_until=None)
    if not new.drain and new.weight is None and new.force is None:
        return None
    return new


# Called with the overrides before and after a change, before it is written; raises to refuse.
Guard = Callable[[Mapping[str, Override], Mapping[str, Override]], None]


async def amend(
    engine: AsyncEngine,
    region: str,
    *,
    actor: str,
    reason: str,
    now: float,
    drain: bool | Unchanged = UNCHANGED,
    weight: float | Unchanged | None = UNCHANGED,
    force: Force | Unchanged | None = UNCHANGED,
    force_for_s: float | None = None,
    expires_for_s: float | None = None,
    guard: Guard | None = None,
) -> Override | None:
    """Change part of a region's override, keeping the parts still in force; returns what is
    in force afterwards (None: no override left, the row and its history say so). ``guard``
    sees the change first (the admin API's safety rules)."""
    before = {o.region: o for o in await shared_state.read_overrides(engine)}
    new = amended(
        before.get(region),
        region,
        actor=actor,
        reason=reason,
        now=now,
        drain=drain,
        weight=weight,
        force=force,
        force_for_s=force_for_s,
        expires_for_s=expires_for_s,
    )
    if guard is not None:
        after = dict(before)
        if new is None:
            after.pop(region, None)
        else:
            after[region] = new
        guard(before, after)
    if new is None:
        await shared_state.clear_override(engine, region, actor, reason, OPERATOR_NODE, now)
        return None
    await shared_state.put_override(engine, new, OPERATOR_NODE)
    return new


async def clear(engine: AsyncEngine, region: str, *, actor: str, reason: str, now: float) -> bool:
    if not reason.strip():
        raise ValueError("say why: --why is required")
    return await shared_state.clear_override(engine, region, actor, reason, OPERATOR_NODE, now)
