"""Per-instance state: exact accounting of work in flight, learned speed, health flags.

Rule 5 of the design: work added when a request is routed is removed when it ends, however it
ends. :class:`InstanceState` keeps every in-flight request by id, so releasing is idempotent
and the outstanding total can always be recomputed from the flights themselves; the proxy wraps
the whole request lifetime in :func:`regional_lb.upstream.tracked` so nothing escapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from regional_lb.gpus import batch_throughput


@dataclass(slots=True)
class Flight:
    """One routed request: its original estimate and the current estimate of what is left."""

    cost: float
    remaining: float
    started: float
    model: str = ""
    produced: int = 0


@dataclass(slots=True)
class SpeedLearner:
    """An instance's speed, learned online from the work it finishes.

    A continuous-batching server finishes more work per second the fuller its batch, so busy
    time alone would teach a speed that depends on how loaded the instance happened to be.
    Instead the learner integrates the batch gain ``batch_throughput(n)`` over time (``n`` the
    requests in flight) and learns ``unit_speed``, the speed of one sequence alone; ``speed``,
    what the picker divides by, is the drain rate with a full batch. ``slots`` and ``penalty``
    come from the GPU profile; with ``slots=1`` this is plain work per busy second.
    """

    unit_speed: float = 1.0
    slots: int = 1
    penalty: float = 0.0
    # Memory of the learner, in effective seconds: long enough to average over many requests
    # (work is credited when a request completes), short enough to follow a throttled GPU.
    horizon_s: float = 120.0
    prior_s: float = 5.0  # the declared speed counts as this much observation
    samples: int = 0
    _gain: float = 1.0
    _n: int = 0
    _last: float = 0.0
    _work: float = 0.0  # decayed sums; unit_speed is their ratio
    _eff: float = 0.0

    def __post_init__(self) -> None:
        self._gain = batch_throughput(self.slots, self.penalty)
        self._work, self._eff = self.unit_speed * self.prior_s, self.prior_s

    @property
    def speed(self) -> float:
        return self.unit_speed * self._gain

    def busy(self, now: float, in_flight: int) -> None:
        """Call after every change of the in-flight count."""
        if self._n > 0 and now > self._last:
            eff = batch_throughput(min(self._n, self.slots), self.penalty) * (now - self._last)
            # Ratio of decayed sums rather than an average of per-window ratios: the
            # latter is biased high because windows end exactly when work is credited.
            decay = math.exp(-eff / self.horizon_s)
            self._work *= decay
            self._eff = self._eff * decay + eff
        self._n = in_flight
        self._last = now

    def completed(self, now: float, actual_cost: float) -> None:
        self.busy(now, self._n)
        self._work += actual_cost
        self.samples += 1
        if self._eff > 0:
            self.unit_speed = self._work / self._eff


@dataclass(slots=True)
class InstanceState:
    """Everything the picker and the health machinery know about one instance."""

    id: str
    url: str = ""
    gpu: str = "A100"
    speed: SpeedLearner = field(default_factory=SpeedLearner)
    max_concurrency: int = 64
    memory_gb: float = 80.0
    servable: frozenset[str] = frozenset()  # models it can load (empty: any)
    loaded: dict[str, float] = field(default_factory=dict)  # model -> last use, for LRU
    healthy: bool = True
    draining: bool = False
    ejected_until: float = 0.0
    ejections: int = 0
    consecutive_failures: int = 0
    joined_at: float = 0.0  # start of the slow-start ramp
    scrape: bool = True  # read the instance's Prometheus metrics
    kv_usage: float | None = None  # from a fresh metrics scrape, else None
    scraped_running: int | None = None
    scraped_waiting: int | None = None
    flights: dict[int, Flight] = field(default_factory=dict)
    outstanding: float = 0.0
    # When the instance last showed it is working: a request completed or a stream produced a
    # token. A saturated instance queues a model probe behind its batch; this tells busy from
    # dead (see regional_lb.probes).
    progress_at: float = 0.0
    completed: int = 0
    work_done: float = 0.0

    # -- accounting -------------------------------------------------------------------------

    def add(self, request_id: int, cost: float, now: float, model: str = "") -> None:
        if request_id in self.flights:
            raise ValueError(f"request {request_id} already in flight on {self.id}")
        self.flights[request_id] = Flight(cost=cost, remaining=cost, started=now, model=model)
        if model:
            self.loaded[model] = now
        self.outstanding += cost
        self.speed.busy(now, len(self.flights))

    def update_remaining(self, request_id: int, remaining: float, produced: int) -> None:
        flight = self.flights.get(request_id)
        if flight is None:
            return
        remaining = max(0.0, remaining)
        self.outstanding += remaining - flight.remaining
        flight.remaining = remaining
        flight.produced = produced

    def release(self, request_id: int, now: float, actual_cost: float | None = None) -> bool:
        """Remove a request however it ended; ``actual_cost`` only when it completed.
        Returns False when it was not in flight (a second release is harmless)."""
        flight = self.flights.pop(request_id, None)
        if flight is None:
            return False
        if self.flights:
            self.outstanding -= flight.remaining
        else:
            # Snap to exactly zero: float residue must not look like phantom work.
            self.outstanding = 0.0
        self.speed.busy(now, len(self.flights))
        if actual_cost is not None:
            self.progress_at = now
            self.completed += 1
            self.work_done += actual_cost
            self.speed.completed(now, actual_cost)
        return True

    def recompute(self) -> None:
        """Rebuild the running total from the flights (drift guard, called now and then)."""
        self.outstanding = sum(f.remaining for f in self.flights.values())

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    # -- derived state ------------------------------------------------------------------------

    def ramp(self, now: float, slow_start_s: float, floor: float = 0.1) -> float:
        """Slow-start factor in [floor, 1]: a new or returning instance gets a growing share."""
        if slow_start_s <= 0:
            return 1.0
        elapsed = now - self.joined_at
        if elapsed >= slow_start_s:
            return 1.0
        return max(floor, elapsed / slow_start_s)

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def can_serve(self, model: str) -> bool:
        return model in self.loaded or not self.servable or model in self.servable
