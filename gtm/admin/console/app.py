"""Mounting the console on the admin app: its pages, its static files, its session key, and the
answers to a missing session (back to sign-in) and to a refused form (403)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from gtm.admin.console import access, decisions, events, fleet, oidc_signin, policies, signin
from gtm.admin.console.oidc_signin import ConsoleOidc
from gtm.admin.console.session import COOKIE, SessionCodec, load_key
from gtm.admin.console.web import HERE, SECURITY_HEADERS, CsrfRefused, SignInRequired, page

ROUTERS = (
    signin.router,
    oidc_signin.router,
    fleet.router,
    policies.router,
    decisions.router,
    events.router,
    access.router,
)


class _Static(StaticFiles):
    """The console's files: cacheable, and never sniffed as another type."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers["x-content-type-options"] = "nosniff"
        response.headers["cache-control"] = "public, max-age=3600"
        return response


def mount(
    app: FastAPI,
    *,
    key_file: Path | None,
    idle_s: float = 900.0,
    max_age_s: float = 43_200.0,
    oidc: ConsoleOidc | None = None,
) -> None:
    codec = SessionCodec(load_key(key_file), idle_s=idle_s, max_age_s=max_age_s)
    app.state.console_sessions = codec
    app.state.console_oidc = oidc
    for router in ROUTERS:
        app.include_router(router, include_in_schema=False)
    app.mount("/console/static", _Static(directory=HERE / "static"), name="console-static")

    @app.get("/console", include_in_schema=False)
    async def console_root() -> Response:
        return RedirectResponse("/console/", status_code=307)

    # Browsers ask for /favicon.ico on every page whatever the page links: answer with the
    # console's icon rather than a 404 in every page's log.
    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return RedirectResponse("/console/static/favicon.svg", status_code=308)

    @app.exception_handler(SignInRequired)
    async def sign_in_first(request: Request, exc: SignInRequired) -> Response:
        target = "/console/signin"
        query = []
        if exc.reason:
            query.append("reason=" + quote(exc.reason, safe=""))
        if request.method == "GET" and request.url.path != "/console/fleet/live":
            query.append("next=" + quote(request.url.path, safe="/"))
        response = RedirectResponse(
            target + ("?" + "&".join(query) if query else ""),
            status_code=303,
            headers=SECURITY_HEADERS,
        )
        if exc.reason:
            response.delete_cookie(COOKIE, path="/console")
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """A console URL that names no page, or a page with the wrong method: a page that says
        so. Everywhere else, FastAPI's own answer."""
        if not is_console(request):
            return await http_exception_handler(request, exc)
        words = {
            404: "There is no such page in the console.",
            405: "This address takes a form, not a page view: use the page's button.",
        }
        message = words.get(exc.status_code, str(exc.detail))
        return page("error.html", status=exc.status_code, message=message)

    @app.exception_handler(CsrfRefused)
    async def csrf_refused(request: Request, exc: CsrfRefused) -> Response:
        return page("forbidden.html", status=403)


def is_console(request: Request) -> bool:
    return request.url.path == "/console" or request.url.path.startswith("/console/")


def invalid_page(errors: Sequence[Any]) -> Response:
    """A console URL or form FastAPI could not read (``/console/policies/new-ish``): a page that
    says so, never the API's JSON. A bad part of the path is a page that does not exist."""
    where = [str(e.get("loc", ("",))[0]) for e in errors if isinstance(e, Mapping)]
    if where and all(w == "path" for w in where):
        return page("error.html", status=404, message="There is no such page in the console.")
    details = "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ())[1:])}: {e.get('msg', '')}"
        for e in errors
        if isinstance(e, Mapping)
    )
    return page("error.html", status=422, message=f"The request could not be read ({details}).")


__all__ = ["invalid_page", "is_console", "mount"]
