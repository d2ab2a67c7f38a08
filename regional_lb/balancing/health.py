"""Health transitions of an instance: active probes, passive outlier ejection, slow start, drain.

These functions change one :class:`InstanceState` (and read the pool for the ejection cap); they
do no I/O, so the proxy's probe loop and the tests drive them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from regional_lb.balancing.instance import InstanceState


@dataclass(frozen=True, slots=True)
class EjectionParams:
    consecutive_failures: int = 5  # 5xx, timeouts and stalls in a row before ejection
    base_s: float = 10.0  # first ejection; doubles on each repeat
    max_s: float = 300.0
    max_ejected_share: float = 0.5  # never eject more than this share of the pool


def ejected_share(pool: Sequence[InstanceState], now: float) -> float:
    if not pool:
        return 0.0
    return sum(1 for i in pool if i.ejected(now)) / len(pool)


def record_success(inst: InstanceState) -> None:
    inst.consecutive_failures = 0


def record_failure(
    inst: InstanceState, pool: Sequence[InstanceState], now: float, params: EjectionParams
) -> bool:
    """Count a 5xx, timeout or stalled stream; returns True when this ejected the instance."""
    inst.consecutive_failures += 1
    if inst.consecutive_failures < params.consecutive_failures or inst.ejected(now):
        return False
    # The cap keeps a correlated failure (e.g. a bad model push) from emptying the pool:
    # ejecting everything would turn partial errors into total unavailability.
    if len(pool) > 0 and (sum(1 for i in pool if i.ejected(now)) + 1) / len(pool) > (
        params.max_ejected_share
    ):
        return False
    duration = min(params.max_s, params.base_s * (2 ** min(inst.ejections, 30)))
    inst.ejected_until = now + duration
    inst.ejections += 1
    inst.consecutive_failures = 0
    # Returning instances ramp up again rather than taking a full share at once.
    inst.joined_at = inst.ejected_until
    return True


def record_probe(
    inst: InstanceState, ok: bool, now: float, *, rise: int = 1, fall: int = 1
) -> bool:
    """Apply an active probe's result; returns True when the health state changed. The state
    flips after ``fall`` failed probes in a row (``rise`` good ones to come back)."""
    if ok == inst.healthy:
        inst.probes_against = 0
        return False
    inst.probes_against += 1
    if inst.probes_against < (rise if ok else fall):
        return False
    inst.probes_against = 0
    inst.healthy = ok
    if ok:
        inst.joined_at = now  # slow start after recovery
    return True


def busy_not_stuck(inst: InstanceState, now: float, patience_s: float) -> bool:
    """Whether an instance whose model probe timed out is merely busy: it has requests in
    flight, and it showed progress (a completion or a streamed token) within ``patience_s``
    (the first-byte timeout a request gets), or its oldest request is younger than that. An
    instance that is really stuck fails this once its requests have waited as long as a
    request may; by then they fail by timeout too, and passive ejection agrees."""
    if not inst.flights:
        return False
    oldest = min(f.started for f in inst.flights.values())
    return now - max(inst.progress_at, oldest) <= patience_s


def start_drain(inst: InstanceState) -> None:
    """No new requests; the ones in flight (including streams) run to their end."""
    inst.draining = True


def end_drain(inst: InstanceState, now: float) -> None:
    if inst.draining:
        inst.draining = False
        inst.joined_at = now


def drained(inst: InstanceState) -> bool:
    return inst.draining and inst.in_flight == 0


def is_stalled(last_token_at: float, now: float, stall_timeout_s: float) -> bool:
    """A stream that produced nothing for ``stall_timeout_s`` counts against its instance."""
    return now - last_token_at > stall_timeout_s
