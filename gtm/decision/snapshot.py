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

from gtm.decision.geoip import GeoDatabase
from gtm.decision.geometry import UnitVector, unit_vector
from gtm.decision.policy import PolicySet
from gtm.decision.topology import Service, Spillover, Topology


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
    # rest stay where failover sent them (gtm.fleet.region_state, gtm.decision.routing).
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
    # Prefix caching in the region, as its report said (shown to operators; no decision reads
    # them): prompt tokens found cached over those looked up, and the KV cache left free.
    prefix_cache_hit_rate: float | None = None
    kv_free_fraction: float | None = None
    kv_free_blocks: int | None = None


def next_capacity(
    previous: RegionCapacity | None,
    utilisation: float,
    reported_at: float,
    can_take_work: bool,
    watermarks: Spillover,
    cache: tuple[float | None, float | None, int | None] = (None, None, None),
) -> RegionCapacity:
    """Fold one report into the region's capacity state (pure; used by capacity intake)."""
    was_spilling = previous.spilling if previous is not None else False
    if utilisation >= watermarks.high_watermark:
        spilling = True
    elif utilisation <= watermarks.low_watermark:
        spilling = False
    else:
        spilling = was_spilling
    return RegionCapacity(utilisation, reported_at, spilling, can_take_work, *cache)


@dataclass(frozen=True, slots=True)
class Versions:
    """What a decision was made from; recorded with it so it can be explained and replayed.

    ``snapshot`` is the snapshot's decision epoch (:attr:`Snapshot.epoch`): successors that
    only fold in capacity reports which change no decision keep it, so that identical
    decisions share one audit row and cached answers stay true across them.
    """

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
    # Set while the node is cut off from the fleet for longer than its bound (gtm.runtime): what
    # restricted traffic gets then, "fail_closed" or "short_ttl"; None: not fenced.
    fence: str | None = None
    built_at: float = 0.0
    # The version of the first snapshot of the run of successors that make the same decision
    # for every request at every instant (see evolve); its own version when unset.
    epoch: int = -1
    versions: Versions = field(init=False)
    regions: Mapping[str, RegionView] = field(init=False, repr=False)
    services: Mapping[str, Service] = field(init=False, repr=False)
    # Memo of rankings (gtm.decision.plan): they depend on the topology and the client's location
    # only, so successors that keep the topology share it across health and capacity swaps.
    ranks: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)
    # Memo of policy verdicts (gtm.decision.plan), shared by successors that keep the policy.
    verdicts: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)
    # Memo of routing plans (steps 1-4 of a decision, gtm.decision.plan): derived from this snapshot
    # alone; evolve() hands it on only where it stays true.
    plans: dict[Hashable, Any] = field(init=False, repr=False, compare=False, default_factory=dict)
    # Memo of spillover outcomes per plan (gtm.decision.routing): they read this snapshot's
    # capacity, so unlike plans they never carry over.
    spills: dict[int, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.epoch < 0:
            object.__setattr__(self, "epoch", self.version)
        object.__setattr__(self, "health", _frozen(self.health))
        object.__setattr__(self, "capacity", _frozen(self.capacity))
        object.__setattr__(self, "weights", _frozen(self.weights))
        object.__setattr__(
            self,
            "versions",
            Versions(self.epoch, self.topology.fingerprint(), self.policy.version, self.geo.build),
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

        The decision epoch carries over when only capacity changed in ways no decision reads
        (:func:`capacity_inputs`) and nothing of this snapshot's turned stale since it was
        built: then every decision this snapshot made still holds in the successor, and the
        answering paths keep the answers they cached (a healthy region's routine report only
        moves a utilisation figure below its high watermark, which nothing reads).
        """
        if "topology" in changes or "weights" in changes:
            changes["ranks"] = {}  # rankings of another topology or weights do not carry over
        if "policy" in changes:
            changes["verdicts"] = {}
        same_decisions = set(changes) <= {"capacity"} and self._same_decisions(
            changes.get("capacity", self.capacity),  # type: ignore[arg-type]
            built_at,
        )
        successor = dataclasses.replace(
            self,
            version=self.version + 1,
            built_at=built_at,
            epoch=self.epoch if same_decisions else self.version + 1,
            **changes,  # type: ignore[arg-type]
        )
        if set(changes) <= {"capacity"} and _refusals(successor.capacity) == _refusals(
            self.capacity
        ):
            object.__setattr__(successor, "plans", self.plans)
        return successor

    def _same_decisions(self, capacity: Mapping[str, RegionCapacity], at: float) -> bool:
        spill = self.topology.routing.spillover
        stale_after = spill.stale_after_s
        if any(self.built_at <= c.reported_at + stale_after < at for c in self.capacity.values()):
            return False  # one of ours turned stale since we were built: our decisions changed
        return capacity_inputs(self.capacity, spill, at) == capacity_inputs(capacity, spill, at)


def capacity_inputs(
    capacity: Mapping[str, RegionCapacity], spill: Spillover, at: float
) -> dict[str, tuple[bool, bool, bool, float | None]]:
    """What decisions at ``at`` read of the capacity reports (gtm.decision.plan,
    gtm.decision.routing): per region with a fresh report, whether it can take work, whether it is
    spilling, whether it is below the high watermark (a spill target's check), and its utilisation
    only while spilling (the spill share). Stale reports are ignored like absent ones."""
    return {
        region: (
            c.can_take_work,
            c.spilling,
            c.utilisation < spill.high_watermark,
            c.utilisation if c.spilling else None,
        )
        for region, c in capacity.items()
        if at <= c.reported_at + spill.stale_after_s
    }


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
