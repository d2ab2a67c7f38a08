"""The fleet's shared region state in the database: observations, overrides, events, documents.

Every GTM node of a deployment uses the same database (SQLite for one node, PostgreSQL for
several). Nodes write their own health observations and region events here and read their
peers' observations, the operators' overrides and the newest published documents on each sync
(:mod:`gtm.fleet.state_sync`); the CLI writes overrides and documents. Times are stored as unix
microseconds, like the audit log.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import RowMapping, Select, Text, cast, delete, desc, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm.audit import event_chain as keyed_events
from gtm.audit.database import upsert
from gtm.audit.event_chain import chain_events, verify_events
from gtm.audit.keys import ChainKey
from gtm.audit.record import ChainBreak
from gtm.audit.schema import (
    documents,
    event_chain,
    health_observations,
    node_status,
    region_events,
    region_overrides,
)
from gtm.decision.snapshot import HealthState
from gtm.fleet.observation_seal import MAX_DETAIL, REFUSALS, micros
from gtm.fleet.region_state import Observation, Override, RegionEvent


def _us(t: float) -> int:
    return int(t * 1_000_000)


def _s(us: int | None) -> float | None:
    return None if us is None else us / 1_000_000


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


async def write_observations(engine: AsyncEngine, observations: Iterable[Observation]) -> None:
    """This node's observations, as its key sealed them (gtm.fleet.observation_seal): stored
    exactly as signed, so a reader's check covers every column."""
    rows = [
        {
            "node": o.node,
            "region": o.region,
            "state": o.state.value,
            "since_us": micros(o.since),
            "observed_at_us": micros(o.observed_at),
            "detail": o.detail[:MAX_DETAIL],
            "key_id": o.key_id or None,
            "signature": o.signature or None,
        }
        for o in observations
    ]
    if not rows:
        return
    stmt = upsert(engine, health_observations)
    stmt = stmt.on_conflict_do_update(
        index_elements=["node", "region"],
        set_={
            c: stmt.excluded[c]
            for c in ("state", "since_us", "observed_at_us", "detail", "key_id", "signature")
        },
    )
    async with engine.begin() as conn:
        await conn.execute(stmt, rows)


async def read_observations(engine: AsyncEngine, newer_than: float) -> list[Observation]:
    """Every node's observations since ``newer_than``, as the rows say: untrusted until a
    :class:`~gtm.fleet.observation_seal.ObservationGate` admits them. A row that is not even an
    observation (an unknown state, a time that is not a number) is refused here, counted, and
    the rest is returned."""
    query = select(health_observations).where(
        health_observations.c.observed_at_us >= _us(newer_than)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    found = []
    for r in rows:
        try:
            found.append(
                Observation(
                    str(r["node"]),
                    str(r["region"]),
                    HealthState(r["state"]),
                    int(r["since_us"]) / 1e6,
                    int(r["observed_at_us"]) / 1e6,
                    str(r["detail"]),
                    str(r["signature"] or ""),
                    str(r["key_id"] or ""),
                )
            )
        except (TypeError, ValueError, OverflowError):
            REFUSALS.refuse("malformed", r["node"], r["region"])
    return found


async def append_events(
    engine: AsyncEngine, events: Iterable[RegionEvent], key: ChainKey | None = None
) -> None:
    """Chain and sign ``events`` (with ``key``, else this process's audit key:
    :func:`gtm.audit.event_chain.signing_key`)."""
    rows = [_event_row(e) for e in events]
    if rows:
        async with engine.begin() as conn:
            await _append(conn, rows, key)


async def _append(
    conn: AsyncConnection, rows: list[dict[str, Any]], key: ChainKey | None = None
) -> None:
    """Chain ``rows`` onto the fleet's region events, inside the caller's transaction, each
    signed by the writer's key. The head's update comes first: it locks the head until commit,
    so concurrent appenders (nodes, workers, operators' CLI) queue here and never fork the
    chain. The head read here is only where to append: what this writer's anchor signs is the
    head it wrote, noted at commit (the database's head is not evidence)."""
    key = key or keyed_events.signing_key()
    head = (
        await conn.execute(
            update(event_chain)
            .where(event_chain.c.id == 1)
            .values(seq=event_chain.c.seq)
            .returning(event_chain.c.seq, event_chain.c.last_hash)
        )
    ).one()
    if key is not None:
        keyed_events.went_back(key.id, head.seq)
    seq, last = chain_events(rows, head.seq, head.last_hash, key)
    await conn.execute(insert(region_events), rows)
    await conn.execute(
        update(event_chain).where(event_chain.c.id == 1).values(seq=seq, last_hash=last)
    )
    if key is None:
        # Still written (the change it records must not fail for want of a key), but verify
        # reports it as unsigned: evidence nobody can vouch for is a break, not evidence.
        keyed_events.warn_unsigned(seq)
    else:
        keyed_events.remember_on_commit(conn, key.id, seq, last)


async def read_event_chain(
    engine: AsyncEngine, keys: keyed_events.PublicKeys | None = None
) -> tuple[int, list[ChainBreak]]:
    """Check the region events' chain against itself (and each row's signature with ``keys``,
    the sink's published keys); returns (events checked, breaks). Against the checkpoints
    outside the database: :func:`gtm.audit.verify.verify`."""
    async with engine.connect() as conn:
        result = await conn.execute(select(region_events).order_by(region_events.c.seq))
        rows = [dict(r._mapping) for r in result]
        head = (await conn.execute(select(event_chain.c.seq, event_chain.c.last_hash))).first()
    chained = [r for r in rows if r["seq"] is not None]
    return len(chained), verify_events(chained, None if head is None else (head[0], head[1]), keys)


def _event_row(e: RegionEvent) -> dict[str, Any]:
    return {
        "at_us": _us(e.at),
        "node": e.node,
        "region": e.region,
        "kind": e.kind,
        "state": e.state,
        "previous": e.previous,
        "detail": e.detail,
        "actor": e.actor,
        "reason": e.reason,
    }


async def read_events(
    engine: AsyncEngine, region: str | None = None, limit: int = 50
) -> list[RegionEvent]:
    """The newest events, newest first."""
    query = (
        select(region_events)
        .order_by(desc(region_events.c.at_us), desc(region_events.c.id))
        .limit(limit)
    )
    if region is not None:
        query = query.where(region_events.c.region == region)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    return [
        RegionEvent(
            r["at_us"] / 1e6,
            r["node"],
            r["region"],
            r["kind"],
            r["state"],
            r["previous"],
            r["detail"],
            r["actor"],
            r["reason"],
        )
        for r in rows
    ]


async def put_override(engine: AsyncEngine, override: Override, node: str) -> None:
    """Replace a region's cached override row and record who did it and why, in one transaction
    (the override itself is the control log's entry: gtm.fleet.operator)."""
    async with engine.begin() as conn:
        await put_override_in(conn, override, node)


async def put_override_in(conn: AsyncConnection, override: Override, node: str) -> None:
    await conn.execute(delete(region_overrides).where(region_overrides.c.region == override.region))
    await conn.execute(
        insert(region_overrides),
        {
            "region": override.region,
            "drain": override.drain,
            "weight": override.weight,
            "force": override.force.value if override.force else None,
            "force_until_us": None if override.force_until is None else _us(override.force_until),
            "expires_at_us": None if override.expires_at is None else _us(override.expires_at),
            "actor": override.actor,
            "reason": override.reason,
            "set_at_us": _us(override.set_at),
        },
    )
    until = ""
    if override.force_until is not None:
        until += f"; force until {_iso(override.force_until)}"
    if override.expires_at is not None:
        until += f"; drain/weight until {_iso(override.expires_at)}"
    await _event(
        conn,
        RegionEvent(
            override.set_at,
            node,
            override.region,
            "override",
            None,
            None,
            f"set: {override.describe()}{until}",
            override.actor,
            override.reason,
        ),
    )


async def clear_override_in(
    conn: AsyncConnection, region: str, actor: str, reason: str, node: str, now: float
) -> bool:
    await conn.execute(delete(region_overrides).where(region_overrides.c.region == region))
    await _event(
        conn, RegionEvent(now, node, region, "override", None, None, "cleared", actor, reason)
    )
    return True


async def _event(conn: AsyncConnection, event: RegionEvent, key: ChainKey | None = None) -> None:
    await _append(conn, [_event_row(event)], key)


async def record_event(
    conn: AsyncConnection, event: RegionEvent, key: ChainKey | None = None
) -> None:
    """Chain and sign one event in the caller's transaction: it lands with the change it
    records, or not at all (the admin service's actions)."""
    await _event(conn, event, key)


@dataclass(frozen=True, slots=True)
class Published:
    id: int
    fingerprint: str
    topology: str  # YAML text
    policies: Mapping[str, str]  # file name -> YAML text
    actor: str
    reason: str
    published_at: float
    manifest: str | None = None  # the signed approval record (gtm.fleet.signed_documents)
    signature: str | None = None


async def publish(
    conn: AsyncConnection,
    topology: str,
    policies: Mapping[str, str],
    fingerprint: str,
    actor: str,
    reason: str,
    now: float,
    *,
    manifest: bytes,
    signature: str,
) -> int:
    """Publish a signed version to every node, in the caller's transaction (the admin service
    activates a proposal and publishes it in one)."""
    record = orjson.loads(manifest)
    result = await conn.execute(
        insert(documents).returning(documents.c.id),
        {
            "published_at_us": _us(now),
            "topology": topology,
            "policies": dict(policies),
            "fingerprint": fingerprint,
            "actor": actor,
            "reason": reason,
            "version_id": record["version"],
            "sequence": record["sequence"],
            "manifest": manifest.decode(),
            "signature": signature,
        },
    )
    return int(result.scalar_one())


async def newest_document_id(engine: AsyncEngine) -> int | None:
    """Cheap: polled on every sync; the full row is read only when this moves."""
    async with engine.connect() as conn:
        return (
            await conn.execute(select(documents.c.id).order_by(desc(documents.c.id)).limit(1))
        ).scalar_one_or_none()


async def read_published(engine: AsyncEngine, document_id: int) -> Published | None:
    async with engine.connect() as conn:
        row = (
            (await conn.execute(_document_rows().where(documents.c.id == document_id)))
            .mappings()
            .first()
        )
    return None if row is None else _published(row)


def _document_rows() -> Select[Any]:
    """The documents' columns, ``policies`` as its text: a value the JSON column cannot decode
    (SQLite stores whatever it is given) is handed to the verification, which refuses it with
    its reason, instead of failing the whole read."""
    columns = [c for c in documents.c if c.name != "policies"]
    return select(*columns, cast(documents.c.policies, Text).label("policies"))


async def read_published_after(
    engine: AsyncEngine, after_id: int | None, limit: int = 100
) -> list[Published]:
    """Rows published after ``after_id`` (all when None), highest claimed sequence first, at
    most ``limit``: rows copied in bulk cannot push the newest activation out of view (the
    claim is only an order; each row's signed record is what is checked). Every field is as the
    database holds it, untrusted: a malformed row is still returned, for the reader to refuse
    with its reason, and never stops the others from being read."""
    query = (
        _document_rows()
        .order_by(desc(documents.c.sequence).nulls_last(), desc(documents.c.id))
        .limit(limit)
    )
    if after_id is not None:
        query = query.where(documents.c.id > after_id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    return [_published(row) for row in rows]


def _published(row: RowMapping) -> Published:
    """A row as the database holds it. Nothing is checked here but nothing raises either: the
    content, the record and the signature are verified before anything comes into force
    (:func:`gtm.fleet.signed_documents.verify`), which refuses a ``policies`` that is not a
    mapping, a topology that is not text, a record that is not one."""
    policies: Any = row["policies"]
    if isinstance(policies, str):  # read as text (_document_rows)
        with contextlib.suppress(orjson.JSONDecodeError):  # else left as text: malformed
            policies = orjson.loads(policies)
    try:
        published_at = float(row["published_at_us"]) / 1e6
    except (TypeError, ValueError, OverflowError):
        published_at = 0.0
    return Published(
        row["id"],
        row["fingerprint"],
        row["topology"],
        policies,
        row["actor"],
        row["reason"],
        published_at,
        row["manifest"],
        row["signature"],
    )


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What one node has in force, as it last reported it."""

    node: str
    observer: str
    at: float
    document_sequence: int | None
    snapshot_version: int
    topology_version: str
    policy_version: str
    regions: Mapping[str, str]  # region -> state in force
    # Its audit spool (None: not reported): the newest decision row sealed, and the newest the
    # database is known to hold. Rows after ``audit_drained`` up to ``audit_sealed`` are
    # still only on the node's disk (gtm.audit.verify tells them from rows that are gone).
    audit_sealed: int | None = None
    audit_drained: int | None = None


async def write_node_status(engine: AsyncEngine, status: NodeStatus) -> None:
    row = {
        "node": status.node,
        "observer": status.observer,
        "updated_at_us": _us(status.at),
        "document_sequence": status.document_sequence,
        "snapshot_version": status.snapshot_version,
        "topology_version": status.topology_version,
        "policy_version": status.policy_version,
        "regions": dict(status.regions),
        "audit_sealed_seq": status.audit_sealed,
        "audit_drained_seq": status.audit_drained,
    }
    stmt = upsert(engine, node_status)
    stmt = stmt.on_conflict_do_update(
        index_elements=["node"], set_={c: stmt.excluded[c] for c in row if c != "node"}
    )
    async with engine.begin() as conn:
        await conn.execute(stmt, row)


async def read_node_status(engine: AsyncEngine, newer_than: float) -> list[NodeStatus]:
    """The nodes that reported since ``newer_than``: the live ones."""
    query = (
        select(node_status)
        .where(node_status.c.updated_at_us >= _us(newer_than))
        .order_by(node_status.c.node)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [
        NodeStatus(
            r.node,
            r.observer,
            r.updated_at_us / 1e6,
            r.document_sequence,
            r.snapshot_version,
            r.topology_version,
            r.policy_version,
            r.regions,
            r.audit_sealed_seq,
            r.audit_drained_seq,
        )
        for r in rows
    ]
