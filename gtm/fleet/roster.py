"""The roster: every configured member of the fleet with its last report, and how far an
activation has reached (pure: no I/O, no clock; the caller passes ``now``).

A fleet claims only what it confirmed (DESIGN.md rule 10). A member is named by its observer id
(the id its health observations carry; a node's worker processes share it and each writes its
own status row). Each member is, as of ``now``:

``live``            a status row younger than the liveness bound;
``silent``          it reported once, not within the bound, and its fence has not surely begun;
``fenced``          silent so long that it has surely fenced itself (``fence_after_s`` after
                    its last report, plus the time its state sync needs to notice): it fails
                    restricted traffic closed from then on (``gtm.runtime``);
``never reported``  configured, but no status row names it.

An activation is in force on a member that reported a document sequence at or above it (a node
never goes back to a lower one). It is *complete* only when every configured member (and any
other node reporting live) has it; until then each other member is *pending* or, once fenced,
*fenced since T*. Without a configured membership the roster is the nodes reporting live, and
says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gtm.fleet.shared_state import NodeStatus

LIVE = "live"
SILENT = "silent"
FENCED = "fenced"
NEVER = "never reported"


@dataclass(frozen=True, slots=True)
class Bounds:
    """The fleet's time bounds, as this reader is configured."""

    live_within_s: float  # a status row younger than this is a live node's
    fence_after_s: float  # a node cut off this long fences itself (0: never)
    fence_slack_s: float  # how much later its state sync can be in noticing it


def live_bound_s(setting: float | None, sync_interval_s: float) -> float:
    """The liveness bound: ``setting`` when given, else several sync rounds (at least 5 s), so
    one slow round does not make a member look silent."""
    return setting if setting is not None else max(5.0, 4 * sync_interval_s)


@dataclass(frozen=True, slots=True)
class Entry:
    member: str
    configured: bool  # in the configured membership (else: a live node outside it)
    state: str  # LIVE, SILENT, FENCED or NEVER
    last_report: float | None
    fenced_since: float | None
    document_sequence: int | None  # the lowest its processes have in force (None: files)
    reports: tuple[NodeStatus, ...]  # its processes' status rows, newest first


@dataclass(frozen=True, slots=True)
class Rollout:
    complete: bool
    acknowledged: list[str]
    pending: dict[str, int | None]  # member -> the sequence it last reported in force
    fenced: dict[str, float]  # member -> since when it is surely fenced


def _lowest(reports: Iterable[NodeStatus]) -> int | None:
    sequences = [r.document_sequence for r in reports]
    if not sequences or any(s is None for s in sequences):
        return None
    return min(s for s in sequences if s is not None)


def _entry(
    member: str, configured: bool, reports: Sequence[NodeStatus], now: float, bounds: Bounds
) -> Entry:
    ordered = tuple(sorted(reports, key=lambda r: -r.at))
    if not ordered:
        return Entry(member, configured, NEVER, None, None, None, ())
    last = ordered[0].at
    live = [r for r in ordered if now - r.at <= bounds.live_within_s]
    if live:
        return Entry(member, configured, LIVE, last, None, _lowest(live), ordered)
    # Silent: what it had in force when it last spoke is what it still has, at best.
    sequence = _lowest(r for r in ordered if r.at == last)
    fence_at = last + bounds.fence_after_s + bounds.fence_slack_s
    if bounds.fence_after_s > 0 and now >= fence_at:
        return Entry(member, configured, FENCED, last, fence_at, sequence, ordered)
    return Entry(member, configured, SILENT, last, None, sequence, ordered)


def roster(
    members: frozenset[str], reports: Sequence[NodeStatus], now: float, bounds: Bounds
) -> list[Entry]:
    """Every configured member (sorted), then every live node outside the membership; with no
    membership configured, the live nodes only."""
    by_member: dict[str, list[NodeStatus]] = {}
    for r in reports:
        by_member.setdefault(r.observer, []).append(r)
    entries = [_entry(m, True, by_member.get(m, []), now, bounds) for m in sorted(members)]
    for member in sorted(set(by_member) - members):
        entry = _entry(member, False, by_member[member], now, bounds)
        if entry.state == LIVE:
            entries.append(entry)
    return entries


def rollout(entries: Sequence[Entry], sequence: int | None) -> Rollout:
    """How far the activation at ``sequence`` (None: not activated) has reached."""
    acknowledged = sorted(
        e.member
        for e in entries
        if sequence is not None
        and e.document_sequence is not None
        and e.document_sequence >= sequence
    )
    waiting = [e for e in entries if e.member not in acknowledged]
    fenced = {
        e.member: e.fenced_since
        for e in waiting
        if e.state == FENCED and e.fenced_since is not None
    }
    pending = {e.member: e.document_sequence for e in waiting if e.member not in fenced}
    return Rollout(
        complete=sequence is not None and bool(entries) and not waiting,
        acknowledged=acknowledged,
        pending=pending,
        fenced=fenced,
    )


def held_by(entries: Sequence[Entry], region: str) -> dict[str, str]:
    """Node -> ``region``'s state as that live node holds it; a member not live is shown as
    what it is (silent, fenced, never reported), not as the state it last held."""
    held: dict[str, str] = {}
    for e in entries:
        if not e.reports:
            held[e.member] = e.state
        for n in e.reports:
            held[n.node] = n.regions.get(region, "unknown") if e.state == LIVE else e.state
    return held
