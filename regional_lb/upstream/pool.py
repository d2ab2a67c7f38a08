"""The balancer's state for one region: instances, estimator, admission, and request leases.

A :class:`Lease` is one routed request's claim on an instance. It is created by
:meth:`Pool.route` (which adds the request's cost to the instance) and ended exactly once by
:meth:`Lease.end`, whatever happened: completion, upstream error, client disconnect or
cancellation. Ending twice is harmless, so every exit path may call it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from regional_lb.balancing.admission import (
    AdmissionController,
    PoolLoad,
    RetryBudget,
    TierSpec,
    TokenBucket,
)
from regional_lb.balancing.cost import CostEstimator, ModelCoefficients, RequestShape
from regional_lb.balancing.gpus import GPUS, batch_slowdown, profile
from regional_lb.balancing.health import EjectionParams, record_failure, record_success
from regional_lb.balancing.instance import InstanceState, SpeedLearner, speed_anchor, timing_speed
from regional_lb.balancing.kv_index import KvIndex, prefill_saved
from regional_lb.balancing.pick import PickParams, PickRequest, pick
from regional_lb.balancing.utilisation import pool_utilisation
from regional_lb.capacity_report import CapacityReport, ModelAvailability
from regional_lb.config import BalancerConfig, InstanceConfig, ModelConfig, TenantConfig
from regional_lb.errors import NoInstanceError, Overloaded, RequestError
from regional_lb.upstream.cache_stats import CacheFigures
from regional_lb.upstream.profiles import Upstream, upstream_for

# Rule 8: one bucket per caller without a key (by address) is a table attackers can grow.
MAX_ANONYMOUS_BUCKETS = 10_000

# ok: completed (its actual cost teaches the estimator and the speed learner);
# upstream_error: 5xx, timeout, stall or broken stream (counts towards ejection);
# client_error: the instance refused the request (4xx); client_gone / cancelled: we stopped it.
Outcome = Literal["ok", "upstream_error", "client_error", "client_gone", "cancelled"]


def _coefficients(m: ModelConfig) -> ModelCoefficients:
    return ModelCoefficients(
        m.prefill_per_token, m.decode_per_token, m.overhead, m.load_time_s, m.memory_gb
    )


def instance_from_config(ic: InstanceConfig, joined_at: float) -> InstanceState:
    gpu = profile(ic.gpu) if ic.gpu.upper() in GPUS else None
    slots = gpu.batch_slots if gpu else 16
    return InstanceState(
        id=ic.id,
        url=ic.url.rstrip("/"),
        gpu=ic.gpu,
        speed=SpeedLearner(
            unit_speed=ic.speed or (gpu.speed if gpu else 1.0),
            slots=slots,
            penalty=gpu.batch_penalty if gpu else 0.15,
        ),
        # Up to a full batch plus as much again queued at the instance: enough to keep it
        # busy, little enough that queued work stays here where it can be re-routed.
        max_concurrency=ic.max_concurrency or 2 * slots,
        memory_gb=ic.memory_gb or (gpu.memory_gb if gpu else 80.0),
        servable=frozenset(ic.models),
        loaded=dict.fromkeys(ic.models, 0.0),
        # Without configured models it serves what its own list says, once it has said.
        open_models=False,
        joined_at=joined_at,
        scrape=ic.metrics,
    )


@dataclass
class Lease:
    pool: Pool
    request_id: int
    instance: InstanceState
    shape: RequestShape
    cost: float
    started: float
    # The output length the estimate assumed (error tracking compares like with like).
    predicted_tokens: float | None = None
    produced: int = 0
    last_token_at: float = 0.0
    ended: bool = False
    outcome: Outcome | None = None
    on_end: list[Callable[[], None]] = field(default_factory=list)

    def progress(self, produced: int, now: float) -> None:
        """Tokens streamed so far: the remaining work is re-estimated from them."""
        if self.ended or produced <= self.produced:
            return
        if self.produced == 0:
            self.instance.first_token(self.request_id, now)
        self.produced, self.last_token_at = produced, now
        self.instance.progress_at = now
        left = self.pool.estimator.remaining(self.shape, produced)
        self.instance.update_remaining(self.request_id, left, produced)

    def end(self, outcome: Outcome, output_tokens: int | None = None) -> None:
        if self.ended:
            return
        self.ended, self.outcome = True, outcome
        now = self.pool.clock()
        actual = None
        if outcome == "ok":
            tokens = output_tokens if output_tokens is not None else self.produced
            pool, inst, estimator = self.pool, self.instance, self.pool.estimator
            # A completed stream's timing refits its model's coefficients (before the
            # release: the timing is read from the request's flight).
            speed = timing_speed(inst, pool.refresh_speed_anchor())
            sample = inst.timing(self.request_id, now, speed, self.shape.prompt_tokens, tokens)
            if sample is not None:
                estimator.learn(self.shape.model, sample)
            actual = estimator.observe(self.shape, self.cost, tokens, self.predicted_tokens)
            record_success(inst)
        self.instance.release(self.request_id, now, actual_cost=actual)
        if outcome == "upstream_error" and record_failure(
            self.instance, self.pool.instances, now, self.pool.ejection
        ):
            self.pool.on_ejected(self.instance)
        for hook in self.on_end:
            hook()


@dataclass
class Pool:
    config: BalancerConfig
    clock: Callable[[], float] = time.monotonic
    instances: list[InstanceState] = field(default_factory=list)
    estimator: CostEstimator = field(default_factory=CostEstimator)
    params: PickParams = field(default_factory=PickParams)
    ejection: EjectionParams = field(default_factory=EjectionParams)
    draining: bool = False
    on_ejected: Callable[[InstanceState], None] = lambda inst: None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    _mean_cost: float = 0.0
    _costs_seen: int = 0
    _speed_anchor: float = 0.0  # instance.speed_anchor, refreshed on each completion
    _buckets: OrderedDict[str, TokenBucket] = field(default_factory=OrderedDict)
    # Per instance id: endpoints, server kind and credential (regional_lb.upstream.profiles),
    # and the model cards its /v1/models listed (served back with their own fields).
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    model_cards: dict[str, dict[str, dict[str, object]]] = field(default_factory=dict)
    # Instance id -> when its model list was last read (pool clock).
    listed: dict[str, float] = field(default_factory=dict)
    # Instance id -> set when a model listing that may disturb work there ends; requests
    # routed there meanwhile wait for it (regional_lb.upstream.profiles).
    _listing: dict[str, asyncio.Event] = field(default_factory=dict)
    # Which instance holds which KV blocks, from their KV-cache events
    # (regional_lb.upstream.kv_subscriber); None: routing ignores prefix caches.
    kv_index: KvIndex | None = None

    def __post_init__(self) -> None:
        cfg = self.config
        now = self.clock()
        for ic in cfg.instances:
            # Configured instances start in service; slow start is for joins and returns.
            self.instances.append(instance_from_config(ic, joined_at=now - cfg.health.slow_start_s))
            self.upstreams[ic.id] = upstream_for(ic, cfg)
        self.estimator = CostEstimator(
            coefficients={name: _coefficients(m) for name, m in cfg.models.items()}
        )
        h = cfg.health
        self.params = PickParams(
            slow_start_s=h.slow_start_s,
            kv_limit=cfg.kv_limit,
            affinity_bound=cfg.affinity.load_bound,
        )
        self.ejection = EjectionParams(
            h.consecutive_failures, h.ejection_base_s, h.ejection_max_s, h.max_ejected_share
        )
        tiers = {
            t.name: TierSpec(t.name, rank, t.max_utilisation, t.queue_limit, t.queue_timeout_s)
            for rank, t in enumerate(cfg.tiers)
        }
        bp = cfg.backpressure
        self.admission = AdmissionController(
            tiers, self.load, clock=self.clock, jitter=bp.jitter, rng=random.Random()
        )
        self.retry_budget = RetryBudget(bp.retry_budget_ratio, bp.retry_budget_min_per_s)

    # -- membership --------------------------------------------------------------------------

    def join(self, ic: InstanceConfig) -> InstanceState:
        """Add an instance at run time; it takes a growing share over the slow-start window."""
        if any(i.id == ic.id for i in self.instances):
            raise RequestError(409, f"instance {ic.id!r} already exists", code="conflict")
        inst = instance_from_config(ic, joined_at=self.clock())
        self.upstreams[ic.id] = upstream_for(ic, self.config)
        self.instances.append(inst)
        self.admission.wake()
        return inst

    def leave(self, instance_id: str) -> None:
        """Remove an instance that has nothing in flight (drain it first)."""
        inst = self.by_id(instance_id)
        if inst.in_flight:
            raise RequestError(
                409,
                f"instance {instance_id!r} still has requests in flight; drain it first",
                code="conflict",
            )
        self.instances.remove(inst)
        if self.kv_index is not None:
            self.kv_index.untrack(instance_id)
        self.upstreams.pop(instance_id, None)
        self.model_cards.pop(instance_id, None)
        self.listed.pop(instance_id, None)
        self.end_listing(instance_id)

    # -- lookups ----------------------------------------------------------------------------

    def by_id(self, instance_id: str) -> InstanceState:
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        raise KeyError(instance_id)

    def tier_for(self, asked: str | None, spec: TenantConfig) -> str:
        """The verified tenant's tier; the caller may ask for a lower one (a batch job of a
        realtime tenant), never a higher one: priority is granted, not claimed."""
        tiers = self.admission.tiers
        granted = tiers[spec.tier or self.config.default_tier]
        if asked and asked in tiers and tiers[asked].rank >= granted.rank:
            return asked
        return granted.name

    def check_rate(self, key: str, spec: TenantConfig, who: str) -> None:
        """Token bucket per tenant (``key``), or per address for callers without a key;
        raises Overloaded with the time until a token is due."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(spec.rate, spec.burst)
            while len(self._buckets) > MAX_ANONYMOUS_BUCKETS:
                self._buckets.popitem(last=False)  # the least recently used
        else:
            self._buckets.move_to_end(key)
        wait = bucket.take(self.clock())
        if wait > 0:
            raise Overloaded(f"rate limit for {who}", retry_after=wait)

    def resolve_model(self, name: str) -> str:
        """Canary or blue/green: the served model a request for ``name`` goes to."""
        spec = self.config.models.get(name)
        if spec is None or not spec.versions:
            return name
        total = sum(v.weight for v in spec.versions)
        if total <= 0:
            return name
        u = self._rng.random() * total
        for v in spec.versions:
            u -= v.weight
            if u < 0:
                return v.name
        return spec.versions[-1].name

    def model_state(self, name: str) -> Literal["known", "pending", "unknown"]:
        """``known``: configured, or some instance serves it; ``pending``: not yet, but an
        instance has not listed its models yet (it may); else ``unknown``."""
        if name in self.config.models or any(i.can_serve(name) for i in self.instances):
            return "known"
        # Out of service or not, an instance that has not listed may serve it: a 503 (come
        # back), not a 404 that would tell the client the model does not exist.
        if any(not i.servable and i.id not in self.listed for i in self.instances):
            return "pending"
        return "unknown"

    def known_model(self, name: str) -> bool:
        return self.model_state(name) == "known"

    # -- model listings that may disturb work --------------------------------------------------

    def begin_listing(self, instance_id: str) -> bool:
        """Whether the instance's model list may be read now: always where listing is
        harmless; where it may disturb work, only while none of our requests runs there, and
        then requests routed there wait until :meth:`end_listing`."""
        up = self.upstreams.get(instance_id)
        if up is None or not up.listing_disturbs:
            return up is not None
        if self.by_id(instance_id).in_flight or instance_id in self._listing:
            return False
        self._listing[instance_id] = asyncio.Event()
        return True

    def end_listing(self, instance_id: str) -> None:
        gate = self._listing.pop(instance_id, None)
        if gate is not None:
            gate.set()

    async def listing_done(self, instance_id: str) -> None:
        """Wait (a listing lasts milliseconds, bounded by the probe timeout) until no model
        listing runs on the instance."""
        gate = self._listing.get(instance_id)
        if gate is not None:
            await gate.wait()

    # -- routing ----------------------------------------------------------------------------

    def estimate(self, shape: RequestShape) -> float:
        cost = self.estimator.estimate(shape)
        self._costs_seen += 1
        self._mean_cost += (cost - self._mean_cost) / min(self._costs_seen, 1000)
        return cost

    def refresh_speed_anchor(self) -> float:
        """Recompute the fleet's :func:`regional_lb.balancing.instance.speed_anchor` (on
        completions; routing reads the cached value)."""
        self._speed_anchor = speed_anchor(self.instances)
        return self._speed_anchor

    def prefill_saved(self, shape: RequestShape, blocks: Sequence[int]) -> dict[str, float]:
        """Per instance: reference seconds of ``shape``'s prefill its cached blocks save
        (:func:`regional_lb.balancing.kv_index.prefill_saved`). Instances out of service lose
        their entries first: one that failed comes back with an empty cache, and one that
        drains must not draw requests for its cache."""
        index = self.kv_index
        if index is None or not blocks:
            return {}
        now = self.clock()
        for inst in self.instances:
            if not inst.healthy or inst.draining or inst.ejected(now):
                index.forget(inst.id)
        per_token = self.estimator.coeffs(shape.model).prefill_per_token
        ids = [i.id for i in self.instances]
        return prefill_saved(index, ids, blocks, shape.prompt_tokens, per_token)

    def pick_request(
        self,
        shape: RequestShape,
        cost: float,
        affinity: int | None = None,
        saved: dict[str, float] | None = None,
        prefill: float | None = None,
    ) -> PickRequest:
        c = self.estimator.coeffs(shape.model)
        return PickRequest(
            shape.model,
            cost,
            self._mean_cost or cost,
            self.estimator.sigma,
            c.load_time_s,
            c.memory_gb,
            tiebreak=self._costs_seen,
            affinity=affinity,
            prefill_saved=saved or None,
            prefill=prefill,
        )

    def _prompt_prefill(self, shape: RequestShape, cost: float) -> float:
        """The part of ``cost`` that is prefilling the whole prompt (reference seconds)."""
        per_token = self.estimator.coeffs(shape.model).prefill_per_token
        return min(max(per_token * shape.prompt_tokens, 0.0), cost)

    def can_serve(self, model: str) -> bool:
        """Some instance in service could take this model, now or once it has room."""
        if self.draining:
            return False
        return any(i.can_serve(model) for i in self.serving())

    def route(
        self,
        shape: RequestShape,
        cost: float,
        affinity: int | None = None,
        blocks: Sequence[int] = (),
    ) -> Lease:
        """Pick an instance and lease it. ``affinity``: a session's or prompt prefix's key
        (:mod:`regional_lb.balancing.affinity`), honoured under the load bound. ``blocks``:
        the prompt's KV block hashes (:func:`regional_lb.balancing.kv_blocks.block_hashes`);
        with a KV index, each instance is charged only the prefill it would still need."""
        state = self.model_state(shape.model)
        if state == "pending":
            raise NoInstanceError(f"no instance has listed its models yet ({shape.model!r})")
        if state == "unknown":
            raise RequestError(
                404,
                f"The model `{shape.model}` does not exist.",
                code="model_not_found",
                param="model",
            )
        saved = self.prefill_saved(shape, blocks)
        # With a KV index and the prompt's blocks, the cost is split: its prompt part is priced
        # at the single-sequence speed, queued prompts and cache hits second for second
        # (regional_lb.balancing.pick). Without them the score is the one the prefix-free
        # scenarios were tuned on.
        prefill = (
            self._prompt_prefill(shape, cost) if self.kv_index is not None and blocks else None
        )
        now = self.clock()
        choice = (
            None
            if self.draining
            else pick(
                self.instances,
                self.pick_request(shape, cost, affinity, saved, prefill),
                now,
                self.params,
            )
        )
        if choice is None:
            raise NoInstanceError(f"no instance can take model {shape.model!r} now")
        rid = next(self._ids)
        inst = choice.instance
        skipped = saved.get(inst.id, 0.0)  # prefill the instance takes from its cache
        if self.kv_index is not None and blocks:
            # Routing history: the index's estimate for instances without live KV events.
            self.kv_index.note_routed(inst.id, blocks)
        inst.add(
            rid,
            max(cost - skipped, 0.0),
            now,
            model=shape.model,
            prefill=0.0 if prefill is None else max(prefill - skipped, 0.0),
        )
        stall = max(self.estimator.prefill_stall(shape) - skipped, 0.0)
        if stall > 0:
            inst.prefill_stall(now, stall / timing_speed(inst, self._speed_anchor))
        expected = self.estimator.expected_output_tokens(shape)
        return Lease(self, rid, inst, shape, cost, now, expected, last_token_at=now)

    # -- pool-wide figures -------------------------------------------------------------------

    def serving(self) -> list[InstanceState]:
        now = self.clock()
        return [i for i in self.instances if i.healthy and not i.draining and not i.ejected(now)]

    def load(self) -> PoolLoad:
        now = self.clock()
        live = self.serving()
        slots = sum(
            max(
                1,
                math.floor(
                    i.max_concurrency
                    * i.ramp(now, self.params.slow_start_s, self.params.slow_start_floor)
                ),
            )
            for i in live
        )
        return PoolLoad(
            slots=slots,
            outstanding=sum(i.outstanding for i in self.instances),
            capacity=sum(i.speed.speed for i in live),
            service_s_hint=self._service_hint(live),
        )

    def _service_hint(self, live: list[InstanceState]) -> float:
        """Seconds a typical request holds its slot when the pool is full: its estimated cost
        (reference seconds alone) slowed by the batch it shares, on the instance's speed."""
        if not live or self._mean_cost <= 0:
            return 0.0
        total = 0.0
        for i in live:
            n = max(1, min(i.max_concurrency, i.speed.slots))
            # unit_speed: one sequence alone (speed is a full batch's drain rate).
            total += self._mean_cost * batch_slowdown(n, i.speed.penalty) / i.speed.unit_speed
        return total / len(live)

    def utilisation(self) -> float:
        """The region's utilisation (:mod:`regional_lb.balancing.utilisation`)."""
        depth = sum(self.admission.depth().values())
        return pool_utilisation(self.serving(), depth, self.clock(), self.params)

    def capacity_report(self, seq: int, cache: CacheFigures | None = None) -> CapacityReport:
        live = self.serving()
        load = self.load()
        models: dict[str, set[str]] = {}
        for inst in live:
            for m in inst.loaded:
                models.setdefault(m, set())
        for name, spec in self.config.models.items():
            versions = {v.name for v in spec.versions}
            if name in models or any(v in models for v in versions):
                models.setdefault(name, set()).update(versions)
        depth = self.admission.depth()
        utilisation = pool_utilisation(live, sum(depth.values()), self.clock(), self.params)
        can_take = bool(live) and not self.draining
        return CapacityReport(
            region=self.config.region,
            seq=seq,
            ts=time.time(),
            instances_healthy=len(live),
            instances_total=len(self.instances),
            capacity=load.capacity,
            outstanding=load.outstanding,
            utilisation=utilisation,
            queue_depth=depth,
            models=[
                ModelAvailability(name=m, versions=sorted(v)) for m, v in sorted(models.items())
            ],
            draining=self.draining,
            can_take_work=can_take,
            prefix_cache_hit_rate=None if cache is None else cache.prefix_cache_hit_rate,
            kv_free_fraction=None if cache is None else cache.kv_free_fraction,
            kv_free_blocks=None if cache is None else cache.kv_free_blocks,
        )
