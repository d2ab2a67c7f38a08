"""Operator controls over regions: drain, weight, force up/down, each with who and why.

A change is an entry of the signed control log (:mod:`gtm.control`: ``override.set`` or
``override.clear``, naming the region, the action, its expiry, the principal and the reason),
with a cache row in ``region_overrides`` and an event in ``region_events`` in the same
transaction; every node folds the verified log on its next state sync
(:mod:`gtm.fleet.state_sync`, half a second by default), so a row inserted into
``region_overrides`` drains or forces nothing. The CLI and the admin API call the
same functions; the admin API guards them with the safety rules (:mod:`gtm.fleet.safety`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace

from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.control.log import ControlLog, LogRefused
from gtm.control.state import ControlState, Refusal
from gtm.fleet import shared_state
from gtm.fleet.region_state import Force, Override
from gtm.fleet.signed_documents import load_public_keys
from gtm.settings import Settings

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


def _s(us: int | None) -> float | None:
    return None if us is None else us / 1e6


def overrides_of(state: ControlState) -> list[Override]:
    """The operator overrides the verified control log holds."""
    return [
        Override(
            o.region,
            o.drain,
            o.weight,
            Force(o.force) if o.force else None,
            _s(o.force_until_us),
            _s(o.expires_at_us),
            o.actor,
            o.reason,
            o.set_at_us / 1e6,
        )
        for o in state.overrides.values()
    ]


async def verified_overrides(engine: AsyncEngine, settings: Settings) -> list[Override]:
    """The overrides of the verified control log, read once with the configured document keys
    (``gtm region status``); none, with a warning on stderr, when the log is refused."""
    control = ControlLog(load_public_keys(settings.document_keys))
    try:
        return overrides_of(await control.refresh(engine))
    except LogRefused as exc:
        print(f"warning: the control log is refused, overrides unknown: {exc}", file=sys.stderr)
        return []


class OverrideRefused(Exception):
    """The control log's rules refuse the change (the principal does not operate, say)."""


def _us(t: float | None) -> int | None:
    return None if t is None else round(t * 1e6)


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


# Called with the overrides before and after a change, before it is written; raises to refuse,
# else returns the safety rules the change breaks with leave (recorded in the log's entry).
Guard = Callable[[Mapping[str, Override], Mapping[str, Override]], list[str]]


async def amend(
    engine: AsyncEngine,
    region: str,
    *,
    control: ControlLog,
    by: str,
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
    async with engine.begin() as conn:
        state = await control.state(conn)
        before = {o.region: o for o in overrides_of(state)}
        new, broke = _amended_checked(
            before, region, actor, reason, now, drain, weight, force, force_for_s, expires_for_s,
            guard,
        )  # fmt: skip
        try:
            if new is None:
                if region not in state.overrides:
                    return None
                await control.append(
                    conn, "override.clear", by, {"region": region, "reason": reason}, now
                )
                await shared_state.clear_override_in(
                    conn, region, actor, reason, OPERATOR_NODE, now
                )
                return None
            await control.append(conn, "override.set", by, _body(new, broke), now)
        except Refusal as exc:
            raise OverrideRefused(str(exc)) from None
        await shared_state.put_override_in(conn, new, OPERATOR_NODE)
        return new


def _body(o: Override, broke: list[str]) -> dict[str, object]:
    return {
        "region": o.region,
        "drain": o.drain,
        "weight": o.weight,
        "force": o.force.value if o.force else None,
        "force_until_us": _us(o.force_until),
        "expires_at_us": _us(o.expires_at),
        "reason": o.reason,
        "broke": broke,
    }


def _amended_checked(
    before: Mapping[str, Override],
    region: str,
    actor: str,
    reason: str,
    now: float,
    drain: bool | Unchanged,
    weight: float | Unchanged | None,
    force: Force | Unchanged | None,
    force_for_s: float | None,
    expires_for_s: float | None,
    guard: Guard | None,
) -> tuple[Override | None, list[str]]:
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
        return new, guard(before, after)
    return new, []


async def clear(
    engine: AsyncEngine,
    region: str,
    *,
    control: ControlLog,
    by: str,
    actor: str,
    reason: str,
    now: float,
) -> bool:
    if not reason.strip():
        raise ValueError("say why: --why is required")
    async with engine.begin() as conn:
        if region not in (await control.state(conn)).overrides:
            return False
        try:
            await control.append(
                conn, "override.clear", by, {"region": region, "reason": reason}, now
            )
        except Refusal as exc:
            raise OverrideRefused(str(exc)) from None
        await shared_state.clear_override_in(conn, region, actor, reason, OPERATOR_NODE, now)
        return True
