"""Principals, their roles and their API tokens, as the signed control log says.

A principal is a name with roles; it authenticates with an API token (:mod:`gtm.admin.tokens`)
that has an expiry, can be revoked, and records when it was last used. Every change is an entry
of the control log (:mod:`gtm.control`): who holds which role and which token is live is the
fold of verified entries, so a row written, edited or put back in the ``principals`` or
``api_tokens`` tables (caches) authenticates no one and grants nothing. Power is four-eyes too:
author, approver and admin roles are granted by one admin and approved by another
(:func:`propose_grant`, :func:`approve_grant`); a token is issued only to its own principal, or
by the holder of the key file at the command line (``bootstrap``). Every change is also an event
in the chained event log, in the same transaction (:func:`gtm.admin.events.record`).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm.admin import events
from gtm.admin.permissions import Role
from gtm.admin.tokens import NewToken, new_token, parse_token, secret_matches
from gtm.audit.schema import api_tokens, principals
from gtm.control.entry import BOOTSTRAP
from gtm.control.log import ControlLog
from gtm.control.state import POWER, ControlState, GrantRec, PrincipalRec, Refusal

# A token's last-used time is written at most this often (not a write per request).
_LAST_USED_RESOLUTION_US = 60 * 1_000_000


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    name: str
    roles: frozenset[Role]
    disabled: bool = False
    token_id: str | None = None  # the API token this request authenticated with
    oidc_subject: str | None = None  # the identity provider's subject bound to it, if any


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: str
    principal: str
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    last_used_at: float | None


@dataclass(frozen=True, slots=True)
class Grant:
    id: int
    principal: str
    add: list[str]
    remove: list[str]
    proposed_by: str
    state: str
    approved_by: str | None


class NameTaken(Exception):
    pass


class SubjectTaken(Exception):
    pass


class GrantRefused(Exception):
    """A grant step the log's rules refuse (four-eyes over power), with why."""


def _us(t: float) -> int:
    return round(t * 1e6)


def _principal(rec: PrincipalRec) -> Principal:
    known = {r.value for r in Role}
    return Principal(
        rec.id,
        rec.name,
        frozenset(Role(r) for r in rec.roles if r in known),
        rec.disabled,
        oidc_subject=rec.oidc_subject,
    )


def _grant(state: ControlState, g: GrantRec) -> Grant:
    return Grant(
        g.id,
        state.name_of(g.principal_id),
        sorted(g.add),
        sorted(g.remove),
        state.name_of(g.proposer_id),
        g.state,
        None if g.approver_id is None else state.name_of(g.approver_id),
    )


def _by(actor: Principal | None) -> str:
    """The control log's principal for an action: the actor's id, or the key file's holder."""
    return BOOTSTRAP if actor is None else actor.id


async def _cache_principal(conn: AsyncConnection, rec: PrincipalRec) -> None:
    """The principal's row as the fold has it (update, else insert: the admin's database role
    may not delete principals)."""
    row = {
        "name": rec.name,
        "roles": sorted(rec.roles),
        "created_at_us": rec.created_at_us,
        "created_by": rec.created_by,
        "disabled": rec.disabled,
        "oidc_subject": rec.oidc_subject,
    }
    done = await conn.execute(update(principals).where(principals.c.id == rec.id).values(**row))
    if not done.rowcount:
        await conn.execute(insert(principals), {"id": rec.id, **row})


async def create(
    conn: AsyncConnection,
    name: str,
    roles: Iterable[Role],
    *,
    created_by: str,
    now: float,
    node: str,
    control: ControlLog,
    oidc_subject: str | None = None,
    by: Principal | None = None,
) -> Principal:
    """A new principal. ``by``: the admin who asks (None: the key file's holder, who may give
    any roles at once). An admin gives the roles that grant no power now; author, approver and
    admin become a pending grant (:func:`pending_grant_for`) that another admin approves."""
    wanted = frozenset(r.value for r in roles)
    now_roles = wanted if by is None else wanted - POWER
    state = await control.state(conn)
    if state.principal_named(name) is not None:
        raise NameTaken(name)
    if oidc_subject is not None and any(
        p.oidc_subject == oidc_subject for p in state.principals.values()
    ):
        raise SubjectTaken(oidc_subject)
    principal_id = f"p_{secrets.token_hex(8)}"
    state = await control.append(
        conn,
        "principal.create",
        _by(by),
        {
            "id": principal_id,
            "name": name,
            "roles": sorted(now_roles),
            "oidc_subject": oidc_subject,
        },
        now,
    )
    bound = "" if oidc_subject is None else f", bound to OIDC subject {oidc_subject}"
    await events.record(
        conn,
        "principal",
        f"created {name} with roles {', '.join(sorted(now_roles)) or 'none'}{bound}",
        actor=created_by,
        now=now,
        node=node,
    )
    if wanted - now_roles:
        assert by is not None
        await propose_grant(
            conn, principal_id, add=wanted - now_roles, remove=frozenset(), by=by, now=now,
            node=node, control=control,
        )  # fmt: skip
        state = await control.state(conn)
    await _cache_principal(conn, state.principals[principal_id])
    return _principal(state.principals[principal_id])


async def propose_grant(
    conn: AsyncConnection,
    principal_id: str,
    *,
    add: Iterable[str],
    remove: Iterable[str],
    by: Principal,
    now: float,
    node: str,
    control: ControlLog,
) -> Grant:
    """Propose a change of a principal's roles; one that touches a power role waits for a
    second admin's approval, any other takes effect at once."""
    before = await control.state(conn)
    grant_id = before.next_grant_id()
    added, removed = sorted(add), sorted(remove)
    try:
        state = await control.append(
            conn,
            "grant.propose",
            by.id,
            {"grant": grant_id, "principal_id": principal_id, "add": added, "remove": removed},
            now,
        )
    except Refusal as exc:
        raise GrantRefused(str(exc)) from None
    grant = state.grants[grant_id]
    await events.record(
        conn,
        "grant",
        f"grant #{grant_id} for {state.name_of(principal_id)}: +{','.join(added) or '-'} "
        f"-{','.join(removed) or '-'} ({grant.state})",
        actor=by.name,
        now=now,
        node=node,
    )
    await _cache_principal(conn, state.principals[principal_id])
    return _grant(state, grant)


async def approve_grant(
    conn: AsyncConnection, grant_id: int, *, by: Principal, now: float, node: str,
    control: ControlLog,
) -> Grant:  # fmt: skip
    try:
        state = await control.append(conn, "grant.approve", by.id, {"grant": grant_id}, now)
    except Refusal as exc:
        raise GrantRefused(str(exc)) from None
    grant = state.grants[grant_id]
    await events.record(
        conn,
        "grant",
        f"grant #{grant_id} for {state.name_of(grant.principal_id)} approved",
        actor=by.name,
        now=now,
        node=node,
    )
    await _cache_principal(conn, state.principals[grant.principal_id])
    return _grant(state, grant)


async def list_grants(conn: AsyncConnection, control: ControlLog) -> list[Grant]:
    state = await control.state(conn)
    return [_grant(state, g) for g in sorted(state.grants.values(), key=lambda g: -g.id)]


async def issue_token(
    conn: AsyncConnection,
    principal: Principal,
    *,
    created_by: str,
    now: float,
    expires_at: float | None,
    node: str,
    control: ControlLog,
    by: Principal | None = None,
) -> NewToken:
    """A new token for ``principal``. ``by``: who asks, which must be ``principal`` itself
    (None: the key file's holder at the command line): nobody mints a token for someone else."""
    token = new_token()
    expires_us = None if expires_at is None else _us(expires_at)
    try:
        await control.append(
            conn,
            "token.issue",
            _by(by),
            {
                "id": token.id,
                "principal_id": principal.id,
                "secret_hash": token.secret_hash,
                "expires_at_us": expires_us,
            },
            now,
        )
    except Refusal as exc:
        raise GrantRefused(str(exc)) from None
    await conn.execute(
        insert(api_tokens),
        {
            "id": token.id,
            "principal_id": principal.id,
            "secret_hash": token.secret_hash,
            "created_at_us": _us(now),
            "created_by": created_by,
            "expires_at_us": expires_us,
        },
    )
    until = "no expiry" if expires_at is None else f"expires at {expires_at:.0f}"
    await events.record(
        conn,
        "token",
        f"created token {token.id} for {principal.name} ({until})",
        actor=created_by,
        now=now,
        node=node,
    )
    return token


async def by_name(conn: AsyncConnection, name: str, control: ControlLog) -> Principal | None:
    found = (await control.state(conn)).principal_named(name)
    return None if found is None else _principal(found)


async def by_id(conn: AsyncConnection, principal_id: str, control: ControlLog) -> Principal | None:
    """The principal with this id, as the verified log has it."""
    found = (await control.state(conn)).principals.get(principal_id)
    return None if found is None else _principal(found)


async def by_oidc_subject(
    engine: AsyncEngine, subject: str, control: ControlLog
) -> Principal | None:
    """The enabled principal an admin bound this verified OIDC subject to, or None."""
    state = await control.refresh(engine)
    found = next((p for p in state.principals.values() if p.oidc_subject == subject), None)
    return None if found is None or found.disabled else _principal(found)


async def authenticate(
    engine: AsyncEngine, text: str, now: float, control: ControlLog
) -> Principal | None:
    """The principal a bearer token stands for, or None: malformed, unknown, wrong secret,
    revoked, expired, its principal disabled, or not in the verified control log (a row written
    or put back in the database) all read the same to the caller."""
    parsed = parse_token(text)
    if parsed is None:
        return None
    token_id, secret = parsed
    state = await control.refresh(engine)
    token = state.tokens.get(token_id)
    owner = None if token is None else state.principals.get(token.principal_id)
    now_us = _us(now)
    if (
        token is None
        or owner is None
        or owner.disabled
        or not secret_matches(secret, token.secret_hash)
        or token.revoked_at_us is not None
        or (token.expires_at_us is not None and token.expires_at_us <= now_us)
    ):
        return None
    # When it was last used is for people, not a fact anything acts on: the cache row is fine.
    async with engine.connect() as conn:
        last = (
            await conn.execute(
                select(api_tokens.c.last_used_at_us).where(api_tokens.c.id == token_id)
            )
        ).scalar_one_or_none()
    if last is None or now_us - last > _LAST_USED_RESOLUTION_US:
        async with engine.begin() as conn:
            await conn.execute(
                update(api_tokens).where(api_tokens.c.id == token_id).values(last_used_at_us=now_us)
            )
    found = _principal(owner)
    return Principal(
        found.id, found.name, found.roles, token_id=token_id, oidc_subject=found.oidc_subject
    )


async def revoke(
    conn: AsyncConnection,
    token_id: str,
    *,
    actor: str,
    now: float,
    node: str,
    control: ControlLog,
    by: Principal | None = None,
) -> bool:
    token = (await control.state(conn)).tokens.get(token_id)
    if token is None or token.revoked_at_us is not None:
        return False
    try:
        await control.append(conn, "token.revoke", _by(by), {"id": token_id}, now)
    except Refusal:
        return False
    await conn.execute(
        update(api_tokens).where(api_tokens.c.id == token_id).values(revoked_at_us=_us(now))
    )
    await events.record(conn, "token", f"revoked token {token_id}", actor=actor, now=now, node=node)
    return True


async def list_all(conn: AsyncConnection, control: ControlLog) -> list[Principal]:
    """Every principal in the verified log (rows of the table alone are not principals)."""
    state = await control.state(conn)
    return sorted((_principal(p) for p in state.principals.values()), key=lambda p: p.name)


async def list_tokens(conn: AsyncConnection, control: ControlLog) -> list[TokenInfo]:
    state = await control.state(conn)
    used = {
        r.id: r.last_used_at_us
        for r in await conn.execute(select(api_tokens.c.id, api_tokens.c.last_used_at_us))
    }

    def s(us: int | None) -> float | None:
        return None if us is None else us / 1e6

    return [
        TokenInfo(
            t.id,
            state.name_of(t.principal_id),
            t.created_at_us / 1e6,
            t.created_by,
            s(t.expires_at_us),
            s(t.revoked_at_us),
            s(used.get(t.id)),
        )
        for t in sorted(state.tokens.values(), key=lambda t: t.created_at_us)
    ]


__all__ = [
    "Grant",
    "GrantRefused",
    "NameTaken",
    "Principal",
    "SubjectTaken",
    "TokenInfo",
    "approve_grant",
    "authenticate",
    "by_oidc_subject",
    "create",
    "issue_token",
    "list_grants",
    "propose_grant",
]
