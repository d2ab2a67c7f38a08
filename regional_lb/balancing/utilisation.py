"""How busy a region is: the ``utilisation`` of the capacity report the global tier spills on.

Requests in flight over concurrency limits misses how inference servers saturate. A
continuous-batching server is near its throughput ceiling long before every slot is taken
(each extra sequence slows the others); it is full when its KV cache is, which with long
contexts happens at a fraction of its batch slots; and work waiting in the balancer's
admission queue or in the server's own queue is load the region is not keeping up with. So,
for each instance in service (fresh scrapes only; stale ones are ``None`` on the instance):

* ``demand``: sequences that want to run there: ours in flight, or what its metrics report
  running plus waiting when that is more (other balancer replicas send work too);
* ``fits``: sequences it can hold now: its batch slots (capped by our concurrency limit,
  scaled by the slow-start ramp), or fewer when the KV cache is filling: with ``r`` running
  at KV usage ``k``, about ``r / (k / kv_limit)`` fit;
* ``busy``: the share of its current throughput ceiling in use,
  ``batch_throughput(min(demand, fits)) / batch_throughput(fits)`` (with one slot, the slot
  share), and at least the KV share ``k / kv_limit``;
* ``u = busy + max(0, demand - fits) / fits``: above 1 by the work queued per sequence slot.

The region's utilisation is the capacity-weighted mean of ``u`` (weights: what each instance
delivers at ``fits``, in cost units per second) plus the requests queued at the balancer per
sequence the pool can hold, capped at :data:`UTILISATION_CAP`. Measured in throughput rather
than slots, ``utilisation x capacity`` is about the work per second being done, which is what
the global tier's spill share ``(u - low) / u`` assumes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from regional_lb.balancing.instance import InstanceState
from regional_lb.balancing.pick import PickParams

# Above 1.0 work is waiting. The global tier sheds ``(u - low) / u`` of a region's clients
# (capped by its own max_share), so the cap bounds how hard a burst of queueing can push
# clients away: 2.0 sheds at most 65% with the default low watermark of 0.7.
UTILISATION_CAP = 2.0


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    demand: int  # sequences that want to run on the instance
    fits: float  # sequences it can hold now
    busy: float  # share of its current throughput ceiling in use, 0..1
    utilisation: float  # busy + queued sequences per sequence that fits
    rate: float  # cost units per second it delivers holding `fits` sequences


def _throughput(n: float, penalty: float) -> float:
    return n / (1.0 + penalty * (n - 1.0)) if n > 0 else 0.0


def instance_load(inst: InstanceState, now: float, params: PickParams) -> InstanceLoad:
    ramp = inst.ramp(now, params.slow_start_s, params.slow_start_floor)
    slots = max(1, math.floor(min(inst.speed.slots, inst.max_concurrency) * ramp))
    demand = inst.in_flight
    running = inst.scraped_running
    if running is not None:
        demand = max(demand, running + (inst.scraped_waiting or 0))
    fits = float(slots)
    kv_share = 0.0
    kv = inst.kv_usage
    if kv is not None and running and kv > 0 and params.kv_limit > 0:
        kv_share = kv / params.kv_limit
        fits = min(fits, max(1.0, running / kv_share))
    penalty = inst.speed.penalty
    ceiling = _throughput(fits, penalty)
    busy = _throughput(min(demand, fits), penalty) / ceiling
    busy = min(1.0, max(busy, kv_share))
    queued = max(0.0, demand - fits)
    return InstanceLoad(
        demand=demand,
        fits=fits,
        busy=busy,
        utilisation=busy + queued / fits,
        rate=inst.speed.unit_speed * ceiling,
    )


def pool_utilisation(
    serving: Sequence[InstanceState], queued: int, now: float, params: PickParams
) -> float:
    """The region's utilisation (see the module docstring); ``queued`` is the number of
    requests waiting in the balancer's admission queues. With nothing in service the region
    can do no work at all: it reports the cap."""
    loads = [instance_load(i, now, params) for i in serving]
    total_rate = sum(x.rate for x in loads)
    total_fits = sum(x.fits for x in loads)
    if not loads or total_fits <= 0:
        return UTILISATION_CAP
    if total_rate > 0:
        mean = sum(x.rate * x.utilisation for x in loads) / total_rate
    else:
        mean = sum(x.utilisation for x in loads) / len(loads)
    u = mean + max(queued, 0) / total_fits
    if not math.isfinite(u):
        return UTILISATION_CAP
    return min(UTILISATION_CAP, max(0.0, u))
