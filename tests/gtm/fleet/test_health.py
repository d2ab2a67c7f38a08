from __future__ import annotations

from gtm.decision.snapshot import HealthState
from gtm.fleet.health import TargetHealth, Thresholds, observe

T = Thresholds(rise=2, fall=3)


def run(outcomes: str, start: TargetHealth | None = None) -> list[HealthState]:
    """'+' success, '-' failure, 'd' success saying draining."""
    h = start or TargetHealth()
    states = []
    for i, c in enumerate(outcomes):
        h = observe(h, c != "-", c == "d", float(i), T)
        states.append(h.state)
    return states


U, D, N, R = HealthState.UP, HealthState.DOWN, HealthState.UNKNOWN, HealthState.DRAINING


def test_rise_and_fall_thresholds() -> None:
    assert run("++") == [N, U]
    assert run("++--+---") == [N, U, U, U, U, U, U, D]
    assert run("---++") == [N, N, D, D, U]


def test_flapping_is_damped() -> None:
    # Alternating outcomes never reach either threshold once up: the state holds.
    assert set(run("++" + "-+" * 20)[2:]) == {U}


def test_draining_is_immediate_and_undraining_too() -> None:
    assert run("++d+") == [N, U, R, U]
    assert run("d") == [R]


def test_since_moves_only_on_change() -> None:
    h = TargetHealth()
    h = observe(h, True, False, 1.0, T)
    h = observe(h, True, False, 2.0, T)
    assert (h.state, h.since) == (U, 2.0)
    h = observe(h, True, False, 3.0, T)
    assert h.since == 2.0
