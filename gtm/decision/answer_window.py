"""How long answers cached from a snapshot hold: the window both answering paths (DNS and the
HTTP front) check before giving a cached answer.

A decision is a pure function of (request, snapshot, now), so an answer cached from a snapshot
holds until either the snapshot is replaced by one that decides differently (a new decision
epoch, :attr:`gtm.decision.snapshot.Snapshot.epoch`) or time alone changes a decision: a capacity
report turning stale (DESIGN.md: stale reports are ignored). Successors in the same epoch (routine
capacity reports from healthy regions, several a second in a fleet) keep the cached answers.
"""

from __future__ import annotations

import math

from gtm.decision.snapshot import Snapshot


def time_boundary(snapshot: Snapshot, now: float) -> float:
    """The instant from which a decision from ``snapshot`` may differ from one made at ``now``
    without a new snapshot: when one of its capacity reports turns stale. A report is fresh up
    to and including its expiry, so a report expiring at ``now`` itself closes the window at
    once (``now`` is not before it)."""
    stale_after = snapshot.topology.routing.spillover.stale_after_s
    boundaries = [
        c.reported_at + stale_after
        for c in snapshot.capacity.values()
        if c.reported_at + stale_after >= now
    ]
    return min(boundaries, default=math.inf)


class AnswerWindow:
    """The snapshot cached answers were decided from, and the instant they stop holding.

    The answering path compares ``snapshot`` with the store's current one by identity and
    ``now`` with ``until`` (both plain attributes, for the hot path); on a mismatch it calls
    :meth:`advance`, which says whether the cached answers still hold.
    """

    __slots__ = ("snapshot", "until")

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.until = -math.inf

    def holds(self, snapshot: Snapshot, now: float) -> bool:
        """Whether answers cached so far are still answers from ``snapshot`` at ``now``."""
        return snapshot is self.snapshot and now < self.until

    def advance(self, snapshot: Snapshot, now: float) -> bool:
        """Move the window to ``snapshot`` at ``now``. True when the answers cached so far still
        hold; False when the caller must drop them.

        The same snapshot holds until its window closes. A successor in the same decision
        epoch decides as the cached answers' snapshot did up to the moment it was built (each
        step of an epoch checked that no report had turned stale since the step before,
        :meth:`Snapshot.evolve`), and from then on until one of its own reports turns stale:
        however long nobody asked meanwhile. (Bounding it by the old window instead dropped
        every cached answer after ten quiet seconds, although reports kept the epoch, and the
        next burst of queries re-decided every client network at once.)"""
        old = self.snapshot
        if snapshot is old:
            kept = now < self.until
        else:
            kept = (
                old is not None
                and snapshot.epoch == old.epoch
                and now < time_boundary(snapshot, snapshot.built_at)
            )
        if snapshot is not old or not kept:
            self.snapshot = snapshot
            self.until = time_boundary(snapshot, now)
        return kept
