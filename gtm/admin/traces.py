"""A server span per admin API request, while tracing is on (:mod:`gtm.tracing`).

The span is named by the route template (``GET /v1/proposals/{proposal_id}``), never the
path itself, so ids and client networks in paths and query strings stay out of span names and
the number of names stays bounded; a request no route matches is named by its method alone.
The caller's principal id is an attribute (set where the token is resolved,
:func:`gtm.admin.auth.current_principal`); headers, tokens, query strings and bodies never are.
A trace context the caller sent is linked, not continued, as at the HTTP front; a call the
console makes to the API within the process is a child of the console page's span.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanKind, StatusCode, Tracer
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gtm import tracing

PRINCIPAL_ATTRIBUTE = "gtm.principal.id"
# Where the token's resolution leaves the principal's id (the request's ``state``, which is the
# ASGI scope's): read from there rather than from the current span, which a framework's own
# instrumentation inside this middleware may have replaced.
PRINCIPAL_STATE = "gtm_principal_id"


def route_template(scope: Scope, root_path: str) -> str | None:
    """The template of the route that served ``scope``, under any mount it went through
    (``root_path``: the app's own, before routing)."""
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    if not isinstance(path, str):
        return None
    if isinstance(route, Mount):
        # A mounted app that routes by itself (static files): the rest of the path is its own.
        return path + "/{path}"
    mounted: str = scope.get("root_path", "")
    prefix = mounted[len(root_path) :] if mounted.startswith(root_path) else ""
    return prefix + path


class TraceRequests:
    """ASGI middleware around the admin app's routes."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        root_path: str = scope.get("root_path", "")
        status = 0

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        # The current context, not the caller's: a request from the network starts a trace
        # (its own context only linked), a call the console makes to the API in-process is a
        # child of the console page's span.
        with self.tracer.start_as_current_span(
            method,
            kind=SpanKind.SERVER,
            links=tracing.client_links(scope["headers"]),
            attributes={"http.request.method": method},
        ) as span:
            try:
                await self.app(scope, receive, traced_send)
            finally:
                # Routing has run by now (the route is in the scope), whatever the outcome.
                template = route_template(scope, root_path)
                if template is not None:
                    span.update_name(f"{method} {template}")
                    span.set_attribute("http.route", template)
                principal = scope.get("state", {}).get(PRINCIPAL_STATE)
                if isinstance(principal, str):
                    span.set_attribute(PRINCIPAL_ATTRIBUTE, principal)
                if status:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(StatusCode.ERROR)


__all__ = ["PRINCIPAL_ATTRIBUTE", "PRINCIPAL_STATE", "TraceRequests", "route_template"]
