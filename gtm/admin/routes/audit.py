"""The audit log over the API: search with filters and a cursor, streaming export, one decision
by the id a response carried, and its replay under the versions it names."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select

from gtm.admin import versions
from gtm.admin.auth import Ctx, require
from gtm.admin.errors import Conflict, Invalid, LifecycleError, NotFound
from gtm.admin.principals import Principal
from gtm.admin.replay import replay, versions_match
from gtm.audit import query
from gtm.audit.checkpoints import DirectorySink
from gtm.audit.decision_id import DecisionIdError, parse_id
from gtm.audit.schema import document_versions
from gtm.decision.snapshot import Snapshot
from gtm.errors import ConfigError, Problem
from gtm.report.compliance import compliance_report
from gtm.report.html import render
from gtm.runtime import parse_documents

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
    client_network: str | None = None,
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
    after: Annotated[int, Query(ge=0, le=2**53)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page:
    rows, cursor = await query.search(ctx.engine, where, after, limit)
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
    reason, the versions in force."""
    return await _rows(ctx, decision_id)


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
        sink=DirectorySink(ctx.checkpoints or Path("checkpoints")),
        own_documents=[] if ctx.files is None else [ctx.files],
    )
    if format == "html":
        return HTMLResponse(render(report))
    return Response(orjson.dumps(report.to_json()), media_type="application/json")
