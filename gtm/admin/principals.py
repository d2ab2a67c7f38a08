"""Principals and their API tokens in the shared database.

A principal is a name with roles; it authenticates with an API token (:mod:`gtm.admin.tokens`)
that has an expiry, can be revoked, and records when it was last used. Every change here is an
event in the fleet's hash-chained event log, in the same transaction
(:func:`gtm.admin.events.record`).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm.admin import events
from gtm.admin.permissions import Role
from gtm.admin.tokens import NewToken, new_token, parse_token, secret_matches
from gtm.audit.schema import api_tokens, principals

# A token's last-used time is written at most this often (not a write per request).
_LAST_USED_RESOLUTION_US = 60 * 1_000_000


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    name: str
    roles: frozenset[Role]
    disabled: bool = False
    token_id: str | None = None  # the token this request authenticated with


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: str
    principal: str
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    last_used_at: float | None


class NameTaken(Exception):
    pass


def _us(t: float) -> int:
    return round(t * 1e6)


async def create(
    conn: AsyncConnection,
    name: str,
    roles: Iterable[Role],
    *,
    created_by: str,
    now: float,
    node: str,
) -> Principal:
    principal = Principal(f"p_{secrets.token_hex(8)}", name, frozenset(roles))
    try:
        async with conn.begin_nested():
            await conn.execute(
                insert(principals),
                {
                    "id": principal.id,
                    "name": name,
                    "roles": sorted(principal.roles),
                    "created_at_us": _us(now),
                    "created_by": created_by,
                    "disabled": False,
                },
            )
    except IntegrityError:
        raise NameTaken(name) from None
    await events.record(
        conn,
        "principal",
        f"created {name} with roles {', '.join(sorted(principal.roles))}",
        actor=created_by,
        now=now,
        node=node,
    )
    return principal


async def issue_token(
    conn: AsyncConnection,
    principal: Principal,
    *,
    created_by: str,
    now: float,
    expires_at: float | None,
    node: str,
) -> NewToken:
    token = new_token()
    await conn.execute(
        insert(api_tokens),
        {
            "id": token.id,
            "principal_id": principal.id,
            "secret_hash": token.secret_hash,
            "created_at_us": _us(now),
            "created_by": created_by,
            "expires_at_us": None if expires_at is None else _us(expires_at),
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


async def by_name(conn: AsyncConnection, name: str) -> Principal | None:
    row = (await conn.execute(select(principals).where(principals.c.name == name))).first()
    if row is None:
        return None
    return Principal(row.id, row.name, frozenset(Role(r) for r in row.roles), row.disabled)


async def authenticate(engine: AsyncEngine, text: str, now: float) -> Principal | None:
    """The principal a bearer token stands for, or None: malformed, unknown, wrong secret,
    revoked, expired, or its principal disabled all read the same to the caller."""
    parsed = parse_token(text)
    if parsed is None:
        return None
    token_id, secret = parsed
    query = (
        select(api_tokens, principals.c.name, principals.c.roles, principals.c.disabled)
        .join(principals, principals.c.id == api_tokens.c.principal_id)
        .where(api_tokens.c.id == token_id)
    )
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    now_us = _us(now)
    if (
        row is None
        or not secret_matches(secret, row.secret_hash)
        or row.revoked_at_us is not None
        or (row.expires_at_us is not None and row.expires_at_us <= now_us)
        or row.disabled
    ):
        return None
    if row.last_used_at_us is None or now_us - row.last_used_at_us > _LAST_USED_RESOLUTION_US:
        async with engine.begin() as conn:
            await conn.execute(
                update(api_tokens).where(api_tokens.c.id == token_id).values(last_used_at_us=now_us)
            )
    roles = frozenset(Role(r) for r in row.roles)
    return Principal(row.principal_id, row.name, roles, token_id=token_id)


async def revoke(
    conn: AsyncConnection, token_id: str, *, actor: str, now: float, node: str
) -> bool:
    result = await conn.execute(
        update(api_tokens)
        .where(api_tokens.c.id == token_id, api_tokens.c.revoked_at_us.is_(None))
        .values(revoked_at_us=_us(now))
    )
    if result.rowcount == 0:
        return False
    await events.record(conn, "token", f"revoked token {token_id}", actor=actor, now=now, node=node)
    return True


async def list_all(conn: AsyncConnection) -> list[Principal]:
    rows = (await conn.execute(select(principals).order_by(principals.c.name))).all()
    return [Principal(r.id, r.name, frozenset(Role(x) for x in r.roles), r.disabled) for r in rows]


async def list_tokens(conn: AsyncConnection) -> list[TokenInfo]:
    query = (
        select(api_tokens, principals.c.name)
        .join(principals, principals.c.id == api_tokens.c.principal_id)
        .order_by(api_tokens.c.created_at_us)
    )

    def s(us: int | None) -> float | None:
        return None if us is None else us / 1e6

    return [
        TokenInfo(
            r.id,
            r.name,
            r.created_at_us / 1e6,
            r.created_by,
            s(r.expires_at_us),
            s(r.revoked_at_us),
            s(r.last_used_at_us),
        )
        for r in (await conn.execute(query)).all()
    ]


__all__ = ["NameTaken", "Principal", "TokenInfo", "authenticate", "create", "issue_token"]
