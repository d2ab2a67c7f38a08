"""The audit log over the API: search with filters and a cursor, streaming export, one decision
by the id a response carried, and its replay under the versions it names; the evidence status of
every chain (checkpoints inside and outside the database, gaps, cuts, scheduled verification)."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select

from gtm.admin import versions
from gtm.admin.auth import AdminContext, Ctx, require
from gtm.admin.errors import Conflict, Invalid, LifecycleError, NotFound
from gtm.admin.permissions import READS
from gtm.admin.principals import Principal
from gtm.admin.replay import replay, versions_match
from gtm.audit import query
from gtm.audit.checkpoints import Checkpoint, CheckpointSink, DirectorySink
from gtm.audit.decision_id import DecisionIdError, parse_id
from gtm.audit.schema import document_versions
from gtm.audit.status import ChainStatus, Held, SinkIndex, evidence_status
from gtm.audit.watch import VerificationWatch
from gtm.control.log import LogRefused
from gtm.control.state import ControlState
from gtm.decision.bundle import parse_documents
from gtm.decision.snapshot import Snapshot
from gtm.errors import ConfigError, Problem
from gtm.report.compliance import compliance_report
from gtm.report.html import render

router = APIRouter(prefix="/v1")

_LATEST = 1e11  # unix seconds (year 5138): later is no time a row has, and past the database's ints


class Page(BaseModel):
    rows: list[dict[str, Any]]
    next: int | None  # pass as ``after`` for the next page; null: this was the last


class ReplayOut(BaseModel):
    row: str
    matches: bool
    recorded: dict[str, Any]
    replayed: dict[str, Any]
    notes: list[str]


def filters(
    since: Annotated[float | None, Query(ge=0, le=_LATEST, description="unix seconds")] = None,
    until: Annotated[float | None, Query(ge=0, le=_LATEST, description="unix seconds")] = None,
    service: str | None = None,
    name: str | None = None,
    client_network: Annotated[
        str | None,
        Query(
            description="an address or network: rows recorded for it or for any network "
            "holding it (DNS answers for a whole GeoIP network record that network)"
        ),
    ] = None,
    region: str | None = None,
    outcome: str | None = None,
    residency_class: str | None = None,
    rule: str | None = None,
    node: str | None = None,
) -> query.Filters:
    return query.Filters(
        since_us=None if since is None else round(since * 1e6),
        until_us=None if until is None else round(until * 1e6),
        service=service,
        name=name,
        client_network=client_network,
        region=region,
        outcome=outcome,
        residency_class=residency_class,
        rule=rule,
        node=node,
    )


Filtered = Annotated[query.Filters, Depends(filters)]


@router.get("/decisions", operation_id="search_decisions", response_model=Page)
async def search_decisions(
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("search_decisions"))],
    where: Filtered,
    after: Annotated[
        int, Query(ge=0, le=2**53, description="the previous page's next (0: the first page)")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    order: Annotated[
        Literal["oldest", "newest"], Query(description="oldest first (the default) or newest")
    ] = "oldest",
) -> Page:
    """Matching rows a page at a time. ``name`` finds a name with or without its trailing dot
    (DNS rows hold the absolute name, HTTP rows the host)."""
    rows, cursor = await query.search(
        ctx.engine, where, after, limit, newest_first=order == "newest"
    )
    return Page(rows=rows, next=cursor)


@router.get("/decisions/export", operation_id="export_decisions")
async def export_decisions(
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("export_decisions"))],
    where: Filtered,
    format: Literal["jsonl", "csv"] = "jsonl",
) -> StreamingResponse:
    """Every matching row, streamed (JSON lines or CSV): memory stays bounded however many."""

    async def lines() -> AsyncIterator[bytes]:
        header_sent = False
        async for row in query.export_filtered(ctx.engine, where):
            if format == "jsonl":
                yield orjson.dumps(row) + b"\n"
                continue
            out = io.StringIO()
            writer = csv.DictWriter(out, fieldnames=list(row))
            if not header_sent:
                writer.writeheader()
                header_sent = True
            writer.writerow(
                {k: orjson.dumps(v).decode() if isinstance(v, list | dict) else v
                 for k, v in row.items()}
            )  # fmt: skip
            yield out.getvalue().encode()

    media = "application/x-ndjson" if format == "jsonl" else "text/csv"
    return StreamingResponse(lines(), media_type=media)


async def _rows(ctx: Any, decision_id: str) -> list[dict[str, Any]]:
    try:
        parsed = parse_id(decision_id)
        if parsed.at_ms >= 2**43:  # past the year 2248: no row, and past the database's ints
            raise DecisionIdError(f"not a decision id: {decision_id!r} (time out of range)")
    except DecisionIdError as exc:
        raise Invalid(str(exc), [Problem("request", "path.decision_id", str(exc))]) from None
    rows = await query.find_decision(ctx.engine, decision_id)
    if not rows:
        raise NotFound(f"no audit row holds {decision_id} (yet: a node writes about a second on)")
    return rows


@router.get(
    "/decisions/{decision_id}", operation_id="get_decision", response_model=list[dict[str, Any]]
)
async def get_decision(
    decision_id: str, ctx: Ctx, _: Annotated[Principal, Depends(require("get_decision"))]
) -> list[dict[str, Any]]:
    """The audit row(s) behind a response's decision id: inputs, every region's verdict and
    reason, the versions in force, and ``document_version``: the stored document version (the
    id proposals name) whose topology and policy hash to the row's, or null when none does
    (a node's own files before anything was activated)."""
    rows = await _rows(ctx, decision_id)
    async with ctx.engine.connect() as conn:
        for row in rows:
            row["document_version"] = await _document_version(
                conn, row["topology_version"], row["policy_version"]
            )
    return rows


# A stored version's (topology fingerprint, policy version), by version id: a version's content
# never changes (its id is its digest, checked on every read), so what it hashes to is kept.
_HASHES: dict[str, tuple[str, str] | None] = {}
_HASHES_MAX = 4096


async def _document_version(conn: Any, topology_version: str, policy_version: str) -> str | None:
    """The newest stored version whose documents hash to a row's topology and policy versions."""
    stored = (
        await conn.execute(
            select(document_versions.c.id).order_by(document_versions.c.created_at_us.desc())
        )
    ).scalars()
    for version_id in stored:
        if version_id not in _HASHES:
            try:
                version = await versions.get_version(conn, version_id)
                docs = parse_documents(version.topology, version.policies, version_id[:12])
                hashes: tuple[str, str] | None = (docs.topology.fingerprint(), docs.policy.version)
            except (LifecycleError, ConfigError):
                hashes = None
            if len(_HASHES) >= _HASHES_MAX:
                _HASHES.clear()
            _HASHES[version_id] = hashes
        if _HASHES[version_id] == (topology_version, policy_version):
            return str(version_id)
    return None


async def _snapshot_for(ctx: Any, row: dict[str, Any]) -> Snapshot | None:
    """A snapshot of the documents the row names: this node's, or a stored version's."""
    current: Snapshot = ctx.snapshot()
    if versions_match(current, row):
        return current
    async with ctx.engine.connect() as conn:
        stored = (await conn.execute(select(document_versions.c.id))).scalars().all()
        for version_id in stored:
            try:
                version = await versions.get_version(conn, version_id)
                docs = parse_documents(version.topology, version.policies, version_id[:12])
            except (LifecycleError, ConfigError):
                continue
            candidate = current.evolve(ctx.clock(), topology=docs.topology, policy=docs.policy)
            if versions_match(candidate, row):
                return candidate
    # Answered from the node's own files before any version was activated: no stored version
    # holds them, but this node still has them.
    if ctx.files is not None:
        try:
            docs = parse_documents(ctx.files[0], ctx.files[1], "this node's files")
        except ConfigError:
            return None
        candidate = current.evolve(ctx.clock(), topology=docs.topology, policy=docs.policy)
        if versions_match(candidate, row):
            return candidate
    return None


@router.post(
    "/decisions/{decision_id}/replay",
    operation_id="replay_decision",
    response_model=list[ReplayOut],
)
async def replay_decision(
    decision_id: str, ctx: Ctx, _: Annotated[Principal, Depends(require("replay_decision"))]
) -> list[ReplayOut]:
    """Decide each row's recorded inputs again under the versions it names, and say whether the
    outcome, the region and every region's verdict come out the same."""
    if ctx.snapshot is None:
        raise Conflict("this admin service has no snapshot to replay on")
    out = []
    for row in await _rows(ctx, decision_id):
        snapshot = await _snapshot_for(ctx, row)
        if snapshot is None:
            raise Conflict(
                f"the documents of topology {row['topology_version']} and policy "
                f"{row['policy_version']} are neither in force here nor stored"
            )
        r = replay(row, snapshot, ctx.clock())
        out.append(
            ReplayOut(
                row=r.row,
                matches=r.matches,
                recorded=r.recorded,
                replayed=r.replayed,
                notes=list(r.notes),
            )
        )
    return out


async def _verified_control(ctx: AdminContext) -> ControlState | None:
    """The verified control log's fold, or None when it is refused (the report says so)."""
    try:
        await ctx.control.refresh(ctx.engine)
        return None if ctx.control.refusal is not None else ctx.control.good
    except LogRefused:
        return None


@router.get(
    "/reports/compliance",
    operation_id="compliance_report",
    responses={200: {"content": {"application/json": {}, "text/html": {}}}},
)
async def compliance(
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("compliance_report"))],
    since: Annotated[float, Query(alias="from", ge=0, le=_LATEST, description="unix seconds")],
    until: Annotated[float, Query(alias="to", ge=0, le=_LATEST, description="unix seconds")],
    format: Literal["json", "html"] = "json",
) -> Response:
    """The compliance report of a window (``gtm report compliance``): answers outside the
    allowed regions recomputed from the recorded inputs, approvals, operator actions, gaps and
    the chains verified against the checkpoints outside the database."""
    if until <= since:
        raise Invalid(
            "to must be after from", [Problem("request", "query.to", "must be after from")]
        )
    report = await compliance_report(
        ctx.engine,
        round(since * 1e6),
        round(until * 1e6),
        sink=_sink(ctx),
        own_documents=[] if ctx.files is None else [ctx.files],
        control=await _verified_control(ctx),
        reads=READS,
    )
    if format == "html":
        return HTMLResponse(render(report))
    return Response(orjson.dumps(report.to_json()), media_type="application/json")


class CheckpointOut(BaseModel):
    kind: Literal["open", "checkpoint", "gap", "cut"]
    seq: int  # the chain's rows up to this sequence are vouched for
    head: str  # the hash of row ``seq``
    answers: int  # answers counted through row ``seq`` (the event chain: 0)
    at: float  # unix seconds, when it was signed
    key_id: str  # the Ed25519 key that signed it (the sink's keys/<key_id>.pub)
    detail: str
    in_sink: bool  # held by the sink outside the database, signature verified
    in_database: bool  # held by audit_checkpoints (a copy; the sink is what is trusted)
    location: str | None  # the sink's file:line


class VerifiedOut(BaseModel):
    """The newest checkpoint of the chain the scheduled verification matched row by row."""

    seq: int
    at: float


class ChainOut(BaseModel):
    chain: str  # a node's id; a worker's is NODE/wN; the fleet's event chain: region_events
    node: str | None  # null: the fleet's event chain
    kind: Literal["decisions", "events"]
    last_checkpoint: CheckpointOut | None
    checkpoints_in_sink: int
    database_seq: int | None  # the newest row's sequence in the database (null: no row)
    unanchored_rows: int  # rows after the last checkpoint (a running node signs every ~10 s)
    gaps: list[CheckpointOut]  # unclean stops: answers counted and lost before a restart
    cuts: list[CheckpointOut]  # retention: the chain's rows through seq were removed on purpose
    verified: VerifiedOut | None  # by this admin node's scheduled verification
    warnings: list[str]


class SinkProblemOut(BaseModel):
    location: str  # file:line, or the file
    problem: str


class SinkOut(BaseModel):
    location: str
    checkpoints: int  # trusted checkpoint lines of this store
    keys: int  # public keys published
    problems: list[SinkProblemOut]  # lines that do not parse or verify (the first 100)
    problem_count: int


class BreakOut(BaseModel):
    chain: str
    seq: int
    problem: str


class PassOut(BaseModel):
    started_at: float
    finished_at: float
    ok: bool  # ran, and every chain verified
    rows: int  # decision rows read (a pass reads only what came after the previous one)
    chains: int
    breaks: list[BreakOut]  # the first 100
    break_count: int
    gaps: int
    cuts: int
    unanchored: int
    full: bool  # read every chain from its start, not from where the last pass ended
    error: str | None  # the pass could not run (the database away, the sink unreadable)


class VerificationOut(BaseModel):
    node: str  # the admin node whose scheduled verification this is (each keeps its own)
    scheduled: bool  # false: GTM_AUDIT_VERIFY_INTERVAL_S=0 on this node
    interval_s: float | None
    passes: int
    failures: int  # passes that found a break
    verified_through: float | None  # gtm_audit_verified_through_seconds
    full_every_s: float | None  # a pass from every chain's start this often (0: every pass)
    full_at: float | None  # when the last such pass that found no break began
    last_pass: PassOut | None  # null until the first pass ends (it starts with the node)


class ChainsOut(BaseModel):
    store: str | None  # the audit store's id (made by the migration)
    sink: SinkOut
    chains: list[ChainOut]
    verification: VerificationOut


def _checkpoint(held: Held) -> CheckpointOut:
    cp = held.checkpoint
    return CheckpointOut(
        kind=cp.kind, seq=cp.seq, head=cp.head, answers=cp.answers, at=cp.at, key_id=cp.key,
        detail=cp.detail, in_sink=held.in_sink, in_database=held.in_database,
        location=held.location,
    )  # fmt: skip


def _verification(node: str, watch: VerificationWatch | None) -> VerificationOut:
    if watch is None:
        return VerificationOut(
            node=node, scheduled=False, interval_s=None, passes=0, failures=0,
            verified_through=None, full_every_s=None, full_at=None, last_pass=None,
        )  # fmt: skip
    last = watch.last_pass
    return VerificationOut(
        node=node,
        scheduled=True,
        interval_s=watch.interval_s,
        passes=watch.passes,
        failures=watch.failures,
        verified_through=watch.verified_through,
        full_every_s=watch.full_every_s,
        full_at=watch.full_at,
        last_pass=None
        if last is None
        else PassOut(
            started_at=last.started_at, finished_at=last.finished_at, ok=last.ok,
            rows=last.rows, chains=last.chains, full=last.full,
            breaks=[BreakOut(chain=b.node, seq=b.node_seq, problem=b.problem)
                    for b in last.breaks],
            break_count=last.break_count, gaps=last.gaps, cuts=last.cuts,
            unanchored=last.unanchored, error=last.error,
        ),
    )  # fmt: skip


def _sink(ctx: AdminContext) -> CheckpointSink:
    if ctx.checkpoint_sink is not None:
        return ctx.checkpoint_sink
    return DirectorySink(ctx.checkpoints or Path("checkpoints"))


def _sink_index(request: Request, sink: CheckpointSink) -> SinkIndex:
    """One index per admin app, kept between requests: each reads only the sink's new lines."""
    index: SinkIndex | None = getattr(request.app.state, "audit_sink_index", None)
    if index is None or index.sink.location != sink.location:
        index = SinkIndex(sink)
        request.app.state.audit_sink_index = index
    return index


def _chain(c: ChainStatus, verified: Checkpoint | None) -> ChainOut:
    last = c.last_checkpoint
    return ChainOut(
        chain=c.chain,
        node=c.node,
        kind=c.kind,
        last_checkpoint=None if last is None else _checkpoint(last),
        checkpoints_in_sink=c.checkpoints_in_sink,
        database_seq=c.database_seq,
        unanchored_rows=c.unanchored_rows,
        gaps=[_checkpoint(g) for g in c.gaps],
        cuts=[_checkpoint(k) for k in c.cuts],
        verified=None if verified is None else VerifiedOut(seq=verified.seq, at=verified.at),
        warnings=c.warnings,
    )


@router.get("/audit/chains", operation_id="list_audit_chains", response_model=ChainsOut)
async def list_audit_chains(
    request: Request,
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("list_audit_chains"))],
) -> ChainsOut:
    """The evidence of every chain: its newest signed checkpoint (sequence, time, answers
    counted, signing key) and whether the sink outside the database holds it, its gaps
    (unclean stops) and retention cuts, rows not yet checkpointed, and the latest scheduled
    verification of this admin node. Reads no row but each chain's newest: cheap to poll."""
    index = _sink_index(request, _sink(ctx))
    status = await evidence_status(ctx.engine, index)
    watch: VerificationWatch | None = getattr(request.app.state, "audit_watch", None)
    starts: dict[str, Checkpoint] = {} if watch is None else dict(watch.starts)
    problems = [SinkProblemOut(location=p.location, problem=p.problem) for p in status.problems]
    return ChainsOut(
        store=status.store,
        sink=SinkOut(
            location=str(status.sink),
            checkpoints=status.sink_checkpoints,
            keys=status.sink_keys,
            problems=problems,
            problem_count=status.problem_count,
        ),
        chains=[_chain(c, starts.get(c.chain)) for c in status.chains],
        verification=_verification(ctx.node, watch),
    )
