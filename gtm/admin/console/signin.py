"""Signing in and out. The token is checked by asking the API who it belongs to; it is then kept
only inside the encrypted session cookie, never shown again, never logged."""

from __future__ import annotations

import secrets
import time
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response

from gtm.admin.console.api import Api
from gtm.admin.console.session import COOKIE, SIGNIN_COOKIE, csrf_matches, new_session
from gtm.admin.console.web import (
    SECURITY_HEADERS,
    CsrfRefused,
    Posted,
    codec_of,
    page,
    same_origin,
    secure,
    set_session_cookie,
)

router = APIRouter(prefix="/console")


def _local(target: str | None) -> str:
    """Only a console path may be where sign-in returns to (no open redirect)."""
    if target and target.startswith("/console/") and not target.startswith("/console//"):
        return target
    return "/console/"


def _form(request: Request, message: str | None, next_: str, status: int = 200) -> Response:
    token = secrets.token_urlsafe(24)
    response = page(
        "signin.html",
        status=status,
        message=message,
        signin_csrf=token,
        next=_local(next_),
        oidc=getattr(request.app.state, "console_oidc", None) is not None,
    )
    response.set_cookie(
        SIGNIN_COOKIE,
        token,
        httponly=True,
        samesite="strict",
        secure=secure(request),
        path="/console/signin",
        max_age=1800,
    )
    return response


@router.get("/signin")
async def signin_form(
    request: Request, expired: int = 0, reason: str | None = None, next: str | None = None
) -> Response:
    message = reason or ("Your session has expired: sign in again." if expired else None)
    return _form(request, message, next or "/console/")


@router.post("/signin")
async def signin(
    request: Request,
    token: Annotated[str, Form()] = "",
    csrf: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/console/",
) -> Response:
    expected = request.cookies.get(SIGNIN_COOKIE)
    if not same_origin(request) or expected is None or not csrf_matches(expected, csrf):
        raise CsrfRefused
    token = token.strip()
    if not token:
        return _form(request, "Enter a token.", next, status=400)
    async with Api(request.app, token) as api:
        me = await api.get("/v1/whoami")
    if me.status == 401:
        return _form(request, "That token is not valid (unknown, revoked or expired).", next, 401)
    if not me.ok:
        return _form(request, f"Cannot sign in: {me.message}", next, status=me.status)
    codec = codec_of(request)
    response = RedirectResponse(_local(next), status_code=303, headers=SECURITY_HEADERS)
    set_session_cookie(request, response, codec.seal(new_session(token, time.time())))
    response.delete_cookie(SIGNIN_COOKIE, path="/console/signin")
    return response


@router.post("/signout")
async def signout(request: Request, posted: Posted) -> Response:
    view, _ = posted
    codec_of(request).end(view.session, time.time())
    response = RedirectResponse(
        "/console/signin?reason=Signed+out.", status_code=303, headers=SECURITY_HEADERS
    )
    response.delete_cookie(COOKIE, path="/console")
    return response


__all__ = ["router"]
