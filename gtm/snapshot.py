"""The snapshot: everything one decision reads, immutable, replaced as a whole.

Health probing, capacity intake, policy activation and GeoIP reloads each build a new
:class:`Snapshot` from the current one and swap the single reference held by
:class:`SnapshotStore`; the DNS and HTTP paths read ``store.current`` and never wait.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, TypeVar

from gtm.geoip import GeoDatabase
from gtm.geometry import UnitVector, unit_vector
from gtm.policy import PolicySet
from gtm.topology import Service, Spillover, Topology


class HealthState(StrEnum):
    UP = "up"
    DOWN = "down"
    DRAINING = "draining"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class RegionHealth:
    state: HealthState
    since: float  # unix seconds of the last state change
    detail: str = ""
    # Share of its clients a region being re-admitted after an outage has back (0..1); the
    # rest stay where failover sent them (gtm.region_state, gtm.routing).
    admitted: float = 1.0


@dataclass(frozen=True, slots=True)
class RegionCapacity:
    """The last capacity report of a region, as the decision sees it."""

    utilisation: float
    reported_at: float  # unix seconds
    # Hysteresis state: set when utilisation reached the high watermark, cleared only below the
    # low one, so a region hovering at the threshold does not flip its clients back and forth.
    spilling: bool
    can_take_work: bool = True


def next_capacity(
    previous: RegionCapacity | None,
    utilisation: float,
    reported_at: float,
    can_take_work: bool,
    watermarks: Spillover,
) -> RegionCapacity:
    """Fold one report into the region's capacity state (pure; used by capacity intake)."""
    was_spilling = previous.spilling if previous is not None else False
    if utilisation >= watermarks.high_watermark:
        spilling = True
    elif utilisation <= watermarks.low_watermark:
        spilling = False
    else:
        spilling = was_spilling
    return RegionCapacity(utilisation, reported_at, spilling, can_take_work)


@dataclass(frozen=True, slots=True)
class Versions:
    """What a decision was made from; recorded with it so it can be explained and replayed."""

    snapshot: int
    topology: str
    policy: str
    geoip: str


K = TypeVar("K")
V = TypeVar("V")


def _frozen(mapping: Mapping[K, V]) -> Mapping[K, V]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, slots=True)
class RegionView:
    """A region as the answering path reads it: plain values, rendered once per snapshot."""

    id: str
    lat: float
    lon: float
    weight: float
    ipv4: tuple[str, ...]
    ipv6: tuple[str, ...]
    base_url: str
    point: UnitVector


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    topology: Topology
    policy: PolicySet
    geo: GeoDatabase
    health: Mapping[str, RegionHealth] = field(default_factory=dict)
    capacity: Mapping[str, RegionCapacity] = field(default_factory=dict)
    # Operator weight overrides, replacing the topology's weight of a region.
    weights: Mapping[str, float] = field(default_factory=dict)
    built_at: float = 0.0
    versions: Versions = field(init=False)
    regions: Mapping[str, RegionView] = field(init=False, repr=False)
    services: Mapping[str, Service] = field(init=False, repr=False)
    # Memo of rankings (gtm.plan): they depend on the topology and the client's location only,
    # so successors that keep the topology share it across health and capacity swaps.
    ranks: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)
    # Memo of policy verdicts (gtm.plan), shared by successors that keep the policy.
    verdicts: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)
    # Memo of routing plans (steps 1-4 of a decision, gtm.plan): derived from this snapshot
    # alone; evolve() hands it on only where it stays true.
    plans: dict[Hashable, Any] = field(init=False, repr=False, compare=False, default_factory=dict)
    # Memo of spillover outcomes per plan (gtm.routing): they read this snapshot's capacity,
    # so unlike plans they never carry over.
    spills: dict[int, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "health", _frozen(self.health))
        object.__setattr__(self, "capacity", _frozen(self.capacity))
        object.__setattr__(self, "weights", _frozen(self.weights))
        object.__setattr__(
            self,
            "versions",
            Versions(
                self.version, self.topology.fingerprint(), self.policy.version, self.geo.build
            ),
        )
        object.__setattr__(
            self,
            "regions",
            _frozen(
                {
                    r.id: RegionView(
                        r.id,
                        r.lat,
                        r.lon,
                        self.weights.get(r.id, r.weight),
                        tuple(str(a) for a in r.ipv4),
                        tuple(str(a) for a in r.ipv6),
                        str(r.base_url).rstrip("/"),
                        unit_vector(r.lat, r.lon),
                    )
                    for r in self.topology.regions
                }
            ),
        )
        object.__setattr__(self, "services", _frozen({s.id: s for s in self.topology.services}))

    def evolve(self, built_at: float, **changes: object) -> Snapshot:
        """A successor with the given fields replaced and the version bumped.

        Memos carry over where they stay true: rankings while the topology is the same, plans
        when only capacity changed and no region's "cannot take work" report did (the routine
        case: every region reports each second or so, and spillover is worked out per query).
        """
        if "topology" in changes or "weights" in changes:
            changes["ranks"] = {}  # rankings of another topology or weights do not carry over
        if "policy" in changes:
            changes["verdicts"] = {}
        successor = dataclasses.replace(
            self,
            version=self.version + 1,
            built_at=built_at,
            **changes,  # type: ignore[arg-type]
        )
        if set(changes) <= {"capacity"} and _refusals(successor.capacity) == _refusals(
            self.capacity
        ):
            object.__setattr__(successor, "plans", self.plans)
        return successor


def _refusals(capacity: Mapping[str, RegionCapacity]) -> dict[str, float]:
    return {r: c.reported_at for r, c in capacity.items() if not c.can_take_work}


class SnapshotStore:
    """Holds the current snapshot. Replacing the reference is the only write (atomic)."""

    def __init__(self, initial: Snapshot) -> None:
        self._current = initial

    @property
    def current(self) -> Snapshot:
        return self._current

    def swap(self, snapshot: Snapshot) -> Snapshot:
        if snapshot.version <= self._current.version:
            raise ValueError(
                f"snapshot {snapshot.version} is not newer than {self._current.version}"
            )
        self._current = snapshot
        return snapshot
