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
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm.admin import events
from gtm.admin.permissions import Role
from gtm.admin.seals import Sealer, principal_fields, token_fields
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


class NameTaken(Exception):
    pass


class SubjectTaken(Exception):
    pass


def _us(t: float) -> int:
    return round(t * 1e6)


def _roles(stored: object) -> frozenset[Role]:
    """Roles as stored; a value that is no role (written outside the service) grants nothing."""
    known = {r.value for r in Role}
    if not isinstance(stored, list):
        return frozenset()
    return frozenset(Role(r) for r in stored if r in known)


async def create(
    conn: AsyncConnection,
    name: str,
    roles: Iterable[Role],
    *,
    created_by: str,
    now: float,
    node: str,
    sealer: Sealer,
    oidc_subject: str | None = None,
) -> Principal:
    principal = Principal(
        f"p_{secrets.token_hex(8)}", name, frozenset(roles), oidc_subject=oidc_subject
    )
    role_names = sorted(r.value for r in principal.roles)
    seal = sealer.seal(
        "principal", principal_fields(principal.id, name, role_names, False, oidc_subject)
    )
    if oidc_subject is not None:
        taken = await conn.execute(
            select(principals.c.id).where(principals.c.oidc_subject == oidc_subject)
        )
        if taken.first() is not None:
            raise SubjectTaken(oidc_subject)
    try:
        async with conn.begin_nested():
            await conn.execute(
                insert(principals),
                {
                    "id": principal.id,
                    "name": name,
                    "roles": role_names,
                    "created_at_us": _us(now),
                    "created_by": created_by,
                    "disabled": False,
                    "oidc_subject": oidc_subject,
                    "seal": seal,
                },
            )
    except IntegrityError:
        raise NameTaken(name) from None
    bound = "" if oidc_subject is None else f", bound to OIDC subject {oidc_subject}"
    await events.record(
        conn,
        "principal",
        f"created {name} with roles {', '.join(sorted(principal.roles))}{bound}",
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
    sealer: Sealer,
) -> NewToken:
    token = new_token()
    expires_us = None if expires_at is None else _us(expires_at)
    seal = sealer.seal(
        "token", token_fields(token.id, principal.id, token.secret_hash, expires_us, False)
    )
    await conn.execute(
        insert(api_tokens),
        {
            "id": token.id,
            "principal_id": principal.id,
            "secret_hash": token.secret_hash,
            "created_at_us": _us(now),
            "created_by": created_by,
            "expires_at_us": expires_us,
            "seal": seal,
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


def _sealed(row: Any, sealer: Sealer) -> Principal | None:
    """The principal of a row whose seal verifies; None for any other row."""
    fields = principal_fields(
        row.id, row.name, list(row.roles or []), bool(row.disabled), row.oidc_subject
    )
    if not sealer.verifies("principal", fields, row.seal):
        return None
    return Principal(
        row.id, row.name, _roles(row.roles), row.disabled, oidc_subject=row.oidc_subject
    )


async def by_name(conn: AsyncConnection, name: str, sealer: Sealer) -> Principal | None:
    row = (await conn.execute(select(principals).where(principals.c.name == name))).first()
    return None if row is None else _sealed(row, sealer)


async def by_id(conn: AsyncConnection, principal_id: str, sealer: Sealer) -> Principal | None:
    """The principal with this id if its row is sealed (written by the admin service)."""
    row = (await conn.execute(select(principals).where(principals.c.id == principal_id))).first()
    return None if row is None else _sealed(row, sealer)


async def by_oidc_subject(engine: AsyncEngine, subject: str, sealer: Sealer) -> Principal | None:
    """The enabled principal an admin bound this verified OIDC subject to (sealed), or None."""
    async with engine.connect() as conn:
        query = select(principals).where(principals.c.oidc_subject == subject)
        row = (await conn.execute(query)).first()
    principal = None if row is None else _sealed(row, sealer)
    return None if principal is None or principal.disabled else principal


async def authenticate(
    engine: AsyncEngine, text: str, now: float, sealer: Sealer
) -> Principal | None:
    """The principal a bearer token stands for, or None: malformed, unknown, wrong secret,
    revoked, expired, its principal disabled, or either row not sealed by the admin service
    (written straight into the database) all read the same to the caller."""
    parsed = parse_token(text)
    if parsed is None:
        return None
    token_id, secret = parsed
    async with engine.connect() as conn:
        row = (await conn.execute(select(api_tokens).where(api_tokens.c.id == token_id))).first()
        owner = None if row is None else await by_id(conn, row.principal_id, sealer)
    now_us = _us(now)
    if (
        row is None
        or owner is None
        or owner.disabled
        or not secret_matches(secret, row.secret_hash)
        or row.revoked_at_us is not None
        or (row.expires_at_us is not None and row.expires_at_us <= now_us)
        or not sealer.verifies(
            "token",
            token_fields(row.id, row.principal_id, row.secret_hash, row.expires_at_us, False),
            row.seal,
        )
    ):
        return None
    if row.last_used_at_us is None or now_us - row.last_used_at_us > _LAST_USED_RESOLUTION_US:
        async with engine.begin() as conn:
            await conn.execute(
                update(api_tokens).where(api_tokens.c.id == token_id).values(last_used_at_us=now_us)
            )
    return Principal(
        owner.id, owner.name, owner.roles, token_id=token_id, oidc_subject=owner.oidc_subject
    )


async def revoke(
    conn: AsyncConnection, token_id: str, *, actor: str, now: float, node: str, sealer: Sealer
) -> bool:
    row = (
        await conn.execute(
            select(api_tokens).where(
                api_tokens.c.id == token_id, api_tokens.c.revoked_at_us.is_(None)
            )
        )
    ).first()
    if row is None:
        return False
    # Resealed as revoked: a row set back to "not revoked" no longer verifies.
    seal = sealer.seal(
        "token",
        token_fields(row.id, row.principal_id, row.secret_hash, row.expires_at_us, True),
    )
    await conn.execute(
        update(api_tokens)
        .where(api_tokens.c.id == token_id)
        .values(revoked_at_us=_us(now), seal=seal)
    )
    await events.record(conn, "token", f"revoked token {token_id}", actor=actor, now=now, node=node)
    return True


async def list_all(conn: AsyncConnection, sealer: Sealer) -> list[Principal]:
    """Every sealed principal (rows without a valid seal are not principals)."""
    rows = (await conn.execute(select(principals).order_by(principals.c.name))).all()
    return [p for p in (_sealed(r, sealer) for r in rows) if p is not None]


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


__all__ = [
    "NameTaken",
    "Principal",
    "SubjectTaken",
    "TokenInfo",
    "authenticate",
    "by_oidc_subject",
    "create",
    "issue_token",
]
