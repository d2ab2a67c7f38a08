"""Routing policies compared by the benchmark: the baselines, ours (the balancer's own
:func:`regional_lb.balancing.pick.pick`), and an oracle that knows every request's exact cost.

A policy sees the fleet the way a balancer would: its own accounting of what it sent where
(:class:`regional_lb.balancing.instance.InstanceState`), each instance's declared speed, and nothing
else. Only the oracle reads the simulator's true remaining work.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from regional_lb.balancing.cost import ErrorTracker
from regional_lb.balancing.instance import InstanceState
from regional_lb.balancing.pick import PickParams, PickRequest, pick


class ServerView(Protocol):
    def exact_work_left(self, now: float) -> float: ...

    @property
    def capacity(self) -> float: ...


@dataclass(slots=True)
class Fleet:
    """What a policy may look at when it routes one request."""

    states: list[InstanceState]
    declared_speed: list[float]
    servers: Sequence[ServerView]
    errors: ErrorTracker
    rng: random.Random
    mean_cost: float = 1.0


class Policy(Protocol):
    name: str

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int: ...


def _argmin(values: Sequence[float], start: int) -> int:
    """Index of the smallest value; ties go round from ``start`` so no index is favoured."""
    n = len(values)
    best, best_v = start % n, values[start % n]
    for k in range(1, n):
        i = (start + k) % n
        if values[i] < best_v:
            best, best_v = i, values[i]
    return best


@dataclass
class RoundRobin:
    name: str = "round_robin"
    _next: int = 0

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int:
        i = self._next % len(fleet.states)
        self._next += 1
        return i


@dataclass
class WeightedRoundRobin:
    """Smooth weighted round-robin (as in nginx), weights = declared GPU speeds."""

    name: str = "weighted_round_robin"
    _current: list[float] = field(default_factory=list)

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int:
        w = fleet.declared_speed
        if not self._current:
            self._current = [0.0] * len(w)
        total = sum(w)
        for i, wi in enumerate(w):
            self._current[i] += wi
        i = max(range(len(w)), key=lambda k: self._current[k])
        self._current[i] -= total
        return i


@dataclass
class LeastConnections:
    name: str = "least_connections"
    _turn: int = 0

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int:
        self._turn += 1
        return _argmin([float(s.in_flight) for s in fleet.states], self._turn)


@dataclass
class PowerOfTwo:
    name: str = "power_of_two"

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int:
        a, b = fleet.rng.sample(range(len(fleet.states)), 2)
        return a if fleet.states[a].in_flight <= fleet.states[b].in_flight else b


@dataclass
class SpeedWeightedLeastConnections:
    name: str = "speed_weighted_lc"
    _turn: int = 0

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int:
        self._turn += 1
        scores = [
            (s.in_flight + 1) / w for s, w in zip(fleet.states, fleet.declared_speed, strict=True)
        ]
        return _argmin(scores, self._turn)


@dataclass
class Ours:
    """The balancer's pick(), fed with estimates, learned speeds and the learned error."""

    name: str = "ours"
    params: PickParams = field(default_factory=lambda: PickParams(slow_start_s=0.0))
    _turn: int = 0

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int:
        self._turn += 1
        req = PickRequest(
            model="m",
            cost=est_cost,
            mean_cost=fleet.mean_cost,
            sigma=fleet.errors.sigma,
            tiebreak=self._turn,
        )
        choice = pick(fleet.states, req, now, self.params)
        if choice is None:  # cannot happen here: every simulated instance is eligible
            raise RuntimeError("no eligible instance")
        return fleet.states.index(choice.instance)


@dataclass
class Oracle:
    """Least work left with exact costs, over each instance's full-batch throughput."""

    name: str = "oracle"
    _turn: int = 0

    def choose(self, now: float, est_cost: float, true_cost: float, fleet: Fleet) -> int:
        self._turn += 1
        scores = [(s.exact_work_left(now) + true_cost) / s.capacity for s in fleet.servers]
        return _argmin(scores, self._turn)


POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "weighted_round_robin": WeightedRoundRobin,
    "least_connections": LeastConnections,
    "power_of_two": PowerOfTwo,
    "speed_weighted_lc": SpeedWeightedLeastConnections,
    "ours": Ours,
    "oracle": Oracle,
}
