"""``gtm explain``: the documents it decides with, and ``--state FILE`` for a what-if.

By default explain and what-if answer with the version in force: the newest signed version in
the shared database that verifies with the configured document keys (``GTM_DOCUMENT_KEYS``), or
this node's own verified copy when the database is behind it (gtm.fleet.local_documents); the
local topology and policy files only when no signed version exists. ``--files`` asks for the
local files. Either way a note (on stderr) says when the files differ from the version in force,
so an answer never contradicts what the nodes serve without saying so.

The what-if state:

    health: {eu-central: down}
    capacity: {eu-west: {utilisation: 0.95, can_take_work: true}}

Every problem is reported at once with its path, as for documents: a capacity given as a bare
number, a state that does not exist, a region the topology does not have (a misspelt name would
otherwise be silently ignored and the what-if would answer a different question).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from gtm.audit.database import make_async_engine
from gtm.decision.bundle import Documents, load_documents, parse_documents
from gtm.decision.documents import read_yaml, validate_document
from gtm.decision.geoip import GeoDatabase, memo_entries
from gtm.decision.snapshot import HealthState, RegionCapacity, RegionHealth, Snapshot, next_capacity
from gtm.errors import ConfigError, Problem
from gtm.fleet.local_documents import InForce, read_accepted, read_in_force
from gtm.fleet.signed_documents import Untrusted, load_public_keys
from gtm.runtime import geoip_path
from gtm.settings import Settings

# The deadline of the one database read explain makes (DESIGN.md rule 10).
READ_DEADLINE_S = 5.0


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


@dataclass(frozen=True, slots=True)
class Chosen:
    """The snapshot explain decides with, where its documents came from, and what to say."""

    snapshot: Snapshot
    source: str  # "files", "database row #N", "local copy PATH"
    sequence: int | None  # the signed version's activation sequence; None: the files
    notes: tuple[str, ...]


def _read_in_force(settings: Settings) -> InForce:
    keys = load_public_keys(settings.document_keys)  # ConfigError: a bad key file, exit 2
    approvals = settings.policy_approvals
    local = settings.document_state_path
    copy = local if local.exists() else None
    url = make_url(settings.database_url)
    if url.drivername.startswith("sqlite") and (
        not url.database or not Path(url.database).exists()
    ):
        # No database here (and explain must not create one): only this node's copy, if any.
        if copy is None:
            return InForce(None, "files", ())
        try:
            accepted = read_accepted(copy, keys, approvals)
        except Untrusted as exc:
            return InForce(None, "files", (f"this node's copy {copy} refused: {exc}",))
        return InForce(accepted, f"local copy {copy}", (f"no database at {url.database}",))
    return asyncio.run(_read_database(settings.database_url, keys, approvals, copy))


async def _read_database(
    url: str, keys: Mapping[str, Ed25519PublicKey], approvals: int, copy: Path | None
) -> InForce:
    engine = make_async_engine(url)
    try:
        async with asyncio.timeout(READ_DEADLINE_S):
            return await read_in_force(engine, keys, approvals, copy)
    finally:
        await engine.dispose()


def _describe(docs: Documents) -> str:
    return f"topology {docs.topology.fingerprint()}, policy {docs.policy.version}"


def choose_snapshot(settings: Settings, now: float, *, files: bool) -> Chosen:
    """The snapshot to explain with: the version in force, or with ``files`` the local files;
    :class:`ConfigError` when the documents chosen are invalid."""
    notes: list[str] = []
    in_force: InForce | None
    try:
        in_force = _read_in_force(settings)
    except (SQLAlchemyError, OSError, TimeoutError) as exc:
        in_force = None
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        notes.append(
            f"WARNING: the version in force could not be read from the database ({error}); "
            "answering from the local files, which may not be what the nodes serve"
        )
    else:
        notes.extend(in_force.notes)
    signed: Documents | None = None
    if in_force is not None and in_force.accepted is not None:
        accepted = in_force.accepted
        try:
            signed = parse_documents(accepted.topology, accepted.policies, in_force.source)
        except ConfigError as exc:
            notes.append(f"the version in force does not load here ({len(exc.problems)} problems)")
    local: Documents | None = None
    if files or signed is None:
        local = load_documents(settings.config, settings.policies)  # ConfigError: exit 2
    else:
        try:
            local = load_documents(settings.config, settings.policies)
        except ConfigError as exc:
            notes.append(f"the local files do not load ({len(exc.problems)} problem(s))")
    if signed is not None and in_force is not None and in_force.accepted is not None:
        sequence = in_force.accepted.sequence
        what = f"the version in force (sequence {sequence}, {in_force.source}: {_describe(signed)})"
        if local is not None and (
            local.topology.fingerprint() != signed.topology.fingerprint()
            or local.policy.version != signed.policy.version
        ):
            if files:
                notes.append(
                    f"--files: answering from the local files ({_describe(local)}), which "
                    f"DIFFER from {what}: the nodes do not answer this way"
                )
            else:
                notes.append(
                    f"answering from {what}; the local files ({_describe(local)}) differ from "
                    "it (--files answers from them)"
                )
    docs = local if files or signed is None else signed
    assert docs is not None  # loaded above whenever there is no signed version
    geo = GeoDatabase(geoip_path(settings), memo_entries(settings.dns_cache_budget_mb))
    snapshot = Snapshot(1, docs.topology, docs.policy, geo, built_at=now)
    if docs is signed and in_force is not None and in_force.accepted is not None:
        return Chosen(snapshot, in_force.source, in_force.accepted.sequence, tuple(notes))
    return Chosen(snapshot, "files", None, tuple(notes))


__all__ = ["Chosen", "WhatIf", "apply_state", "choose_snapshot"]
