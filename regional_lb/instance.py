"""Per-instance state: exact accounting of work in flight, learned speed, health flags.

Rule 5 of the design: work added when a request is routed is removed when it ends, however it
ends. :class:`InstanceState` keeps every in-flight request by id, so releasing is idempotent
and the outstanding total can always be recomputed from the flights themselves; the proxy wraps
the whole request lifetime in :func:`regional_lb.upstream.tracked` so nothing escapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Flight:
    """One routed request: its original estimate and the current estimate of what is left."""

    cost: float
    remaining: float
    started: float
    produced: int = 0


@dataclass(slots=True)
class SpeedLearner:
    """Cost units finished per busy second, learned online.

    Busy time is wall time with at least one request in flight, so a batching instance that is
    kept full learns its batched throughput, which is what matters for draining queued work.
    """

    speed: float = 1.0
    alpha: float = 0.1
    min_window_s: float = 0.5  # fold samples in once this much busy time has accumulated
    _busy_since: float | None = None
    _busy_acc: float = 0.0
    _work_acc: float = 0.0
    samples: int = 0

    def busy(self, now: float, in_flight: int) -> None:
        """Call after every change of the in-flight count."""
        if in_flight > 0 and self._busy_since is None:
            self._busy_since = now
        elif in_flight == 0 and self._busy_since is not None:
            self._busy_acc += now - self._busy_since
            self._busy_since = None

    def completed(self, now: float, actual_cost: float) -> None:
        self._work_acc += actual_cost
        busy = self._busy_acc
        if self._busy_since is not None:
            busy += now - self._busy_since
            self._busy_since = now
        self._busy_acc = 0.0
        self._pending_busy = busy  # type: ignore[attr-defined]  # removed below

    def fold(self, busy_s: float) -> None:
        if busy_s < self.min_window_s or self._work_acc <= 0:
            return
        sample = self._work_acc / busy_s
        a = max(self.alpha, 1.0 / (self.samples + 2))
        self.speed += a * (sample - self.speed)
        self.samples += 1
        self._work_acc = 0.0
