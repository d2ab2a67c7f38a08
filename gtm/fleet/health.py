"""Region health from probe outcomes: a pure state machine with hysteresis.

A region becomes UP after ``rise`` consecutive successful probes and DOWN after ``fall``
consecutive failures, so one lost probe does not move traffic and one lucky probe does not bring
it back (flapping is damped). A successful probe whose report says the region is draining makes
it DRAINING at once: that is the operator's or balancer's explicit word, not a measurement.
Until the thresholds are first met a region stays UNKNOWN, which routing treats as configured
(``routing.unknown_health_is_up``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gtm.decision.snapshot import HealthState


@dataclass(frozen=True, slots=True)
class Thresholds:
    rise: int = 2
    fall: int = 3


@dataclass(frozen=True, slots=True)
class TargetHealth:
    state: HealthState = HealthState.UNKNOWN
    successes: int = 0  # consecutive
    failures: int = 0  # consecutive
    since: float = 0.0  # when the state last changed
    detail: str = ""


def observe(
    previous: TargetHealth,
    ok: bool,
    draining: bool,
    now: float,
    thresholds: Thresholds,
    detail: str = "",
) -> TargetHealth:
    """Fold one probe outcome into a region's health."""
    if ok:
        successes, failures = previous.successes + 1, 0
        if draining:
            state = HealthState.DRAINING
        elif successes >= thresholds.rise or previous.state is HealthState.UP:
            state = HealthState.UP
        elif previous.state is HealthState.DRAINING:
            state = HealthState.UP  # undrained: it answered and no longer says draining
        else:
            state = previous.state
    else:
        successes, failures = 0, previous.failures + 1
        state = HealthState.DOWN if failures >= thresholds.fall else previous.state
    since = now if state is not previous.state else previous.since
    return TargetHealth(state, successes, failures, since, detail)
