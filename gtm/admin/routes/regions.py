"""Regions: their state as this node holds it, and operator controls guarded by safety rules.

A control that would break a safety rule of the topology (:mod:`gtm.fleet.safety`) is refused
with 409 and every rule it breaks; ``override_safety`` makes it anyway, only for a principal
that also holds ``admin``, and the override is an event of its own with the rules it broke.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from gtm.admin import events
from gtm.admin.auth import AdminContext, Ctx, Forbidden, require
from gtm.admin.errors import Conflict, Invalid, NotFound
from gtm.admin.permissions import Role
from gtm.admin.principals import Principal
from gtm.audit import traffic
from gtm.errors import Problem
from gtm.fleet import operator, roster, safety, shared_state
from gtm.fleet.operator import parse_duration
from gtm.fleet.region_state import Force, Override

router = APIRouter(prefix="/v1")


class RegionOut(BaseModel):
    region: str
    state: str = Field(description="as this node answers with it")
    detail: str
    override: str | None
    override_by: str | None
    out_of_service: bool
    nodes: dict[str, str] = Field(description="node -> state as that live node holds it")
    name: str
    jurisdiction: str
    lat: float
    lon: float
    utilisation: float | None = Field(description="the last fresh capacity report; null: none")
    headroom: float | None = Field(description="to the high watermark; null: no fresh report")
    spilling: bool
    report_age_s: float | None
    prefix_cache_hit_rate: float | None = Field(
        description="prompt tokens found in the region's prefix caches over those looked up, "
        "last minute (fresh report); null: no report, or no instance says"
    )
    kv_free_fraction: float | None = Field(
        description="share of the region's KV cache no running request holds; null: unknown"
    )
    kv_free_blocks: int | None = Field(description="KV blocks free in the region; null: unknown")
    admitted: float = Field(description="share of its clients a readmitted region takes back")


class FlowOut(BaseModel):
    country: str | None = Field(description="ISO 3166-1 alpha-2; null: not located")
    region: str | None = Field(description="null: nothing was answered")
    outcome: str
    per_s: float


class TrafficOut(BaseModel):
    window_s: float
    at: float
    answers: int
    flows: list[FlowOut]


class NodeOut(BaseModel):
    node: str = Field(description="the process's node id (the member's, when it never reported)")
    observer: str = Field(description="the member it belongs to (its observer id)")
    member: bool = Field(description="in the configured membership")
    status: str = Field(description="live, silent, fenced or never reported (gtm.fleet.roster)")
    last_report: float | None = Field(description="unix seconds; null: never reported")
    age_s: float | None
    fenced_since: float | None = Field(description="since when it surely fails closed")
    document_sequence: int | None
    snapshot_version: int | None
    topology_version: str | None
    policy_version: str | None


class Change(BaseModel):
    reason: str = Field(min_length=1)
    override_safety: bool = Field(
        default=False, description="make it although it breaks a safety rule (admins only)"
    )


class Timed(Change):
    for_: str | None = Field(default=None, alias="for", description="lapses after: 90s, 2h, 1d")


class WeightIn(Timed):
    weight: float | None = Field(ge=0, description="0: no traffic; null: back to the default")


class ForceIn(Change):
    state: Literal["up", "down", "none"] = Field(description="none ends a forced state")
    for_: str | None = Field(
        default=None, alias="for", description="a forced state always lapses: 90s, 2h, 1d"
    )


class Changed(BaseModel):
    region: str
    override: str | None
    broke_safety_rules: list[str] = []


def _seconds(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise Invalid(str(exc), [Problem("request", "body.for", str(exc))]) from None


@router.get("/regions", operation_id="list_regions", response_model=list[RegionOut])
async def list_regions(
    ctx: Ctx, _: Annotated[Principal, Depends(require("list_regions"))]
) -> list[RegionOut]:
    """Each region's state as this node answers with it, and the operator's override."""
    if ctx.snapshot is None:
        raise Conflict("this admin service has no snapshot")
    snapshot, now = ctx.snapshot(), ctx.clock()
    state = await ctx.control.refresh(ctx.engine)
    overrides = {o.region: o for o in operator.overrides_of(state)}
    entries = await fleet_roster(ctx, now)
    out = safety.out_of_service(snapshot, overrides, now)
    rows = []
    spill = snapshot.topology.routing.spillover
    described = {r.id: r for r in snapshot.topology.regions}
    for region, view in snapshot.regions.items():
        health = snapshot.health.get(region)
        held = overrides.get(region)
        override = held.effective(now) if held is not None else None
        capacity = snapshot.capacity.get(region)
        age = None if capacity is None else now - capacity.reported_at
        fresh = capacity if age is not None and age <= spill.stale_after_s else None
        rows.append(
            RegionOut(
                region=region,
                name=described[region].name,
                jurisdiction=described[region].jurisdiction,
                lat=view.lat,
                lon=view.lon,
                utilisation=None if fresh is None else round(fresh.utilisation, 4),
                headroom=(
                    None
                    if fresh is None
                    else round(max(0.0, spill.high_watermark - fresh.utilisation), 4)
                ),
                spilling=fresh is not None and fresh.spilling,
                report_age_s=None if age is None else round(age, 3),
                prefix_cache_hit_rate=(
                    None
                    if fresh is None or fresh.prefix_cache_hit_rate is None
                    else round(fresh.prefix_cache_hit_rate, 4)
                ),
                kv_free_fraction=(
                    None
                    if fresh is None or fresh.kv_free_fraction is None
                    else round(fresh.kv_free_fraction, 4)
                ),
                kv_free_blocks=None if fresh is None else fresh.kv_free_blocks,
                admitted=health.admitted if health is not None else 1.0,
                state=health.state.value if health is not None else "unknown",
                detail=health.detail if health is not None else "",
                override=override.describe() if override else None,
                override_by=f"{override.actor}: {override.reason}" if override else None,
                out_of_service=region in out,
                nodes=roster.held_by(entries, region),
            )
        )
    return rows


@router.get("/traffic", operation_id="get_traffic", response_model=TrafficOut)
async def get_traffic(
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("get_traffic"))],
    window_s: Annotated[float, Query(ge=1, le=3600)] = 10.0,
) -> TrafficOut:
    """Answers per second over the last ``window_s`` from each client country to each region,
    summed over every node writing to the audit store (no client networks: countries only)."""
    now = ctx.clock()
    found = await traffic.flows(ctx.engine, round((now - window_s) * 1e6))
    return TrafficOut(
        window_s=window_s,
        at=now,
        answers=sum(f.answers for f in found),
        flows=[
            FlowOut(
                country=f.country,
                region=f.region,
                outcome=f.outcome,
                per_s=round(f.answers / window_s, 3),
            )
            for f in sorted(found, key=lambda f: -f.answers)
        ],
    )


@router.get("/nodes", operation_id="list_nodes", response_model=list[NodeOut])
async def list_nodes(
    ctx: Ctx, _: Annotated[Principal, Depends(require("list_nodes"))]
) -> list[NodeOut]:
    """Every configured member with its last report, silent ones included, and any other node
    reporting live; what each has in force (with no membership configured: the live nodes)."""
    now = ctx.clock()
    rows = []
    for e in await fleet_roster(ctx, now):
        reports = e.reports or (None,)
        for n in reports:
            rows.append(
                NodeOut(
                    node=e.member if n is None else n.node,
                    observer=e.member,
                    member=e.configured,
                    status=e.state,
                    last_report=None if n is None else n.at,
                    age_s=None if n is None else round(now - n.at, 3),
                    fenced_since=e.fenced_since,
                    document_sequence=None if n is None else n.document_sequence,
                    snapshot_version=None if n is None else n.snapshot_version,
                    topology_version=None if n is None else n.topology_version,
                    policy_version=None if n is None else n.policy_version,
                )
            )
    return rows


async def fleet_roster(ctx: AdminContext, now: float) -> list[roster.Entry]:
    """Every configured member and every live node, as of ``now`` (gtm.fleet.roster)."""
    _, members = ctx.membership()
    reports = await shared_state.read_node_status(ctx.engine, 0.0)
    bounds = roster.Bounds(ctx.live_within_s, ctx.fence_after_s, ctx.fence_slack_s)
    return roster.roster(members, reports, now, bounds)


async def _change(
    ctx: AdminContext, principal: Principal, region: str, body: Change, **change: Any
) -> Changed:
    if ctx.snapshot is None:
        raise Conflict("this admin service has no snapshot")
    snapshot = ctx.snapshot()
    if region not in snapshot.regions:
        raise NotFound(f"no region {region!r}")
    now = ctx.clock()
    broke: list[str] = []

    def guard(before: Mapping[str, Override], after: Mapping[str, Override]) -> list[str]:
        broke.extend(safety.check(snapshot, before, after, now))
        if broke and not body.override_safety:
            raise Conflict(
                "refused by the safety rules: " + "; ".join(broke),
                [Problem("safety", region, rule) for rule in broke],
            )
        if broke and Role.ADMIN not in principal.roles:
            raise Forbidden("only an admin may override the safety rules")
        return list(broke)

    try:
        result = await operator.amend(
            ctx.engine, region, control=ctx.control, by=principal.id, actor=principal.name,
            reason=body.reason, now=now, guard=guard, **change,
        )  # fmt: skip
    except ValueError as exc:
        raise Invalid(str(exc), [Problem("request", "body", str(exc))]) from None
    except (Forbidden, Conflict, operator.OverrideRefused) as exc:
        # Every refusal is evidence: a denied event with what was asked and why it was not.
        why = exc.message if isinstance(exc, Forbidden | Conflict) else str(exc)
        async with ctx.engine.begin() as conn:
            await events.record(
                conn, "denied", f"{region}: {why}", actor=principal.name, now=now,
                node=ctx.node, reason=body.reason,
            )  # fmt: skip
        if isinstance(exc, operator.OverrideRefused):
            raise Forbidden(str(exc)) from None
        if isinstance(exc, Conflict):
            exc.recorded = True
        raise
    if broke:
        async with ctx.engine.begin() as conn:
            await events.record(
                conn,
                "safety",
                f"{region}: safety rules overridden: {'; '.join(broke)}",
                actor=principal.name,
                now=now,
                node=ctx.node,
                reason=body.reason,
            )
    return Changed(
        region=region,
        override=result.describe() if result else None,
        broke_safety_rules=broke,
    )


@router.post("/regions/{region}/drain", operation_id="drain_region", response_model=Changed)
async def drain_region(
    region: str,
    body: Timed,
    ctx: Ctx,
    principal: Annotated[Principal, Depends(require("drain_region"))],
) -> Changed:
    """No new clients for REGION (answers move at the nodes' next sync)."""
    return await _change(
        ctx, principal, region, body, drain=True, expires_for_s=_seconds(body.for_)
    )


@router.post("/regions/{region}/undrain", operation_id="undrain_region", response_model=Changed)
async def undrain_region(
    region: str,
    body: Change,
    ctx: Ctx,
    principal: Annotated[Principal, Depends(require("undrain_region"))],
) -> Changed:
    return await _change(ctx, principal, region, body, drain=False)


@router.post("/regions/{region}/weight", operation_id="weight_region", response_model=Changed)
async def weight_region(
    region: str,
    body: WeightIn,
    ctx: Ctx,
    principal: Annotated[Principal, Depends(require("weight_region"))],
) -> Changed:
    return await _change(
        ctx, principal, region, body, weight=body.weight, expires_for_s=_seconds(body.for_)
    )


@router.post("/regions/{region}/force", operation_id="force_region", response_model=Changed)
async def force_region(
    region: str,
    body: ForceIn,
    ctx: Ctx,
    principal: Annotated[Principal, Depends(require("force_region"))],
) -> Changed:
    forced = None if body.state == "none" else Force(body.state)
    return await _change(
        ctx, principal, region, body, force=forced, force_for_s=_seconds(body.for_)
    )


@router.post("/regions/{region}/clear", operation_id="clear_region", response_model=Changed)
async def clear_region(
    region: str,
    body: Change,
    ctx: Ctx,
    principal: Annotated[Principal, Depends(require("clear_region"))],
) -> Changed:
    """Drop every part of REGION's override."""
    return await _change(ctx, principal, region, body, drain=False, weight=None, force=None)


__all__ = ["router"]
