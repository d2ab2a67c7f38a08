"""The routing decision: a pure function of the instances' state and the request.

Among eligible instances choose the least

    ((1 - w) * (outstanding work + this request's cost) + w * (requests + 1) * mean cost)
    / (learned speed * slow-start ramp)
    + model load time, when the model is not loaded there

``w`` grows with the observed spread of the cost estimates: with exact costs least-work-left is
near optimal, but a pilot simulation showed pure cost routing losing to speed-weighted
least-connections once the estimate error reached sigma ~ 0.6, so a poor estimator leans on the
request count. The same function drives the proxy and the discrete-event simulator; it reads
the instances and never changes them.

**Prefill is not batched.** When the caller says which part of a cost is prompt prefill
(``PickRequest.prefill``, ``InstanceState.add(prefill=...)``), that part is priced at the
instance's single-sequence speed, not its full-batch one: a server prefills prompts one after
another (vLLM fills each step's token budget with the oldest prompts first), so a second of
prefill queued there is a second of wall time before any later prompt's first token, while a
second of decode work is shared by the whole batch. The score becomes

    (batched work: decode, blended as above) / full-batch speed
    + (prefill queued there, less what it has already got through
       + this request's prefill, less what its cached blocks save there) / single-sequence speed

so a cache hit (``PickRequest.prefill_saved``) and queued prompts trade second for second, in
the same unit as the rest of the score. Both speeds then come from the instance's learned
prefill speed (:meth:`regional_lb.balancing.instance.InstanceState.split_speeds`), measured
on the prompts themselves, not from the batched learner, whose clock counts serial prefill at
the batch's gain (on the Mooncake trace it learned 0.16-0.75 for GPUs of speed 1.0, unequal
across identical instances, and for 36% of requests the pick chose an instance at least 0.1 s
slower to their first token than the best). Without the split (``prefill`` None) the score is
exactly the one above: all work batched, a hit subtracted at the single-sequence speed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from regional_lb.balancing.affinity import rank
from regional_lb.balancing.instance import InstanceState


@dataclass(frozen=True, slots=True)
class PickParams:
    slow_start_s: float = 30.0
    slow_start_floor: float = 0.1
    kv_limit: float = 0.95  # a fresh scrape above this means no room for another sequence
    blend_sigma_low: float = 0.3  # at or below: pure work
    blend_sigma_high: float = 1.1  # at or above: pure count
    # Scores closer than this share of the best candidate's own service time for the request
    # count as equal (see pick()).
    tie_tolerance: float = 0.05
    # Session / prefix affinity holds while the affine instance's score is within this many
    # times the mean score of the eligible instances (regional_lb.balancing.affinity).
    affinity_bound: float = 1.25


@dataclass(frozen=True, slots=True)
class PickRequest:
    model: str
    cost: float
    mean_cost: float  # unit of the count term (a typical request's cost)
    sigma: float = 0.0  # current spread of log(actual / estimate)
    load_time_s: float = 20.0
    model_memory_gb: float = 16.0
    # Rotates the order in which exact ties are broken (e.g. the request number), so an idle
    # pool does not send everything to the first instance in the list.
    tiebreak: int = 0
    # A session's or prompt prefix's key (regional_lb.balancing.affinity.key_of), or None.
    affinity: int | None = None
    # Per instance id: reference seconds of prefill the instance would skip because it holds
    # the prompt's leading KV blocks (regional_lb.balancing.kv_index.prefill_saved).
    prefill_saved: Mapping[str, float] | None = None
    # The part of ``cost`` that is prompt prefill with nothing cached (reference seconds), or
    # None when the caller does not split its cost. See pick() for how the two are priced.
    prefill: float | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    instance: InstanceState
    score: float
    needs_load: bool


def blend_weight(sigma: float, params: PickParams) -> float:
    lo, hi = params.blend_sigma_low, params.blend_sigma_high
    if sigma <= lo:
        return 0.0
    if sigma >= hi:
        return 1.0
    return (sigma - lo) / (hi - lo)


def free_memory(inst: InstanceState, model_memory_gb: float) -> float:
    """Memory free for weights, counting each loaded model at the request model's size
    (the balancer does not know other models' sizes; instances report them poorly)."""
    return inst.memory_gb - model_memory_gb * len(inst.loaded)


def can_load(inst: InstanceState, req: PickRequest) -> bool:
    """The model fits, possibly after evicting least-recently-used models nobody is using."""
    if free_memory(inst, req.model_memory_gb) >= req.model_memory_gb:
        return True
    busy = {f.model for f in inst.flights.values()}
    evictable = sum(1 for m in inst.loaded if m not in busy)
    return inst.memory_gb - req.model_memory_gb * (len(inst.loaded) - evictable) >= (
        req.model_memory_gb
    )


def _ramp_if_eligible(
    inst: InstanceState, req: PickRequest, now: float, params: PickParams
) -> float | None:
    """The instance's slow-start factor when it may take ``req``, else None (one pass, so the
    picker does not compute the ramp twice)."""
    if not inst.healthy or inst.draining or now < inst.ejected_until:
        return None
    if not inst.can_serve(req.model):
        return None
    if req.model not in inst.loaded and not can_load(inst, req):
        return None
    ramp = inst.ramp(now, params.slow_start_s, params.slow_start_floor)
    if inst.in_flight >= max(1, math.floor(inst.max_concurrency * ramp)):
        return None
    if inst.kv_usage is not None and inst.kv_usage >= params.kv_limit:
        return None
    return ramp


def eligible(inst: InstanceState, req: PickRequest, now: float, params: PickParams) -> bool:
    return _ramp_if_eligible(inst, req, now, params) is not None


def effective_load(inst: InstanceState, mean_cost: float) -> tuple[float, int]:
    """Outstanding work and count, reconciled with the instance's own metrics: requests it
    reports beyond ours were sent by other balancer replicas and count at the mean cost."""
    work, count = inst.outstanding, inst.in_flight
    if inst.scraped_running is not None:
        reported = inst.scraped_running + (inst.scraped_waiting or 0)
        extra = reported - count
        if extra > 0:
            work += extra * mean_cost
            count += extra
    return work, count


def pick(
    instances: Sequence[InstanceState], req: PickRequest, now: float, params: PickParams
) -> Choice | None:
    """The best eligible instance for ``req``, or None when no instance can take it.

    Scores within ``params.tie_tolerance`` of the best candidate's own time for this
    request are treated as equal: learned speeds of identical GPUs differ by noise, and
    without a tolerance an idle pool would send every request to whichever looks a hair
    faster. Equal candidates go round robin by ``req.tiebreak``. The window is a share of the
    request's own time, not of the whole score: under load a score is mostly work already
    queued, and a window that grew with it (5% of a minute's queue is 3 s) let the tie-break
    override real differences in waiting time (on the mixed fleet, P99 1.20x the oracle's
    against 1.13-1.15x without it).

    With an affinity key, the key's highest-ranked instance whose score is within the load
    bound is chosen instead (:mod:`regional_lb.balancing.affinity`).
    """
    w = blend_weight(req.sigma, params)
    n = len(instances)
    scored: list[tuple[float, int, bool]] = []
    best_score = best_own = math.inf
    own_prefill = 0.0 if req.prefill is None else min(max(req.prefill, 0.0), req.cost)
    # Batched work: the cost's decode, blended with the count when estimates are poor (the
    # output length is what is uncertain; a prompt's size is known).
    own_batched = (1.0 - w) * (req.cost - own_prefill) + w * req.mean_cost
    saved = req.prefill_saved
    for idx, inst in enumerate(instances):
        ramp = _ramp_if_eligible(inst, req, now, params)
        if ramp is None:
            continue
        work, count = effective_load(inst, req.mean_cost)
        # Prompts routed here and not yet at their first token: all of it leaves the batched
        # work; what the instance has not yet got through is priced serially.
        pending = min(inst.pending_prefill, work)
        backlog = min(inst.prefill_backlog(now), pending)
        full, single = (
            inst.split_speeds()
            if req.prefill is not None
            else (inst.speed.speed, inst.speed.unit_speed)
        )
        rate = max(full, 1e-9) * ramp
        unit = max(single, 1e-9) * ramp
        cut = saved.get(inst.id, 0.0) if saved else 0.0
        if req.prefill is not None:
            cut = min(cut, own_prefill)
        own = own_batched / rate + (own_prefill - cut) / unit
        batched = (1.0 - w) * (work - pending) + w * count * req.mean_cost
        score = batched / rate + backlog / unit + own
        needs_load = req.model not in inst.loaded
        if needs_load:
            score += req.load_time_s
        scored.append((score, idx, needs_load))
        if score < best_score:
            # Without a split, the tie window is the request's whole time there, as before.
            best_score, best_own = score, own if req.prefill is not None else own_batched / rate
    if not scored:
        return None
    if req.affinity is not None and len(scored) > 1:
        # Bounded-load affinity: the key's highest-ranked instance under the bound.
        bound = params.affinity_bound * sum(c[0] for c in scored) / len(scored) + 1e-12
        under = [c for c in scored if c[0] <= bound]
        if under:
            key = req.affinity
            held = max(under, key=lambda c: rank(key, instances[c[1]].id))
            return Choice(instances[held[1]], held[0], held[2])
    limit = best_score + params.tie_tolerance * best_own + 1e-12
    chosen = min(
        (c for c in scored if c[0] <= limit),
        # Among equals: no model load first, then most free memory, then round robin.
        key=lambda c: (
            c[2],
            -free_memory(instances[c[1]], req.model_memory_gb),
            (c[1] - req.tiebreak) % n,
        ),
    )
    return Choice(instances[chosen[1]], chosen[0], chosen[2])
