"""Mounting the console on the admin app: its pages, its static files, its session key, and the
answers to a missing session (back to sign-in) and to a refused form (403)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
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

    @app.exception_handler(CsrfRefused)
    async def csrf_refused(request: Request, exc: CsrfRefused) -> Response:
        return page("forbidden.html", status=403)


__all__ = ["mount"]
