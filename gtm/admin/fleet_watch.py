"""The fleet's liveness and its newest rollout as gauges, for alerts that fire only when
something is wrong (DESIGN.md rule 10).

Each admin service reads the roster (:mod:`gtm.fleet.roster`) every few seconds and exports,
per configured member, the seconds since its last status report, with the liveness bound beside
it; and for the newest activation, how many members have not acknowledged it and how old it
is. The alerts (``deploy/prometheus/alerts.yml``) compare them against their bounds over a
``for`` window, so a clean restart (a node silent for a few seconds) or a rollout that completes
in under a second fires nothing, and a member silent past its bound, or a rollout still pending
a minute on, does.

A round that cannot read the database keeps the last reports it read: silence keeps growing
from them, as it does for a member that stopped reporting (neither has been heard from).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy.exc import SQLAlchemyError

from gtm import metrics
from gtm.admin.auth import AdminContext
from gtm.admin.routes.regions import fleet_roster
from gtm.control.log import LogRefused
from gtm.fleet import roster

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Activation:
    sequence: int
    at: float  # when it was activated (unix seconds)


@dataclass(frozen=True, slots=True)
class FleetGauges:
    silence: Mapping[str, float]  # member -> seconds since its last report
    pending: int  # members that have not acknowledged the newest activation
    rollout_age: float  # seconds since the newest activation (0: none)


def gauges(
    entries: Sequence[roster.Entry],
    newest: Activation | None,
    now: float,
    watching_since: float,
) -> FleetGauges:
    """The gauges as of ``now`` (pure). A member that never reported has been silent since this
    service began watching: it alerts once that is longer than the bound, not at once."""
    silence = {
        e.member: max(0.0, now - (e.last_report if e.last_report is not None else watching_since))
        for e in entries
    }
    if newest is None:
        return FleetGauges(silence, 0, 0.0)
    reached = roster.rollout(entries, newest.sequence)
    return FleetGauges(
        silence, len(reached.pending) + len(reached.fenced), max(0.0, now - newest.at)
    )


def newest_activation(activated: Iterable[tuple[int | None, float | None]]) -> Activation | None:
    """The newest of (sequence, activated at) pairs; those never activated are skipped."""
    done = [Activation(s, at) for s, at in activated if s is not None and at is not None]
    return max(done, key=lambda a: a.sequence, default=None)


def export(found: FleetGauges, live_bound_s: float) -> None:
    metrics.FLEET_LIVE_BOUND.set(live_bound_s)
    metrics.FLEET_MEMBER_SILENCE.clear()  # members no longer configured drop out
    for member, seconds in found.silence.items():
        metrics.FLEET_MEMBER_SILENCE.labels(member).set(seconds)
    metrics.FLEET_ROLLOUT_PENDING.set(found.pending)
    metrics.FLEET_ROLLOUT_AGE.set(found.rollout_age)


async def _read(ctx: AdminContext, now: float) -> tuple[list[roster.Entry], Activation | None]:
    entries = await fleet_roster(ctx, now)
    state = await ctx.control.refresh(ctx.engine)
    newest = newest_activation(
        (p.sequence, None if p.activated_at_us is None else p.activated_at_us / 1e6)
        for p in state.proposals.values()
    )
    return entries, newest


async def run(ctx: AdminContext, stop: asyncio.Event, interval_s: float | None = None) -> None:
    """Export the gauges every ``interval_s`` (default: twice per liveness bound, at most every
    5 s) until ``stop`` is set."""
    if interval_s is None:
        interval_s = min(5.0, ctx.live_within_s / 2)
    watching_since = ctx.clock()
    known: tuple[list[roster.Entry], Activation | None] | None = None
    while not stop.is_set():
        now = ctx.clock()
        try:
            known = await _read(ctx, now)
        except (SQLAlchemyError, OSError, LogRefused) as exc:
            log.warning("admin.fleet_unread", error=str(exc).splitlines()[0])
        if known is not None:
            export(gauges(known[0], known[1], now, watching_since), ctx.live_within_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


__all__ = ["Activation", "FleetGauges", "export", "gauges", "newest_activation", "run"]
