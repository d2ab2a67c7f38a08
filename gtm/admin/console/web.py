"""What every console page shares: the signed-in view (session, API, who you are), rendering
with autoescaped templates and the security headers, and the CSRF check of every form."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from gtm.admin.console.api import Api, Reply
from gtm.admin.console.session import (
    COOKIE,
    Expired,
    Session,
    SessionCodec,
    csrf_matches,
)
from gtm.admin.permissions import OPERATIONS, Role

HERE = Path(__file__).parent
# Every page: nothing from elsewhere, no inline script, not framed, no URL leaks out.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    # same-origin, not no-referrer: with no-referrer a browser sends "Origin: null" on our own
    # forms, and nothing outside the console ever learns a console URL either way.
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}


def _when(t: float | None) -> str:
    if t is None:
        return "—"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _percent(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


# The API's keys as a person reads them; a key not listed is shown with spaces for underscores.
LABELS = {
    "moved": "would move",
    "newly_refused": "newly refused",
    "newly_answered": "newly answered",
    "left_jurisdiction": "would leave their jurisdiction",
    "(none)": "no residency class",
    # Decision outcomes (gtm.decision.model.Outcome) and the DNS path's own.
    "answer": "answered",
    "fail_static": "failed static (every allowed region)",
    "fail_closed": "failed closed (refused)",
    "denied": "denied (class allowed nowhere)",
    "no_service": "no such service",
    "zone": "answered from the zone's own data",
}


def _label(key: object) -> str:
    text = str(key)
    return LABELS.get(text, text.replace("_", " ").replace("-", " "))


def _term(key: object) -> str:
    """A key that is either one of the API's words (an outcome: ``fail_closed``) or a name
    someone chose (a region ``eu-west``, a class ``eu-personal``): the word as a person reads
    it, the name as it is written."""
    text = str(key)
    return LABELS.get(text, text)


def _move(key: object) -> str:
    """``eu-west -> us-east`` (the API's key for a move) as ``eu-west → us-east``."""
    return str(key).replace(" -> ", " → ")


templates = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(["html"], default=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["when"] = _when
templates.filters["percent"] = _percent
templates.filters["label"] = _label
templates.filters["move"] = _move
templates.filters["term"] = _term
templates.filters["urlpart"] = lambda s: quote(str(s), safe="")


class SignInRequired(Exception):
    """Raised by a page that needs a session; answered with a redirect to the sign-in page."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason or "")
        self.reason = reason


class CsrfRefused(Exception):
    """A form without this session's CSRF token, or from another origin: 403, nothing done."""


@dataclass
class View:
    request: Request
    session: Session
    api: Api
    principal: Mapping[str, Any]
    codec: SessionCodec

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(self.principal.get("roles", []))

    def may(self, operation: str) -> bool:
        """Whether to offer ``operation`` (the API decides whether it happens)."""
        known = {r.value for r in Role}
        return any(Role(r) in OPERATIONS[operation] for r in self.roles if r in known)

    def render(self, template: str, status: int = 200, **values: Any) -> HTMLResponse:
        html = templates.get_template(template).render(
            me=self.principal,
            may=self.may,
            csrf=self.session.csrf,
            path=self.request.url.path,
            **values,
        )
        response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
        self.keep(response)
        return response

    def redirect(self, to: str) -> Response:
        response = RedirectResponse(to, status_code=303, headers=SECURITY_HEADERS)
        self.keep(response)
        return response

    def keep(self, response: Response) -> None:
        """Re-seal the session with this request's time: the idle timeout slides."""
        set_session_cookie(self.request, response, self.codec.seal(self.session))

    def refused(self, reply: Reply) -> Response:
        """The API's refusal as a page. Its title says what was refused: a page view shows
        nothing (there was nothing to change), a form changed nothing."""
        if self.request.method in ("GET", "HEAD"):
            title = {
                403: "Not shown: your roles do not include this page",
                404: "Not found",
            }.get(reply.status, "This page could not be shown")
        else:
            title = "Refused: nothing was changed"
        return self.render("refused.html", status=reply.status, reply=reply, title=title)


def secure(request: Request) -> bool:
    return request.url.scheme == "https"


def set_session_cookie(request: Request, response: Response, value: str) -> None:
    response.set_cookie(
        COOKIE,
        value,
        httponly=True,
        samesite="strict",
        secure=secure(request),
        path="/console",
    )


def codec_of(request: Request) -> SessionCodec:
    codec: SessionCodec = request.app.state.console_sessions
    return codec


async def signed_in(request: Request) -> AsyncIterator[View]:
    codec = codec_of(request)
    try:
        session = codec.open(request.cookies.get(COOKIE), time.time())
    except Expired:
        raise SignInRequired("Your session has expired: sign in again.") from None
    if session is None:
        raise SignInRequired()
    async with Api(request.app, session.token) as api:
        me = await api.get("/v1/whoami")
        if me.status == 401:
            raise SignInRequired("Your token is no longer valid (revoked or expired).")
        if not me.ok:
            raise SignInRequired(me.message)
        yield View(request, session, api, me.body, codec)


SignedIn = Annotated[View, Depends(signed_in)]


def same_origin(request: Request) -> bool:
    """A browser names the page a form came from in Origin; when it does, it must be us."""
    origin = request.headers.get("origin")
    if origin is None:  # not every browser sends it on a same-origin POST
        return True
    host = request.headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")


async def form_of(request: Request, view: SignedIn) -> tuple[View, dict[str, str]]:
    """The posted form of a signed-in person, after the CSRF and origin checks."""
    form = await request.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    if not same_origin(request) or not csrf_matches(view.session.csrf, fields.get("csrf")):
        raise CsrfRefused
    return view, fields


Posted = Annotated[tuple[View, dict[str, str]], Depends(form_of)]


def page(template: str, status: int = 200, **values: Any) -> HTMLResponse:
    """A page for nobody signed in (sign-in, errors)."""
    html = templates.get_template(template).render(me=None, may=lambda _: False, **values)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


__all__ = [
    "SECURITY_HEADERS",
    "CsrfRefused",
    "Posted",
    "SignInRequired",
    "SignedIn",
    "View",
    "codec_of",
    "page",
    "set_session_cookie",
    "signed_in",
    "templates",
]
