"""Principals, API tokens, who is asking, and the event log."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response
from fastapi import Path as FastPath
from pydantic import BaseModel, Field

from gtm.admin import events, principals
from gtm.admin.auth import Ctx, Forbidden, require
from gtm.admin.errors import Conflict, Invalid, NotFound
from gtm.admin.permissions import Role
from gtm.admin.principals import Principal
from gtm.errors import Problem
from gtm.fleet import shared_state
from gtm.fleet.operator import parse_duration

router = APIRouter(prefix="/v1")


class PrincipalOut(BaseModel):
    id: str
    name: str
    roles: list[Role]
    disabled: bool = False
    oidc_subject: str | None = None
    pending_grants: list[int] = Field(
        default_factory=list,
        description="grants of power roles waiting for a second admin's approval",
    )


class NewPrincipal(BaseModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")
    roles: list[Role] = Field(min_length=1)
    oidc_subject: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description="the identity provider's `sub` whose access tokens act as this principal",
    )


class NewTokenIn(BaseModel):
    expires_in: str | None = Field(default=None, description="90d, 12h, 30m; none: no expiry")


class TokenOut(BaseModel):
    id: str
    principal: str
    token: str = Field(description="shown once; only its hash is kept")
    expires_at: float | None


class TokenInfoOut(BaseModel):
    id: str
    principal: str
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    last_used_at: float | None


class EventOut(BaseModel):
    at: float
    node: str
    region: str
    kind: str
    state: str | None
    previous: str | None
    detail: str
    actor: str | None
    reason: str | None


def _out(p: Principal) -> PrincipalOut:
    return PrincipalOut(
        id=p.id,
        name=p.name,
        roles=sorted(p.roles),
        disabled=p.disabled,
        oidc_subject=p.oidc_subject,
    )


@router.get("/whoami", operation_id="whoami", response_model=PrincipalOut)
async def whoami(principal: Annotated[Principal, Depends(require("whoami"))]) -> PrincipalOut:
    return _out(principal)


@router.get("/principals", operation_id="list_principals", response_model=list[PrincipalOut])
async def list_principals(
    ctx: Ctx, _: Annotated[Principal, Depends(require("list_principals"))]
) -> list[PrincipalOut]:
    async with ctx.engine.connect() as conn:
        return [_out(p) for p in await principals.list_all(conn, ctx.control)]


@router.post(
    "/principals", operation_id="create_principal", response_model=PrincipalOut, status_code=201
)
async def create_principal(
    body: NewPrincipal,
    ctx: Ctx,
    admin: Annotated[Principal, Depends(require("create_principal"))],
) -> PrincipalOut:
    async with ctx.engine.begin() as conn:
        try:
            created = await principals.create(
                conn,
                body.name,
                body.roles,
                created_by=admin.name,
                now=ctx.clock(),
                node=ctx.node,
                control=ctx.control,
                oidc_subject=body.oidc_subject,
                by=admin,
            )
        except principals.NameTaken:
            raise Conflict(f"a principal named {body.name!r} exists") from None
        except principals.SubjectTaken:
            raise Conflict(f"OIDC subject {body.oidc_subject!r} is bound already") from None
        pending = [
            g.id
            for g in await principals.list_grants(conn, ctx.control)
            if g.principal == created.name and g.state == "pending"
        ]
    out = _out(created)
    out.pending_grants = pending
    return out


@router.post(
    "/principals/{name}/tokens",
    operation_id="create_token",
    response_model=TokenOut,
    status_code=201,
)
async def create_token(
    name: str,
    body: NewTokenIn,
    ctx: Ctx,
    admin: Annotated[Principal, Depends(require("create_token"))],
) -> TokenOut:
    now = ctx.clock()
    try:
        expires = None if body.expires_in is None else now + parse_duration(body.expires_in)
    except ValueError as exc:
        raise Invalid(str(exc), [Problem("request", "body.expires_in", str(exc))]) from None
    async with ctx.engine.connect() as conn:
        principal = await principals.by_name(conn, name, ctx.control)
    if principal is None:
        raise NotFound(f"no principal named {name!r}")
    if principal.id != admin.id:
        # Nobody mints a token for someone else: a token is issued to its own principal (here,
        # at OIDC sign-in, or by the key file's holder with `gtm token create`).
        async with ctx.engine.begin() as conn:
            await events.record(
                conn, "denied", f"create_token: for {name}, not themself", actor=admin.name,
                now=now, node=ctx.node,
            )  # fmt: skip
        raise Forbidden(f"{admin.name} may not create a token for {name}: only for themself")
    async with ctx.engine.begin() as conn:
        token = await principals.issue_token(
            conn,
            principal,
            created_by=admin.name,
            now=now,
            expires_at=expires,
            node=ctx.node,
            control=ctx.control,
            by=admin,
        )
    return TokenOut(id=token.id, principal=name, token=token.text, expires_at=expires)


@router.get("/tokens", operation_id="list_tokens", response_model=list[TokenInfoOut])
async def list_tokens(
    ctx: Ctx, _: Annotated[Principal, Depends(require("list_tokens"))]
) -> list[TokenInfoOut]:
    async with ctx.engine.connect() as conn:
        return [TokenInfoOut(**asdict(t)) for t in await principals.list_tokens(conn, ctx.control)]


@router.delete("/tokens/{token_id}", operation_id="revoke_token", status_code=204)
async def revoke_token(
    token_id: str, ctx: Ctx, admin: Annotated[Principal, Depends(require("revoke_token"))]
) -> Response:
    async with ctx.engine.begin() as conn:
        if not await principals.revoke(
            conn, token_id, actor=admin.name, now=ctx.clock(), node=ctx.node,
            control=ctx.control, by=admin,
        ):  # fmt: skip
            raise NotFound(f"no live token {token_id}")
    return Response(status_code=204)


class GrantIn(BaseModel):
    add: list[Role] = Field(default_factory=list)
    remove: list[Role] = Field(default_factory=list)


class GrantOut(BaseModel):
    id: int
    principal: str
    add: list[str]
    remove: list[str]
    proposed_by: str
    state: str = Field(description="pending (a second admin must approve it) or granted")
    approved_by: str | None


@router.get("/grants", operation_id="list_grants", response_model=list[GrantOut])
async def list_grants(
    ctx: Ctx, _: Annotated[Principal, Depends(require("list_grants"))]
) -> list[GrantOut]:
    async with ctx.engine.connect() as conn:
        return [GrantOut(**asdict(g)) for g in await principals.list_grants(conn, ctx.control)]


@router.post(
    "/principals/{name}/grants", operation_id="propose_grant", response_model=GrantOut,
    status_code=201,
)  # fmt: skip
async def propose_grant(
    name: str,
    body: GrantIn,
    ctx: Ctx,
    admin: Annotated[Principal, Depends(require("propose_grant"))],
) -> GrantOut:
    """Change a principal's roles. Author, approver and admin are power: the grant waits until
    a second admin (not its proposer, not its subject) approves it."""
    if not body.add and not body.remove:
        raise Invalid("a grant changes at least one role", [])
    now = ctx.clock()
    async with ctx.engine.begin() as conn:
        who = await principals.by_name(conn, name, ctx.control)
        if who is None:
            raise NotFound(f"no principal named {name!r}")
        try:
            grant = await principals.propose_grant(
                conn,
                who.id,
                add=[r.value for r in body.add],
                remove=[r.value for r in body.remove],
                by=admin,
                now=now,
                node=ctx.node,
                control=ctx.control,
            )
        except principals.GrantRefused as exc:
            raise Conflict(str(exc)) from None
    return GrantOut(**asdict(grant))


@router.post("/grants/{grant_id}/approve", operation_id="approve_grant", response_model=GrantOut)
async def approve_grant(
    grant_id: Annotated[int, FastPath(ge=1, le=2**53)],
    ctx: Ctx,
    admin: Annotated[Principal, Depends(require("approve_grant"))],
) -> GrantOut:
    now = ctx.clock()
    refused: str | None = None
    async with ctx.engine.begin() as conn:
        try:
            return GrantOut(
                **asdict(
                    await principals.approve_grant(
                        conn, grant_id, by=admin, now=now, node=ctx.node, control=ctx.control
                    )
                )
            )
        except principals.GrantRefused as exc:
            refused = str(exc)
            await events.record(
                conn, "denied", f"approve_grant: #{grant_id}: {refused}", actor=admin.name,
                now=now, node=ctx.node,
            )  # fmt: skip
    if refused.startswith("no grant"):
        raise NotFound(refused)
    raise Forbidden(refused)


@router.get("/events", operation_id="list_events", response_model=list[EventOut])
async def list_events(
    ctx: Ctx,
    _: Annotated[Principal, Depends(require("list_events"))],
    region: Annotated[str | None, Query(description="'-' for admin actions")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[EventOut]:
    rows = await shared_state.read_events(ctx.engine, region, limit)
    return [EventOut(**asdict(e)) for e in rows]
