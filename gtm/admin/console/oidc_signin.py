"""Signing in to the console through the organisation's identity provider: the OAuth 2.0
authorization code flow with PKCE (RFC 7636), the browser never seeing a client secret.

``/console/signin/oidc`` sends the browser to the provider with a fresh ``state`` and an S256
code challenge, both kept in a short-lived encrypted cookie; the provider sends it back to
``/console/signin/oidc/callback`` with a code, which GTM exchanges (with the verifier) for an
access token at the token endpoint. That token is then exactly what the admin API accepts as a
bearer (:mod:`gtm.admin.oidc`: signature against the JWKS, issuer, audience, a subject an admin
bound to a principal), so the console adds no second way in: an access token the API would
refuse does not sign anyone in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlencode

import httpx
from cryptography.fernet import InvalidToken
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from markupsafe import escape

from gtm.admin.console.api import Api
from gtm.admin.console.session import new_session
from gtm.admin.console.web import SECURITY_HEADERS, codec_of, page, secure, set_session_cookie
from gtm.admin.oidc import insecure_url
from gtm.errors import ConfigError

router = APIRouter(prefix="/console")

FLOW_COOKIE = "gtm_console_oidc"
FLOW_PATH = "/console/signin/oidc"
FLOW_MAX_AGE_S = 600


@dataclass(frozen=True, slots=True)
class ConsoleOidc:
    client_id: str
    authorize_url: str
    token_url: str
    client_secret: str | None = None  # confidential clients; PKCE protects public ones
    scope: str = "openid"

    def __post_init__(self) -> None:
        problems = [
            problem
            for setting, url in (
                ("GTM_CONSOLE_OIDC_AUTHORIZE_URL", self.authorize_url),
                ("GTM_CONSOLE_OIDC_TOKEN_URL", self.token_url),
            )
            if (problem := insecure_url(setting, url)) is not None
        ]
        if problems:
            raise ConfigError(problems)


def challenge_of(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _callback_url(request: Request) -> str:
    return str(request.url_for("oidc_callback"))


def _next_of(target: str | None) -> str:
    if target and target.startswith("/console/") and not target.startswith("/console//"):
        return target
    return "/console/"


def _config(request: Request) -> ConsoleOidc | None:
    found: ConsoleOidc | None = getattr(request.app.state, "console_oidc", None)
    return found


def _failed(message: str, status: int = 401) -> Response:
    response = page("signin.html", status=status, message=message, signin_csrf="", next="/console/")
    response.delete_cookie(FLOW_COOKIE, path=FLOW_PATH)
    return response


@router.get("/signin/oidc")
async def oidc_start(request: Request, next: str | None = None) -> Response:
    config = _config(request)
    if config is None:
        return _failed("Sign-in through an identity provider is not configured here.", 404)
    state, verifier = secrets.token_urlsafe(24), secrets.token_urlsafe(48)
    codec = codec_of(request)
    flow = json.dumps([state, verifier, _next_of(next), time.time()])
    query = urlencode(
        {
            "response_type": "code",
            "client_id": config.client_id,
            "redirect_uri": _callback_url(request),
            "scope": config.scope,
            "state": state,
            "code_challenge": challenge_of(verifier),
            "code_challenge_method": "S256",
        }
    )
    separator = "&" if "?" in config.authorize_url else "?"
    response = RedirectResponse(
        f"{config.authorize_url}{separator}{query}", status_code=303, headers=SECURITY_HEADERS
    )
    # Lax, not Strict: the provider's redirect back is a cross-site top-level navigation, and
    # the flow's state must come with it. It holds no credential, only the PKCE verifier.
    response.set_cookie(
        FLOW_COOKIE,
        codec.encrypt(flow.encode()),
        httponly=True,
        samesite="lax",
        secure=secure(request),
        path=FLOW_PATH,
        max_age=FLOW_MAX_AGE_S,
    )
    return response


@router.get("/signin/oidc/callback", name="oidc_callback")
async def oidc_callback(
    request: Request,
    code: str | None = None,
    state: str | None = None,
    error: str | None = None,
    error_description: str | None = None,
) -> Response:
    config = _config(request)
    if config is None:
        return _failed("Sign-in through an identity provider is not configured here.", 404)
    if error is not None:
        return _failed(f"The identity provider refused: {error_description or error}")
    codec = codec_of(request)
    try:
        raw = codec.decrypt(request.cookies.get(FLOW_COOKIE, ""), FLOW_MAX_AGE_S)
        expected, verifier, target, _ = json.loads(raw)
    except (InvalidToken, ValueError, TypeError):
        return _failed("The sign-in took too long or did not start here: try again.")
    if code is None or state is None or not hmac.compare_digest(str(expected), state):
        return _failed("The identity provider's answer does not match this sign-in.", 403)
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": _callback_url(request),
        "client_id": config.client_id,
        "code_verifier": verifier,
    }
    if config.client_secret is not None:
        form["client_secret"] = config.client_secret
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            reply = await client.post(config.token_url, data=form)
        token = reply.json().get("access_token") if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return _failed("The identity provider's token endpoint is unreachable.", 503)
    if not isinstance(token, str) or not token:
        return _failed(f"The identity provider gave no access token (HTTP {reply.status_code}).")
    async with Api(request.app, token) as api:
        me = await api.get("/v1/whoami")
    if not me.ok:
        return _failed(
            "Your identity provider knows you, but no GTM principal is bound to you: ask a GTM "
            "admin to bind your subject."
            if me.status == 401
            else f"Cannot sign in: {me.message}",
            me.status,
        )
    # A page, not a redirect: a SameSite=Strict cookie set at the end of a redirect chain that
    # began on the provider's site would not be sent on the chain's next hop.
    where = escape(_next_of(target))
    html = (
        f'<!doctype html><meta http-equiv="refresh" content="0;url={where}">'
        f'<title>Signed in</title><p>Signed in. <a href="{where}">Continue</a></p>'
    )
    response = HTMLResponse(html, headers=SECURITY_HEADERS)
    set_session_cookie(request, response, codec.seal(new_session(token, time.time())))
    response.delete_cookie(FLOW_COOKIE, path=FLOW_PATH)
    return response


__all__ = ["ConsoleOidc", "challenge_of", "router"]
