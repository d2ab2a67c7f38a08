"""``gtm explain --state FILE``: region health and capacity for a what-if, validated.

    health: {eu-central: down}
    capacity: {eu-west: {utilisation: 0.95, can_take_work: true}}

Every problem is reported at once with its path, as for documents: a capacity given as a bare
number, a state that does not exist, a region the topology does not have (a misspelt name would
otherwise be silently ignored and the what-if would answer a different question).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from gtm.decision.documents import read_yaml, validate_document
from gtm.decision.snapshot import HealthState, RegionCapacity, RegionHealth, Snapshot, next_capacity
from gtm.errors import ConfigError, Problem


class _Capacity(BaseModel):
    model_config = ConfigDict(extra="forbid")
    utilisation: float = Field(ge=0, allow_inf_nan=False)
    can_take_work: bool = True


class WhatIf(BaseModel):
    model_config = ConfigDict(extra="forbid")
    health: dict[str, HealthState] = Field(default_factory=dict)
    capacity: dict[str, _Capacity] = Field(default_factory=dict)


def apply_state(snapshot: Snapshot, state_file: Path, now: float) -> Snapshot:
    """``snapshot`` with the file's health and capacity; :class:`ConfigError` with every
    problem."""
    source = str(state_file)
    data = read_yaml(state_file)
    known = set(snapshot.regions)
    problems = [
        Problem(source, f"{section}.{region}", f"no region {region!r} in the topology")
        for section in ("health", "capacity")
        if isinstance(data, dict) and isinstance(data.get(section), dict)
        for region in data[section]
        if region not in known
    ]
    try:
        state = validate_document(WhatIf, {} if data is None else data, source)
    except ConfigError as exc:
        raise ConfigError(exc.problems + problems) from None
    if problems:
        raise ConfigError(problems)
    health = {r: RegionHealth(s, now) for r, s in state.health.items()}
    spill = snapshot.topology.routing.spillover
    capacity: dict[str, RegionCapacity] = {
        r: next_capacity(None, c.utilisation, now, c.can_take_work, spill)
        for r, c in state.capacity.items()
    }
    return snapshot.evolve(now, health=health, capacity=capacity)


__all__ = ["WhatIf", "apply_state"]
