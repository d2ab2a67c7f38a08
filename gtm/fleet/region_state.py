"""Which state each region is in, fleet-wide: quorum, operator overrides and re-admission.

Pure logic, no I/O. Every GTM node probes every region and publishes its own view
(:class:`Observation`) through the shared database; :func:`agree` turns the fresh views of all
nodes into one state per region; operator :class:`Override` s (drain, force up/down, weight, with
an expiry) apply on top; a region that comes back from down or draining is re-admitted over a
window, its share of clients growing from 0 to 1 (routing moves the rest by a stable hash, so the
same clients come back first and answers do not flap). :class:`RegionBook` holds that state for
one node and says what changed, so the runtime can swap a snapshot and record region events.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from gtm.decision.snapshot import HealthState, RegionHealth

if TYPE_CHECKING:
    from gtm.fleet.observation_seal import ObservationGate

# When several states tie for the most fresh observations and the previous one is not among
# them, the more cautious wins: down before draining before up.
_CAUTION = (HealthState.DOWN, HealthState.DRAINING, HealthState.UP)


class Force(StrEnum):
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class Observation:
    """One node's latest judgement of one region, from its own probes. ``signature`` is the
    node's over every other field (:mod:`gtm.fleet.observation_seal`); ``key_id`` names the key
    it claims to have signed with (a hint for the operator: the membership's key is the one
    checked)."""

    node: str
    region: str
    state: HealthState
    since: float  # when this node's view last changed
    observed_at: float  # when the node last confirmed it (its probes are running)
    detail: str = ""
    signature: str = ""
    key_id: str = ""


@dataclass(frozen=True, slots=True)
class Override:
    """An operator's word on a region. A forced state always lapses (``force_until``); a drain
    or a weight lapses at ``expires_at`` when one was given."""

    region: str
    drain: bool = False
    weight: float | None = None
    force: Force | None = None
    force_until: float | None = None
    expires_at: float | None = None
    actor: str = ""
    reason: str = ""
    set_at: float = 0.0

    def effective(self, now: float) -> Override | None:
        """What is still in force at ``now``; None when nothing is."""
        force_on = self.force is not None and (self.force_until is None or now < self.force_until)
        rest_on = self.expires_at is None or now < self.expires_at
        drain = self.drain and rest_on
        weight = self.weight if rest_on else None
        force = self.force if force_on else None
        if not drain and weight is None and force is None:
            return None
        if (drain, weight, force) == (self.drain, self.weight, self.force):
            return self
        return replace(self, drain=drain, weight=weight, force=force)

    def describe(self) -> str:
        parts = []
        if self.force is not None:
            parts.append(f"forced {self.force.value}")
        if self.drain:
            parts.append("drained")
        if self.weight is not None:
            parts.append(f"weight {self.weight:g}")
        return ", ".join(parts) or "no override"


@dataclass(frozen=True, slots=True)
class RegionEvent:
    """A row of the region-events table."""

    at: float
    node: str
    region: str
    kind: str  # "observed" | "in_force" | "override"
    state: str | None
    previous: str | None
    detail: str
    actor: str | None = None
    reason: str | None = None


def agree(
    observations: Iterable[Observation],
    now: float,
    max_age_s: float,
    quorum: int,
    previous: HealthState,
    members: frozenset[str] = frozenset(),
) -> HealthState:
    """The state a quorum of fresh observations agrees on; otherwise the previous one.

    Without configured ``members`` the quorum shrinks to the number of fresh observers, so a
    node left alone decides by itself (its peers' rows age out when they die or lose the
    database). With ``members`` (the fleet's configured observers), only their votes count and
    a state needs a majority of the membership (or ``quorum``, if higher) whoever is alive: a
    restarting peer freezes the state rather than handing it to one node's vote, and a node
    with a bad probe path, or one that is not a member, cannot move the fleet. A state needs at
    least that many votes and more votes than any other; a tie keeps the previous state when
    it is one of the tied, else takes the most cautious.
    """
    fresh = [
        o.state
        for o in observations
        if now - o.observed_at <= max_age_s
        and o.state is not HealthState.UNKNOWN
        and (not members or o.node in members)
    ]
    if not fresh:
        return previous
    need = max(quorum, len(members) // 2 + 1) if members else min(quorum, len(fresh))
    counts = Counter(fresh)
    most = max(counts.values())
    if most < need:
        return previous
    leaders = [s for s, c in counts.items() if c == most]
    if len(leaders) == 1:
        return leaders[0]
    if previous in leaders:
        return previous
    return next(s for s in _CAUTION if s in leaders)


def in_force(agreed: HealthState, override: Override | None) -> tuple[HealthState, str]:
    """The state routing uses: forced down, then drained, then forced up, then the quorum's."""
    if override is None:
        return agreed, ""
    who = f" by {override.actor}: {override.reason}" if override.actor else ""
    if override.force is Force.DOWN:
        return HealthState.DOWN, "forced down" + who
    if override.drain:
        return HealthState.DRAINING, "drained" + who
    if override.force is Force.UP:
        return HealthState.UP, "forced up" + who
    return agreed, ""


def admitted_share(recovered_at: float, now: float, window_s: float) -> float:
    """The share of its clients a recovering region has back: a linear ramp over the window."""
    if window_s <= 0:
        return 1.0
    return min(1.0, max(0.0, (now - recovered_at) / window_s))


@dataclass(frozen=True, slots=True)
class Composed:
    health: Mapping[str, RegionHealth]
    weights: Mapping[str, float]
    events: tuple[RegionEvent, ...]
    ramping: bool  # some region is still being re-admitted: compose again soon


@dataclass
class RegionBook:
    """One node's knowledge of every region: observations (its own and its peers'), the
    overrides in force and each region's state in force, with what changed.

    With a ``gate`` (:meth:`set_gate`; the runtime always sets one) a peer's observation counts
    only when it is a member's, signed with that member's key and dated within bounds of this
    node's ``clock``, and never older than one already accepted from it; without one, what
    :meth:`replace_peers` is given is taken as it is (pure tests, display recounts)."""

    node: str
    regions: tuple[str, ...]
    quorum: int = 1
    max_age_s: float = 3.0
    members: frozenset[str] = frozenset()  # configured observers; empty: whoever reports
    readmit_window_s: float = 0.0
    gate: ObservationGate | None = None
    clock: Callable[[], float] = time.time
    observations: dict[tuple[str, str], Observation] = field(default_factory=dict)
    overrides: dict[str, Override] = field(default_factory=dict)
    _effective: dict[str, Override] = field(default_factory=dict)
    _agreed: dict[str, HealthState] = field(default_factory=dict)
    _in_force: dict[str, RegionHealth] = field(default_factory=dict)
    _recovered_at: dict[str, float] = field(default_factory=dict)

    def observe(self, observation: Observation) -> None:
        self.observations[(observation.node, observation.region)] = observation

    def set_gate(self, gate: ObservationGate) -> None:
        """Count only ``gate``'s members' verified observations, a majority of its configured
        membership deciding (none configured: this node's own observations, alone)."""
        self.gate = gate
        self.members = gate.membership.voters
        known = gate.membership.keys
        self.observations = {
            k: o for k, o in self.observations.items() if k[0] == self.node or k[0] in known
        }

    def replace_peers(self, observations: Iterable[Observation]) -> None:
        """Every other node's observations, as just read from the shared database."""
        mine = {k: v for k, v in self.observations.items() if k[0] == self.node}
        peers = [o for o in observations if o.node != self.node]
        if self.gate is None:
            self.observations = mine | {(o.node, o.region): o for o in peers}
            return
        now = self.clock()
        fresh: dict[tuple[str, str], Observation] = {}
        for o in self.gate.admit(peers, now):
            key = (o.node, o.region)
            before = self.observations.get(key)
            if (
                before is not None
                and before.observed_at > o.observed_at
                and now - before.observed_at <= self.max_age_s
            ):
                # A member's older row put back: its newer word, still fresh, stands.
                self.gate.refuse("older than one accepted", o)
                o = before
            if key not in fresh or fresh[key].observed_at < o.observed_at:
                fresh[key] = o
        self.observations = mine | fresh

    def set_overrides(self, overrides: Iterable[Override]) -> None:
        self.overrides = {o.region: o for o in overrides}

    def retarget(self, regions: tuple[str, ...]) -> None:
        """The topology changed: forget regions it no longer has."""
        self.regions = regions
        keep = set(regions)
        self.observations = {k: v for k, v in self.observations.items() if k[1] in keep}
        for table in (self._effective, self._agreed, self._in_force, self._recovered_at):
            for region in [r for r in table if r not in keep]:
                del table[region]

    def compose(self, now: float) -> Composed:
        events: list[RegionEvent] = []
        effective: dict[str, Override] = {}
        for region, override in self.overrides.items():
            still = override.effective(now)
            was = self._effective.get(region)
            if (
                was is not None
                and was.set_at == override.set_at
                and (still is None or still.describe() != was.describe())
            ):
                # The same override as last time, with less of it in force: a part lapsed.
                lapsed = was.describe() if still is None else f"{was.describe()} -> "
                lapsed += "" if still is None else still.describe()
                events.append(
                    RegionEvent(
                        now, self.node, region, "override", None, None,
                        f"lapsed: {lapsed}", override.actor, override.reason,
                    )
                )  # fmt: skip
            if still is not None:
                effective[region] = still
        self._effective = effective
        health: dict[str, RegionHealth] = {}
        ramping = False
        for region in self.regions:
            seen = [o for (_, r), o in self.observations.items() if r == region]
            agreed = agree(
                seen,
                now,
                self.max_age_s,
                self.quorum,
                self._agreed.get(region, HealthState.UNKNOWN),
                self.members,
            )
            self._agreed[region] = agreed
            state, detail = in_force(agreed, effective.get(region))
            if not detail:
                detail = _detail(seen, agreed, now, self.max_age_s)
            before = self._in_force.get(region)
            previous = before.state if before is not None else HealthState.UNKNOWN
            since = before.since if before is not None and previous is state else now
            if state is not previous:
                events.append(
                    RegionEvent(now, self.node, region, "in_force", state, previous, detail)
                )
                if state is HealthState.UP and previous in (HealthState.DOWN, HealthState.DRAINING):
                    self._recovered_at[region] = now
                else:
                    self._recovered_at.pop(region, None)
            admitted = 1.0
            if region in self._recovered_at:
                admitted = admitted_share(self._recovered_at[region], now, self.readmit_window_s)
                if admitted >= 1.0:
                    del self._recovered_at[region]
                else:
                    ramping = True
            current = RegionHealth(state, since, detail, admitted)
            self._in_force[region] = current
            health[region] = current
        weights = {
            r: o.weight for r, o in effective.items() if o.weight is not None and r in health
        }
        return Composed(health, weights, tuple(events), ramping)


def _detail(seen: list[Observation], agreed: HealthState, now: float, max_age_s: float) -> str:
    fresh = [o for o in seen if now - o.observed_at <= max_age_s]
    if not fresh:
        return "no fresh observations"
    votes = sum(1 for o in fresh if o.state is agreed)
    first = next((o.detail for o in fresh if o.state is agreed and o.detail), "")
    return f"{votes}/{len(fresh)} nodes" + (f"; {first}" if first else "")
