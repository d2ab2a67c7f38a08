"""Per-instance state: exact accounting of work in flight, learned speed, health flags.

Rule 5 of the design: work added when a request is routed is removed when it ends, however it
ends. :class:`InstanceState` keeps every in-flight request by id, so releasing is idempotent
and the outstanding total can always be recomputed from the flights themselves; the proxy wraps
the whole request lifetime in :func:`regional_lb.upstream.forward.tracked` so nothing escapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from regional_lb.balancing.cost import TimingSample
from regional_lb.balancing.gpus import batch_slowdown, batch_throughput

# The prefill-speed learner's memory (seconds with prompts pending) and the weight of the
# declared speed in it (InstanceState.prefill_speed).
PREFILL_HORIZON_S = 60.0
PREFILL_PRIOR_S = 5.0


@dataclass(slots=True)
class Flight:
    """One routed request: its original estimate and the current estimate of what is left."""

    cost: float
    remaining: float
    started: float
    model: str = ""
    produced: int = 0
    # Reference seconds of prompt still to prefill (part of ``remaining``), until the first
    # token: the picker prices it unbatched (see regional_lb.balancing.pick).
    prefill: float = 0.0
    # For the coefficient fit (InstanceState.timing): when the first token arrived and the
    # instance's progress clock then, the decode steps the first token waits for, and whether
    # the request may have queued at the instance before it ran.
    first_token_at: float = math.nan
    clock_first: float = 0.0
    first_token_steps: float = 1.0
    queued: bool = False


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
    declared: float = 0.0  # the configured (GPU profile) speed; 0: the initial unit_speed
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
        if self.declared <= 0:
            self.declared = self.unit_speed
        self._gain = batch_throughput(self.slots, self.penalty)
        self._work, self._eff = self.unit_speed * self.prior_s, self.prior_s

    @property
    def speed(self) -> float:
        return self.unit_speed * self._gain

    @property
    def gain(self) -> float:
        """A full batch's throughput over one sequence's (``speed / unit_speed``)."""
        return self._gain

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
    servable: frozenset[str] = frozenset()  # models it can load (empty: any, when open)
    # Whether an empty ``servable`` means any model (the simulators' instances). A real
    # instance is closed: it serves what its configuration names or its own model list says,
    # so a mistyped model never becomes one (regional_lb.upstream.pool).
    open_models: bool = True
    loaded: dict[str, float] = field(default_factory=dict)  # model -> last use, for LRU
    healthy: bool = True
    probes_against: int = 0  # consecutive probes disagreeing with ``healthy`` (rise/fall)
    probe_ok_at: float | None = None  # the last probe that succeeded (pool clock)
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
    # The part of ``outstanding`` that is prompt prefill not yet done (Flight.prefill summed),
    # and since when the instance has been working through it (see prefill_backlog()).
    pending_prefill: float = 0.0
    prefill_since: float = 0.0
    # Prefill speed, learned apart from the batched speed (see prefill_speed): decayed sums of
    # the prefill finished (at first tokens) and of the wall time prompts were pending.
    _pf_work: float = 0.0
    _pf_time: float = 0.0
    _pf_at: float = 0.0
    # When the instance last showed it is working: a request completed or a stream produced a
    # token. A saturated instance queues a model probe behind its batch; this tells busy from
    # dead (see regional_lb.upstream.probes).
    progress_at: float = 0.0
    completed: int = 0
    work_done: float = 0.0
    # Progress clock: seconds of progress one running sequence has made, as if it ran alone
    # (wall time divided by the batch slowdown, paused while new prompts are prefilled),
    # advanced whenever the batch changes.
    _clock: float = 0.0
    _clock_at: float = 0.0
    _clock_rate: float = 1.0
    _paused_until: float = 0.0

    # -- accounting -------------------------------------------------------------------------

    def add(
        self, request_id: int, cost: float, now: float, model: str = "", prefill: float = 0.0
    ) -> None:
        """Route a request here. ``prefill``: the part of ``cost`` that is prompt prefill the
        instance will still do (its cached blocks taken off), until :meth:`first_token`; 0
        when the caller does not split its cost (then all of it counts as batched work)."""
        if request_id in self.flights:
            raise ValueError(f"request {request_id} already in flight on {self.id}")
        prefill = min(max(prefill, 0.0), max(cost, 0.0)) if math.isfinite(prefill) else 0.0
        flight = Flight(cost=cost, remaining=cost, started=now, model=model, prefill=prefill)
        self.flights[request_id] = flight
        if model:
            self.loaded[model] = now
        self.outstanding += cost
        self._prefill_clock(now)
        if prefill > 0 and self.pending_prefill <= 0:
            self.prefill_since = now
        self.pending_prefill += prefill
        self.speed.busy(now, len(self.flights))
        self._tick(now)
        n = self.batch_size()
        # The step that produces the first token, slowed by the batch it joins; joining a busy
        # batch also means waiting for the running step to end (half a step on average).
        flight.first_token_steps = batch_slowdown(n, self.speed.penalty) * (1.5 if n > 1 else 1.0)
        flight.queued = len(self.flights) > self.speed.slots or (self.scraped_waiting or 0) > 0

    def update_remaining(self, request_id: int, remaining: float, produced: int) -> None:
        flight = self.flights.get(request_id)
        if flight is None:
            return
        remaining = max(0.0, remaining)
        self.outstanding += remaining - flight.remaining
        flight.remaining = remaining
        flight.produced = produced
        if flight.prefill > remaining:  # what is left cannot hold more prefill than that
            self.pending_prefill -= flight.prefill - remaining
            flight.prefill = remaining

    def first_token(self, request_id: int, now: float) -> None:
        """The first token of a streamed request arrived."""
        flight = self.flights.get(request_id)
        if flight is not None and math.isnan(flight.first_token_at):
            flight.first_token_at = now
            flight.clock_first = self.progress_clock(now)
            self._prefill_clock(now)
            self._pf_work += flight.prefill
            if flight.prefill > 0:
                self.prefill_since = now
            self._prefilled(flight)

    def _prefilled(self, flight: Flight) -> None:
        """The flight's prompt is done: its prefill leaves the pending total (and its work)."""
        if flight.prefill > 0:
            self.outstanding -= flight.prefill
            flight.remaining = max(0.0, flight.remaining - flight.prefill)
            self.pending_prefill -= flight.prefill
            flight.prefill = 0.0
        if not any(f.prefill for f in self.flights.values()):
            self.pending_prefill = 0.0  # float residue must not look like queued prompts

    def release(self, request_id: int, now: float, actual_cost: float | None = None) -> bool:
        """Remove a request however it ended; ``actual_cost`` only when it completed.
        Returns False when it was not in flight (a second release is harmless)."""
        flight = self.flights.pop(request_id, None)
        if flight is None:
            return False
        self._prefill_clock(now)
        if actual_cost is not None:
            # Completed without a first token seen (an answer not streamed): its prompt was
            # prefilled all the same, within the time counted.
            self._pf_work += flight.prefill
        if self.flights:
            self.outstanding -= flight.remaining
            self.pending_prefill -= flight.prefill
        else:
            # Snap to exactly zero: float residue must not look like phantom work.
            self.outstanding = self.pending_prefill = 0.0
        self.speed.busy(now, len(self.flights))
        self._tick(now)
        if actual_cost is not None:
            self.progress_at = now
            self.completed += 1
            self.work_done += actual_cost
            self.speed.completed(now, actual_cost)
        return True

    def timing(
        self,
        request_id: int,
        now: float,
        speed: float,
        prompt_tokens: int,
        output_tokens: int,
    ) -> TimingSample | None:
        """The timing of a request that is completing now (call before :meth:`release`), in
        reference seconds of one sequence alone: wall times multiplied by ``speed`` (this
        instance's normalised single-sequence speed, :func:`timing_speed`), the decode time
        read off the progress clock so the batch slowdown is taken out. None when no first
        token was seen (an answer that was not streamed)."""
        flight = self.flights.get(request_id)
        if flight is None or math.isnan(flight.first_token_at) or not speed > 0:
            return None
        return TimingSample(
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            first_token=(flight.first_token_at - flight.started) * speed,
            first_token_steps=flight.first_token_steps,
            decode=(self.progress_clock(now) - flight.clock_first) * speed,
            queued=flight.queued,
        )

    def prefill_backlog(self, now: float) -> float:
        """Reference seconds of prompt prefill the instance still has to do, as best known:
        the prefill of the requests routed here that have not had their first token, less
        what it has done since it started on them. A server prefills prompts one after
        another, first come first served, at its single-sequence speed (vLLM's chunked
        prefill fills each step with the oldest prompts' tokens), so that backlog drains at
        that speed between first tokens; without this a prompt almost done would still count
        whole until its first token arrived."""
        if self.pending_prefill <= 0:
            return 0.0
        done = max(0.0, now - self.prefill_since) * self.prefill_speed
        return max(0.0, self.pending_prefill - done)

    @property
    def prefill_speed(self) -> float:
        """Reference seconds of prompt prefill the instance gets through per second, learned
        from the prompts routed with a prefill split (:meth:`add`): the prefill finished at
        their first tokens over the wall time prompts were pending here (decayed sums over
        ``PREFILL_HORIZON_S``), starting from the declared speed as ``PREFILL_PRIOR_S``
        seconds of observation; the single-sequence speed until the first such prompt.
        Learned apart from :class:`SpeedLearner`, whose clock counts each second at the
        batch gain of the requests in flight: prompts are prefilled one after another at
        gain 1, so crediting them there taught unit speeds of 0.16-0.75 instead of
        1.0 on the Mooncake trace (long prompts under load), different on each instance, and
        the picker overpriced queued prompts by 2.4 s on average."""
        if self._pf_time <= 0:
            return self.speed.unit_speed
        return self._pf_work / self._pf_time

    def split_speeds(self) -> tuple[float, float]:
        """(full-batch speed, single-sequence speed) for a pick that splits its cost into
        batched work and prompt prefill: both from :attr:`prefill_speed` once it has been
        learned (the full batch at the GPU profile's gain over it), else the batched
        learner's. One speed factor per instance, as the GPU profiles declare it, read from
        the signal that measures it directly; the batched learner's would need the prefill
        and decode shares of each busy second, which the balancer does not see."""
        if self._pf_time <= 0:
            return self.speed.speed, self.speed.unit_speed
        pf = self.prefill_speed
        return pf * self.speed.gain, pf

    def _prefill_clock(self, now: float) -> None:
        """Count the time since the last call as prefill time when prompts were pending."""
        if now > self._pf_at and self.pending_prefill > 0:
            if self._pf_time <= 0:  # the declared speed, as that much observation to start
                self._pf_work, self._pf_time = (
                    self.speed.declared * PREFILL_PRIOR_S,
                    PREFILL_PRIOR_S,
                )
            dt = now - self._pf_at
            decay = math.exp(-dt / PREFILL_HORIZON_S)
            self._pf_work *= decay
            self._pf_time = self._pf_time * decay + dt
        self._pf_at = max(self._pf_at, now)

    def recompute(self) -> None:
        """Rebuild the running total from the flights (drift guard, called now and then)."""
        self.outstanding = sum(f.remaining for f in self.flights.values())
        self.pending_prefill = sum(f.prefill for f in self.flights.values())

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    # -- batch and progress clock ---------------------------------------------------------------

    def batch_size(self) -> int:
        """Sequences running together on the instance, as best known: ours in flight up to the
        batch slots, or what a fresh scrape reports running when it shows the instance holds
        fewer than that (its KV cache is full and requests wait) or more (other replicas)."""
        slots = self.speed.slots
        n = min(self.in_flight, slots)
        running = self.scraped_running
        if running is not None and n > 0 and ((self.scraped_waiting or 0) > 0 or running > n):
            n = min(max(running, 1), slots)
        return n

    def _tick(self, now: float) -> None:
        """Advance the progress clock to ``now`` at the old rate, then take the new batch's."""
        if now > self._clock_at:
            start = max(self._clock_at, min(self._paused_until, now))
            self._clock += (now - start) * self._clock_rate
            self._clock_at = now
        self._clock_rate = 1.0 / batch_slowdown(self.batch_size(), self.speed.penalty)

    def progress_clock(self, now: float) -> float:
        start = max(self._clock_at, min(self._paused_until, now))
        return self._clock + max(0.0, now - start) * self._clock_rate

    def prefill_stall(self, now: float, seconds: float) -> None:
        """A request just added will have its prompt prefilled for about ``seconds``, during
        which the sequences already running make no progress (as in the simulator, and in
        vLLM without chunked prefill; with it, they make less): the progress clock pauses, so
        other requests' prompts do not show up as decode time."""
        self._tick(now)
        if seconds > 0 and math.isfinite(seconds) and self.in_flight > 1:
            self._paused_until = max(self._paused_until, now) + seconds

    def apply_load(
        self, running: int | None, waiting: int | None, kv_usage: float | None, now: float
    ) -> None:
        """A fresh scrape of the instance's own metrics (or None for each when stale)."""
        self.scraped_running, self.scraped_waiting, self.kv_usage = running, waiting, kv_usage
        self._tick(now)

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
        return (
            model in self.loaded
            or model in self.servable
            or (self.open_models and not self.servable)
        )


def speed_anchor(fleet: Sequence[InstanceState]) -> float:
    """How far the fleet's learned single-sequence speeds have moved from their declared
    ones, on average (a geometric mean weighted by completions); 0 when nothing completed."""
    total, log_sum = 0.0, 0.0
    for inst in fleet:
        sp = inst.speed
        if sp.samples > 0 and sp.unit_speed > 0 and sp.declared > 0:
            w = float(min(sp.samples, 100))
            total += w
            log_sum += w * math.log(sp.unit_speed / sp.declared)
    return math.exp(log_sum / total) if total > 0 else 0.0


def timing_speed(inst: InstanceState, anchor: float) -> float:
    """The speed that turns ``inst``'s wall-clock times into reference-GPU seconds for the
    coefficient fit: its learned single-sequence speed over the fleet's :func:`speed_anchor`.

    Learned speeds are themselves measured in cost units, so dividing by them alone would
    leave the fit free to drift: coefficients twice too high make every learned speed twice
    too high, and the fit would then confirm those coefficients. Taking out the fleet-wide
    factor pins the scale to the declared GPU speeds (an A100 is 1.0), while an instance that
    runs slower than its peers (throttled, or shared with other work) is still measured at
    its own speed and does not make the model look expensive.
    """
    own = inst.speed
    if anchor <= 0 or own.unit_speed <= 0:
        return own.declared
    return own.unit_speed / anchor
