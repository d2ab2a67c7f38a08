"""Admin API requests as spans: named by route template, the principal's id as an attribute,
never a token, a path's ids or a query string."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from gtm import tracing
from gtm.admin.permissions import Role
from gtm.admin.traces import TraceRequests
from tests.gtm.admin.conftest import AdminFactory
from tests.support.tracing import Spans, in_memory_spans
from tests.support.waiting import eventually


@pytest.fixture
def spans() -> Iterator[Spans]:
    with in_memory_spans() as kept:
        yield kept


def _values(span: ReadableSpan) -> str:
    """Everything a span carries, as text: its name and every attribute and event."""
    parts = [span.name, *map(str, (span.attributes or {}).items())]
    for event in span.events:
        parts += [event.name, *map(str, (event.attributes or {}).items())]
    return " ".join(parts)


async def test_admin_requests_are_spans_with_the_principal_and_no_secrets(
    start_admin: AdminFactory, spans: Spans
) -> None:
    async with start_admin() as admin:
        token = await admin.token("root", Role.ADMIN, Role.VIEWER)
        async with admin.client(token) as api:
            whoami = await api.get("/v1/whoami")
            assert whoami.status_code == 200
            principal_id = whoami.json()["id"]
            made = await api.post("/v1/principals/root/tokens", json={})
            assert made.status_code == 201
            new_token = made.json()["token"]
            missing = await api.get("/v1/proposals/4711", params={"client_network": "10.9.8.0"})
            assert missing.status_code == 404
        async with admin.client(None) as anonymous:
            assert (await anonymous.get("/v1/whoami")).status_code == 401
        async with admin.client("gtm_bogus_secret") as forged:
            assert (await forged.get("/v1/principals")).status_code == 401
        await eventually(lambda: len(spans.finished) >= 5, what="a span per request")

    by_name: dict[str, list[ReadableSpan]] = {}
    for span in spans.finished:
        by_name.setdefault(span.name, []).append(span)
    assert set(by_name) == {
        "GET /v1/whoami",
        "POST /v1/principals/{name}/tokens",
        "GET /v1/proposals/{proposal_id}",
        "GET /v1/principals",
    }
    for span in spans.finished:
        attributes = dict(span.attributes or {})
        assert span.kind is SpanKind.SERVER and span.parent is None
        assert attributes["http.route"] == span.name.split(" ", 1)[1]
        status = attributes["http.response.status_code"]
        # Who, when authenticated; never the token that said so, nor any other secret.
        assert attributes.get("gtm.principal.id") == (principal_id if status != 401 else None)
        text = _values(span)
        for secret in (token, new_token, "gtm_bogus_secret", "Bearer", "10.9.8.0", "4711"):
            assert secret not in text
    statuses = sorted(
        int(str((s.attributes or {})["http.response.status_code"])) for s in spans.finished
    )
    assert statuses == [200, 201, 401, 401, 404]


async def test_off_the_admin_app_has_no_tracing_middleware(start_admin: AdminFactory) -> None:
    from gtm.admin.app import create_app
    from gtm.admin.server import context_for

    async with start_admin() as admin:
        app = create_app(context_for(admin.runtime))
        assert not [m for m in app.user_middleware if getattr(m, "cls", None) is TraceRequests]


async def test_span_names_are_route_templates_and_in_process_calls_nest(spans: Spans) -> None:
    """Templates under mounts (a sub-router; an app that routes by itself, as static files
    do), the method alone for what no route serves, and a call made from within a traced
    request (the console calls the API in-process) a child of that request's span."""

    async def ok(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def files(scope: Scope, receive: Receive, send: Send) -> None:
        await PlainTextResponse("a file")(scope, receive, send)

    inner = Starlette(
        routes=[
            Route("/items/{item_id}", ok),
            Mount("/sub", routes=[Route("/things/{n}", ok)]),
            Mount("/static", app=files),
        ]
    )
    tracer = tracing.tracer("test")
    assert tracer is not None
    app = TraceRequests(inner, tracer)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        with tracer.start_as_current_span("console page") as page:
            for path in ("/items/7", "/sub/things/8", "/static/css/site.css", "/nothing/9"):
                await client.get(path)
    names = [s.name for s in spans.finished if s.name != "console page"]
    assert names == [
        "GET /items/{item_id}",
        "GET /sub/things/{n}",
        "GET /static/{path}",
        "GET",
    ]
    for span in spans.finished:
        if span.name != "console page":
            assert span.parent is not None
            assert span.parent.span_id == page.get_span_context().span_id
