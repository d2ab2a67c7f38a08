"""The one place a request becomes a principal, and a principal an allowed operation.

``Authorization: Bearer <token>``: an API token (:mod:`gtm.admin.tokens`) checked against the
database, or, when an identity provider is configured, an OIDC/JWT access token whose verified
subject an admin bound to a principal (:mod:`gtm.admin.oidc`). No token, or one that does not
authenticate: 401. Authenticated without a role the operation allows
(:data:`gtm.admin.permissions.OPERATIONS`): 403, and a ``denied`` event in the chained log, so
refused attempts are evidence too.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.admin import events
from gtm.admin.oidc import OidcVerifier
from gtm.admin.permissions import OPERATIONS, allowed
from gtm.admin.principals import Principal, authenticate, by_oidc_subject
from gtm.admin.signer import Signer
from gtm.admin.tokens import parse_token
from gtm.admin.traces import PRINCIPAL_STATE
from gtm.audit.checkpoints import CheckpointSink
from gtm.control.log import ControlLog
from gtm.decision.snapshot import Snapshot
from gtm.metrics import ADMIN_AUTH_FAILURES

if TYPE_CHECKING:
    from gtm.admin.console.oidc_signin import ConsoleOidc


@dataclass
class AdminContext:
    """What every route reads: the shared database, this node's name, the signing key (None
    on a node that may not activate) and the clock."""

    engine: AsyncEngine
    node: str
    required_approvals: int
    control: ControlLog  # the signed control log: who holds what, proposals, overrides
    signer: Signer | None = None
    clock: Callable[[], float] = field(default=time.time)
    # The documents nodes answer from while no version has been activated: this node's own
    # files (topology text, policy file name -> text), what a first proposal is diffed against.
    files: tuple[str, Mapping[str, str]] | None = None
    # The snapshot this node answers from (impact analysis replays against it).
    snapshot: Callable[[], Snapshot] | None = None
    # A node is live while its last status report is younger than this.
    live_within_s: float = 5.0
    # The fleet's configured membership (observer ids; empty: none configured) and where it
    # comes from, as this node holds it: rollouts and /v1/nodes count over it (gtm.fleet.roster).
    membership: Callable[[], tuple[str, frozenset[str]]] = field(
        default=lambda: ("none configured", frozenset())
    )
    # The fleet's fence bound (0: nodes never fence) and how late a cut-off node may notice it.
    fence_after_s: float = 0.0
    fence_slack_s: float = 0.0
    # The audit checkpoints' sink outside the database (the compliance report verifies with it).
    checkpoints: Path | None = None
    # The sink itself when it is not that directory (a bucket: gtm.audit.checkpoint_bucket).
    checkpoint_sink: CheckpointSink | None = None
    # OIDC access tokens are accepted when an issuer is configured.
    oidc: OidcVerifier | None = None
    # The console's session cookie key (None: one per process) and its idle timeout.
    console_key_file: Path | None = None
    console_idle_s: float = 900.0
    # Sign-in through the identity provider (authorization code + PKCE); None: tokens only.
    console_oidc: ConsoleOidc | None = None


class Unauthenticated(Exception):
    pass


class Forbidden(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def context(request: Request) -> AdminContext:
    ctx: AdminContext = request.app.state.admin
    return ctx


Ctx = Annotated[AdminContext, Depends(context)]


async def current_principal(request: Request, ctx: Ctx) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    principal = None
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        if parse_token(token) is not None or ctx.oidc is None:
            principal = await authenticate(ctx.engine, token, ctx.clock(), ctx.control)
        else:
            subject = await ctx.oidc.subject(token, ctx.clock())
            if subject is not None:
                principal = await by_oidc_subject(ctx.engine, subject, ctx.control)
    if principal is None:
        # Counted, not written to the event log: an unauthenticated caller must not be able
        # to make the service write to the database.
        ADMIN_AUTH_FAILURES.inc()
        raise Unauthenticated()
    # Who asked, for the request's span while tracing is on (gtm.admin.traces); never the token.
    setattr(request.state, PRINCIPAL_STATE, principal.id)
    return principal


def require(operation: str) -> Callable[..., Awaitable[Principal]]:
    """A dependency: the caller's principal, when one of its roles allows ``operation``."""
    if operation not in OPERATIONS:
        raise KeyError(f"operation {operation!r} has no entry in gtm.admin.permissions")

    async def dependency(
        ctx: Ctx, principal: Annotated[Principal, Depends(current_principal)]
    ) -> Principal:
        if not allowed(operation, principal.roles):
            async with ctx.engine.begin() as conn:
                await events.record(
                    conn,
                    "denied",
                    f"{operation}: roles {', '.join(sorted(principal.roles)) or 'none'}",
                    actor=principal.name,
                    now=ctx.clock(),
                    node=ctx.node,
                )
            raise Forbidden(f"{principal.name} may not {operation.replace('_', ' ')}")
        return principal

    return dependency


__all__ = ["AdminContext", "Ctx", "Forbidden", "Unauthenticated", "current_principal", "require"]
