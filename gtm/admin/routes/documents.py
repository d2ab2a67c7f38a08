"""Document versions and proposals: draft, propose, approve (four-eyes), activate, diff."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query
from pydantic import BaseModel, Field
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.admin import impact, lifecycle, versions
from gtm.admin.auth import AdminContext, Ctx, require
from gtm.admin.errors import Conflict, Invalid, LifecycleError, NotFound, Refused
from gtm.admin.leaks import record_acknowledged, refuse_unacknowledged
from gtm.admin.lifecycle import Proposal
from gtm.admin.principals import Principal
from gtm.admin.routes.regions import fleet_roster
from gtm.audit import query
from gtm.control.state import APPROVED
from gtm.decision.bundle import parse_documents
from gtm.errors import ConfigError
from gtm.fleet import roster

router = APIRouter(prefix="/v1")

# Bounded: a larger number is no proposal and must be a 422, not a database overflow.
ProposalId = Annotated[int, Path(ge=1, le=2**53)]


class DocumentsIn(BaseModel):
    topology: str = Field(description="the topology document, YAML text")
    policies: dict[str, str] = Field(description="policy file name -> YAML text")


class NewProposal(DocumentsIn):
    reason: str = Field(min_length=1, description="why: recorded with every step")


class ActivateIn(BaseModel):
    at: float | None = Field(
        default=None, ge=0, le=1e11, description="unix seconds; later than now: scheduled"
    )
    acknowledge: str = Field(
        default="",
        max_length=2000,
        description="when the version would send answers out of their jurisdiction (replayed "
        "over the last day, as the impact's leaks), every leak named, ';'-separated, as "
        "'<class> <from>→<to>' ('->' also accepted), e.g. 'eu-personal EU→US'; without it the "
        "activation is refused (409 leak_not_acknowledged, the leaks and their counts in "
        "problems). The leaks and counts are recorded in the event log with the activation",
    )


class ApprovalIn(BaseModel):
    version: str = Field(description="the version id the approver reviewed")
    comment: str = ""


class ApprovalOut(BaseModel):
    approver: str
    version: str
    at: float
    comment: str


class ProposalOut(BaseModel):
    id: int
    version: str
    state: str
    author: str
    reason: str
    base_version: str | None
    required_approvals: int
    approvals: list[ApprovalOut]
    created_at: float
    updated_at: float
    activated_at: float | None
    sequence: int | None
    activate_at: float | None


class VersionOut(BaseModel):
    id: str
    topology: str
    policies: dict[str, str]
    created_at: float
    created_by: str


class FileDiffOut(BaseModel):
    file: str
    status: str
    diff: str


class ImpactIn(BaseModel):
    since_s: float = Field(default=86400.0, gt=0, le=7 * 86400, description="replay window")


class ChangeOut(BaseModel):
    example: str
    name: str
    client_network: str
    residency_classes: list[str]
    tenant: str | None
    answers: int
    before: str
    after: str
    left_jurisdiction: bool


class LeakOut(BaseModel):
    residency_class: str
    from_jurisdiction: str
    to_jurisdiction: str
    answers: int


class ImpactOut(BaseModel):
    proposal: int
    version: str
    since: float
    until: float
    inputs: int
    answers: int
    moved: int
    newly_refused: int
    newly_answered: int
    left_jurisdiction: int
    by_service: dict[str, dict[str, int]]
    by_class: dict[str, dict[str, int]]
    by_move: dict[str, int]
    examples: list[ChangeOut]
    leaks: list[LeakOut] = Field(
        default_factory=list,
        description="answers that would leave their jurisdiction, by class and jurisdictions",
    )
    seconds: float


class RolloutOut(BaseModel):
    proposal: int
    sequence: int | None
    membership: str = Field(description="what the rollout counts over (gtm.fleet.roster)")
    complete: bool = Field(
        description="every configured member (and any other live node) acknowledged this "
        "activation or a later one"
    )
    acknowledged: list[str]
    pending: dict[str, int | None] = Field(
        description="member -> the sequence it last reported in force: not acknowledged, "
        "and not surely fenced"
    )
    fenced: dict[str, float] = Field(
        description="member -> since when (unix s) it has surely fenced itself: silent past "
        "the fence bound, so failing restricted traffic closed; not acknowledged either"
    )
    silent: dict[str, float | None] = Field(
        description="member -> its last report (null: never): pending members not reporting"
    )


class DiffOut(BaseModel):
    proposal: int
    version: str
    active_version: str | None
    files: list[FileDiffOut]


def _out(p: Proposal) -> ProposalOut:
    return ProposalOut(
        id=p.id,
        version=p.version,
        state=p.state,
        author=p.author,
        reason=p.reason,
        base_version=p.base_version,
        required_approvals=p.required_approvals,
        approvals=[ApprovalOut(**asdict(a)) for a in p.approvals],
        created_at=p.created_at,
        updated_at=p.updated_at,
        activated_at=p.activated_at,
        sequence=p.sequence,
        activate_at=p.activate_at,
    )


async def _keeping_refusal(
    ctx: AdminContext,
    step: Callable[[AsyncConnection], Awaitable[Proposal]],
    refusal: type[LifecycleError],
) -> Proposal:
    """Run ``step`` in a transaction; when it is refused (``refusal``), commit what it recorded
    (the ``denied`` event) and raise the refusal after the commit: a refused attempt is evidence,
    the change it asked for is not made."""
    refused: LifecycleError | None = None
    async with ctx.engine.begin() as conn:
        try:
            return await step(conn)
        except refusal as exc:
            refused = exc
    raise refused


@router.get("/versions/active", operation_id="get_active_version", response_model=VersionOut)
async def get_active_version(
    ctx: Ctx, _: Annotated[Principal, Depends(require("get_active_version"))]
) -> VersionOut:
    async with ctx.engine.connect() as conn:
        active = await versions.active_version(conn, ctx.control)
        if active is None:
            raise NotFound("no version has been activated: nodes use their configured files")
        v = await versions.get_version(conn, active)
    return VersionOut(
        id=v.id,
        topology=v.topology,
        policies=dict(v.policies),
        created_at=v.created_at,
        created_by=v.created_by,
    )


class CurrentOut(DocumentsIn):
    source: Literal["version", "files"] = Field(
        description="version: the active version; files: none activated yet, this node's files"
    )
    version: str | None


@router.get("/documents/current", operation_id="get_current_documents", response_model=CurrentOut)
async def get_current_documents(
    ctx: Ctx, _: Annotated[Principal, Depends(require("get_current_documents"))]
) -> CurrentOut:
    """What a new proposal starts from: the active version's documents, or, before the first
    activation, the files this node answers from (what the first proposal is diffed against)."""
    async with ctx.engine.connect() as conn:
        active = await versions.active_version(conn, ctx.control)
        if active is not None:
            v = await versions.get_version(conn, active)
            return CurrentOut(
                source="version", version=v.id, topology=v.topology, policies=dict(v.policies)
            )
    if ctx.files is None:
        raise NotFound("no version has been activated and this node has no files to start from")
    topology, policies = ctx.files
    return CurrentOut(source="files", version=None, topology=topology, policies=dict(policies))


@router.get("/versions/{version_id}", operation_id="get_version", response_model=VersionOut)
async def get_version(
    version_id: str, ctx: Ctx, _: Annotated[Principal, Depends(require("get_version"))]
) -> VersionOut:
    async with ctx.engine.connect() as conn:
        v = await versions.get_version(conn, version_id)
    return VersionOut(
        id=v.id,
        topology=v.topology,
        policies=dict(v.policies),
        created_at=v.created_at,
        created_by=v.created_by,
    )


@router.get("/proposals", operation_id="list_proposals", response_model=list[ProposalOut])
async def list_proposals(
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("list_proposals"))],
    state: Annotated[str | None, Query()] = None,
) -> list[ProposalOut]:
    async with ctx.engine.connect() as conn:
        return [_out(p) for p in await lifecycle.list_all(conn, ctx.control, state)]


@router.post(
    "/proposals", operation_id="create_proposal", response_model=ProposalOut, status_code=201
)
async def create_proposal(
    body: NewProposal,
    ctx: Ctx,
    author: Annotated[Principal, Depends(require("create_proposal"))],
) -> ProposalOut:
    async with ctx.engine.begin() as conn:
        proposal = await lifecycle.create(
            conn,
            author,
            body.topology,
            body.policies,
            body.reason,
            required_approvals=ctx.required_approvals,
            now=ctx.clock(),
            node=ctx.node,
            control=ctx.control,
        )
    return _out(proposal)


@router.get("/proposals/{proposal_id}", operation_id="get_proposal", response_model=ProposalOut)
async def get_proposal(
    proposal_id: ProposalId, ctx: Ctx, _: Annotated[Principal, Depends(require("get_proposal"))]
) -> ProposalOut:
    async with ctx.engine.connect() as conn:
        return _out(await lifecycle.get(conn, proposal_id, ctx.control))


@router.put("/proposals/{proposal_id}", operation_id="update_proposal", response_model=ProposalOut)
async def update_proposal(
    proposal_id: ProposalId,
    body: DocumentsIn,
    ctx: Ctx,
    author: Annotated[Principal, Depends(require("update_proposal"))],
) -> ProposalOut:
    async def step(conn: AsyncConnection) -> Proposal:
        return await lifecycle.update_content(
            conn, proposal_id, author, body.topology, body.policies,
            now=ctx.clock(), node=ctx.node, control=ctx.control,
        )  # fmt: skip

    return _out(await _keeping_refusal(ctx, step, Refused))


@router.get(
    "/proposals/{proposal_id}/diff", operation_id="get_proposal_diff", response_model=DiffOut
)
async def get_proposal_diff(
    proposal_id: ProposalId,
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("get_proposal_diff"))],
) -> DiffOut:
    async with ctx.engine.connect() as conn:
        proposal = await lifecycle.get(conn, proposal_id, ctx.control)
        active, files = await versions.proposal_diff(conn, proposal_id, ctx.control, ctx.files)
    return DiffOut(
        proposal=proposal_id,
        version=proposal.version,
        active_version=active,
        files=[FileDiffOut(file=f.file, status=f.status, diff=f.diff) for f in files],
    )


@router.post(
    "/proposals/{proposal_id}/submit", operation_id="submit_proposal", response_model=ProposalOut
)
async def submit_proposal(
    proposal_id: ProposalId,
    ctx: Ctx,
    author: Annotated[Principal, Depends(require("submit_proposal"))],
) -> ProposalOut:
    async def step(conn: AsyncConnection) -> Proposal:
        return await lifecycle.submit(
            conn, proposal_id, author, now=ctx.clock(), node=ctx.node, control=ctx.control,
            files=ctx.files,
        )  # fmt: skip

    return _out(await _keeping_refusal(ctx, step, Refused))


@router.post(
    "/proposals/{proposal_id}/withdraw",
    operation_id="withdraw_proposal",
    response_model=ProposalOut,
)
async def withdraw_proposal(
    proposal_id: ProposalId,
    ctx: Ctx,
    author: Annotated[Principal, Depends(require("withdraw_proposal"))],
) -> ProposalOut:
    async def step(conn: AsyncConnection) -> Proposal:
        return await lifecycle.withdraw(
            conn, proposal_id, author, now=ctx.clock(), node=ctx.node, control=ctx.control
        )

    return _out(await _keeping_refusal(ctx, step, Refused))


@router.post(
    "/proposals/{proposal_id}/approve", operation_id="approve_proposal", response_model=ProposalOut
)
async def approve_proposal(
    proposal_id: ProposalId,
    body: ApprovalIn,
    ctx: Ctx,
    approver: Annotated[Principal, Depends(require("approve_proposal"))],
) -> ProposalOut:
    async def step(conn: AsyncConnection) -> Proposal:
        return await lifecycle.approve(
            conn,
            proposal_id,
            approver,
            body.version,
            body.comment,
            now=ctx.clock(),
            node=ctx.node,
            control=ctx.control,
        )

    return _out(await _keeping_refusal(ctx, step, Refused))


@router.post(
    "/proposals/{proposal_id}/activate",
    operation_id="activate_proposal",
    response_model=ProposalOut,
)
async def activate_proposal(
    proposal_id: ProposalId,
    ctx: Ctx,
    approver: Annotated[Principal, Depends(require("activate_proposal"))],
    body: ActivateIn | None = None,
) -> ProposalOut:
    """Sign and publish an approved proposal now, or, with a future ``at``, schedule it: an
    admin node with the signing key activates it then, once, with every check made then.

    A version whose replay shows answers leaving their jurisdiction is activated (or
    scheduled) only with each leak named in ``acknowledge`` (409 ``leak_not_acknowledged``
    otherwise); the leaks and their counts are recorded with it."""
    async with ctx.engine.connect() as conn:
        current = await lifecycle.get(conn, proposal_id, ctx.control)
    leaks: Counter[impact.Leak] = Counter()
    if current.state == APPROVED:
        # Only a proposal that may be activated is replayed (a day's traffic, seconds of CPU):
        # any other gets the lifecycle's own refusal below, not a leak to acknowledge first.
        *_, report = await _replay(ctx, proposal_id, impact.LEAK_WINDOW_S)
        leaks = report.leaks
    refuse_unacknowledged(leaks, body.acknowledge if body is not None else "")
    if body is not None and body.at is not None and body.at > ctx.clock():
        async with ctx.engine.begin() as conn:
            scheduled = await lifecycle.schedule(
                conn, proposal_id, approver, body.at, now=ctx.clock(), node=ctx.node,
                control=ctx.control,
            )  # fmt: skip
            await record_acknowledged(conn, proposal_id, approver, leaks, ctx)
        return _out(scheduled)
    if ctx.signer is None:
        raise Conflict(
            "this node has no document signing key (GTM_DOCUMENT_SIGNING_KEY): it cannot "
            "activate; use a node that has one"
        )
    signer = ctx.signer

    async def step(conn: AsyncConnection) -> Proposal:
        activated = await lifecycle.activate(
            conn,
            proposal_id,
            approver,
            signer,
            now=ctx.clock(),
            node=ctx.node,
            control=ctx.control,
            min_approvals=ctx.required_approvals,
        )
        await record_acknowledged(conn, proposal_id, approver, leaks, ctx)
        return activated

    try:
        return _out(await _keeping_refusal(ctx, step, Conflict))
    except IntegrityError:
        # Two activations at once took the same sequence number: one of them lost.
        raise Conflict("another activation happened at the same time; try again") from None


async def _replay(
    ctx: AdminContext, proposal_id: int, since_s: float
) -> tuple[Proposal, float, float, impact.Impact]:
    """The proposal's impact over the last ``since_s``: (proposal, since, until, impact)."""
    if ctx.snapshot is None:
        raise Conflict("this admin service has no snapshot to replay against")
    until = ctx.clock()
    since = until - since_s
    async with ctx.engine.connect() as conn:
        proposal = await lifecycle.get(conn, proposal_id, ctx.control)
        version = await versions.get_version(conn, proposal.version)
    inputs = await query.decision_inputs(ctx.engine, round(since * 1e6))
    before = ctx.snapshot()
    try:
        docs = parse_documents(version.topology, version.policies, f"version {version.id[:12]}")
    except ConfigError as exc:  # stored before a change of the schema, say
        raise Invalid("the proposal's documents no longer validate", exc.problems) from None
    after = before.evolve(until, topology=docs.topology, policy=docs.policy)
    # A replay of a day's traffic takes seconds of CPU: off the event loop, which the node's
    # answering listeners share (DESIGN.md rule 3).
    report = await asyncio.to_thread(impact.analyse, inputs, before, after, until)
    return proposal, since, until, report


@router.post(
    "/proposals/{proposal_id}/impact",
    operation_id="get_proposal_impact",
    response_model=ImpactOut,
)
async def get_proposal_impact(
    proposal_id: ProposalId,
    body: ImpactIn,
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("get_proposal_impact"))],
) -> ImpactOut:
    """Replay the last ``since_s`` of recorded traffic under the proposal and under what is in
    force on this node: which answers would move, fail closed, or leave their jurisdiction."""
    started = time.perf_counter()
    proposal, since, until, report = await _replay(ctx, proposal_id, body.since_s)
    return ImpactOut(
        proposal=proposal_id,
        version=proposal.version,
        since=since,
        until=until,
        inputs=report.inputs,
        answers=report.answers,
        moved=report.moved,
        newly_refused=report.newly_refused,
        newly_answered=report.newly_answered,
        left_jurisdiction=report.left_jurisdiction,
        by_service={k: dict(v) for k, v in report.by_service.items()},
        by_class={k: dict(v) for k, v in report.by_class.items()},
        by_move=dict(report.by_move),
        examples=[ChangeOut(**asdict(c)) for c in report.examples],
        leaks=[
            LeakOut(residency_class=c, from_jurisdiction=f, to_jurisdiction=t, answers=n)
            for (c, f, t), n in report.leaks.most_common()
        ],
        seconds=time.perf_counter() - started,
    )


@router.get(
    "/proposals/{proposal_id}/rollout",
    operation_id="get_proposal_rollout",
    response_model=RolloutOut,
)
async def get_proposal_rollout(
    proposal_id: ProposalId,
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("get_proposal_rollout"))],
) -> RolloutOut:
    """Whether the activation is in force on every configured member: which acknowledged it,
    which are pending (silent ones said so) and which are surely fenced, since when."""
    async with ctx.engine.connect() as conn:
        proposal = await lifecycle.get(conn, proposal_id, ctx.control)
    source, members = ctx.membership()
    entries = await fleet_roster(ctx, ctx.clock())
    reached = roster.rollout(entries, proposal.sequence)
    return RolloutOut(
        proposal=proposal_id,
        sequence=proposal.sequence,
        membership=(
            f"{len(members)} members ({source})"
            if members
            else "no membership configured: the nodes reporting live"
        ),
        complete=reached.complete,
        acknowledged=reached.acknowledged,
        pending=reached.pending,
        fenced=reached.fenced,
        silent={
            e.member: e.last_report
            for e in entries
            if e.member in reached.pending and e.state != roster.LIVE
        },
    )
