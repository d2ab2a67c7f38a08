"""The admin API (FastAPI): policies, versions, approvals, principals and tokens, events.

Served on its own listener (``gtm serve --admin HOST:PORT``), never on the DNS or HTTP
answering path; any node with database access can serve it, the database is the state. Errors
have one shape: ``{"error": <stable code>, "message": <text>, "problems": [...]}``, with every
validation problem and its path in ``problems``.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from gtm.admin import console, events
from gtm.admin.auth import AdminContext, Forbidden, Unauthenticated
from gtm.admin.errors import LifecycleError
from gtm.admin.oidc import IdentityProviderUnavailable
from gtm.admin.permissions import OPERATIONS
from gtm.admin.routes import audit, documents, identity, regions
from gtm.admin.traces import PRINCIPAL_STATE, TraceRequests
from gtm.control.log import CannotSign, LogRefused
from gtm.tracing import tracer

log = structlog.get_logger(__name__)


def _error(status: int, code: str, message: str, problems: list[dict[str, Any]]) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        {"error": code, "message": message, "problems": problems},
        status_code=status,
        headers=headers,
    )


async def _record_refusal(ctx: AdminContext, request: Request, message: str) -> None:
    """A refusal of an authenticated request, as a ``denied`` event (DESIGN.md rule 6: every
    refusal is evidence). The change it asked for was rolled back; this is written on its own.
    Unauthenticated requests are counted, never written: no stranger makes the service write."""
    principal = getattr(request.state, PRINCIPAL_STATE, None)
    if principal is None:
        return
    try:
        name = ctx.control.good.name_of(principal)
    except LogRefused:
        name = principal
    operation = request.scope.get("route")
    what = getattr(operation, "operation_id", None) or request.url.path
    try:
        async with ctx.engine.begin() as conn:
            await events.record(
                conn, "denied", f"{what}: {message}", actor=name, now=ctx.clock(), node=ctx.node
            )
    except SQLAlchemyError:  # the refusal is answered whether or not it could be written
        log.warning("admin.denied_not_recorded", operation=what)


def create_app(ctx: AdminContext) -> FastAPI:
    app = FastAPI(
        title="GTM admin API",
        version="1",
        description="Residency policies and their approval, principals and tokens, the event log.",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.admin = ctx
    app.include_router(identity.router)
    app.include_router(documents.router)
    app.include_router(regions.router)
    app.include_router(audit.router)
    for route in app.routes:
        if isinstance(route, APIRoute) and route.operation_id not in OPERATIONS:
            raise RuntimeError(
                f"{route.path}: operation {route.operation_id!r} is not in the permission table"
            )

    # After the check: the console's pages are no API operations; each is a client of them.
    console.mount(
        app, key_file=ctx.console_key_file, idle_s=ctx.console_idle_s, oidc=ctx.console_oidc
    )

    traces = tracer("gtm.admin")
    if traces is not None:  # tracing off: no middleware at all
        app.add_middleware(TraceRequests, tracer=traces)

    @app.get("/livez", include_in_schema=False)
    async def livez() -> dict[str, str]:
        return {"status": "live"}

    @app.exception_handler(IdentityProviderUnavailable)
    async def idp_down(request: Request, exc: IdentityProviderUnavailable) -> JSONResponse:
        # The token may be good: not a 401 that would make a client drop it.
        return _error(
            503, "identity_provider_unavailable", "the OIDC issuer's keys are unreachable", []
        )

    @app.exception_handler(Unauthenticated)
    async def unauthenticated(request: Request, exc: Unauthenticated) -> JSONResponse:
        return _error(401, "unauthenticated", "a valid bearer token is required", [])

    @app.exception_handler(Forbidden)
    async def forbidden(request: Request, exc: Forbidden) -> JSONResponse:
        return _error(403, "forbidden", exc.message, [])

    @app.exception_handler(CannotSign)
    async def cannot_sign(request: Request, exc: CannotSign) -> JSONResponse:
        return _error(409, "cannot_sign", str(exc), [])

    @app.exception_handler(LogRefused)
    async def log_refused(request: Request, exc: LogRefused) -> JSONResponse:
        # The control log in the database was cut back, forked or edited: nothing is decided
        # from it until it is repaired (gtm_control_log_broken says so to the operators).
        return _error(503, "control_log_refused", str(exc), [])

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeout)
    async def database_unavailable(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        # The database away, silent past a call's deadline (gtm.audit.deadline), every pooled
        # connection busy, or a transient failure (a deadlock, a serialization failure):
        # asking again later may work. Any other database error is a bug (500).
        transient = isinstance(exc, PoolTimeout | OperationalError | InterfaceError)
        if not (transient or getattr(exc, "connection_invalidated", False)):
            raise exc
        message = "the database could not complete the call; try again"
        response = _error(503, "database_unavailable", message, [])
        response.headers["retry-after"] = "5"
        return response

    @app.exception_handler(LifecycleError)
    async def lifecycle_error(request: Request, exc: LifecycleError) -> JSONResponse:
        if exc.status in (403, 409) and not exc.recorded:
            await _record_refusal(ctx, request, exc.message)
        problems = [
            {"source": p.source, "location": p.location, "message": p.message} for p in exc.problems
        ]
        return _error(exc.status, exc.code, exc.message, problems)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        if console.is_console(request):  # a person's browser: a page, not the API's JSON
            return console.invalid_page(exc.errors())
        problems = [
            {
                "source": "request",
                "location": ".".join(str(x) for x in e.get("loc", ())),
                "message": str(e.get("msg", "")),
            }
            for e in exc.errors()
        ]
        return _error(422, "invalid_request", "the request does not validate", problems)

    return app


__all__ = ["create_app"]
