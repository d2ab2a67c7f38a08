"""Console sign-in through an identity provider (authorization code + PKCE) against a provider
on loopback: a bound subject signs in in a real browser; a forged state, a missing flow cookie,
a wrong PKCE verifier and an unbound subject sign no one in."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm
from playwright.async_api import Browser, expect

from gtm.admin import principals
from gtm.admin.console.session import COOKIE
from gtm.admin.permissions import Role
from tests.gtm.admin.conftest import Admin, AdminFactory

ISSUER = "https://idp.example.test/"
AUDIENCE = "gtm-admin"
CLIENT_ID = "gtm-console"


class Provider:
    """Authorize (approves whoever ``subject`` names), token (checks the PKCE verifier) and JWKS
    endpoints, as an identity provider serves them."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.subject = "carol@idp"
        self.codes: dict[str, dict[str, str]] = {}
        jwk = json.loads(RSAAlgorithm.to_jwk(self.key.public_key()))
        jwks = {"keys": [{**jwk, "kid": "k1", "use": "sig"}]}
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path == "/jwks.json":
                    return self._send(200, jwks)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                assert query["response_type"] == "code"
                assert query["code_challenge_method"] == "S256"
                code = secrets.token_urlsafe(16)
                provider.codes[code] = query
                back = (
                    query["redirect_uri"] + "?" + urlencode({"code": code, "state": query["state"]})
                )
                return self._send(302, {}, {"location": back})

            def do_POST(self) -> None:
                length = int(self.headers["content-length"])
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                asked = provider.codes.pop(form.get("code", ""), None)
                verifier = form.get("code_verifier", "")
                digest = hashlib.sha256(verifier.encode()).digest()
                challenge = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
                if (
                    asked is None
                    or asked["client_id"] != form.get("client_id")
                    or asked["redirect_uri"] != form.get("redirect_uri")
                    or asked["code_challenge"] != challenge
                ):
                    return self._send(400, {"error": "invalid_grant"})
                now = int(time.time())
                claims = {
                    "iss": ISSUER, "aud": AUDIENCE, "sub": provider.subject,
                    "iat": now, "exp": now + 300,
                }  # fmt: skip
                token = jwt.encode(claims, provider.key, algorithm="RS256", headers={"kid": "k1"})
                return self._send(200, {"access_token": token, "token_type": "Bearer"})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def provider() -> Iterator[Provider]:
    idp = Provider()
    yield idp
    idp.close()


def settings_for(provider: Provider) -> dict[str, Any]:
    return {
        "oidc": (ISSUER, AUDIENCE, provider.url + "/jwks.json"),
        "console_oidc_client_id": CLIENT_ID,
        "console_oidc_authorize_url": provider.url + "/authorize",
        "console_oidc_token_url": provider.url + "/token",
    }


async def bind(admin: Admin, name: str, subject: str, *roles: Role) -> None:
    control = admin.control
    await control.refresh(admin.runtime.engine)
    async with admin.runtime.engine.begin() as conn:
        await principals.create(
            conn, name, roles, created_by="test", now=time.time(), node="test",
            control=control, oidc_subject=subject,
        )  # fmt: skip


async def test_a_bound_subject_signs_in_through_the_provider(
    start_admin: AdminFactory, provider: Provider, browser: Browser
) -> None:
    async with start_admin(**settings_for(provider)) as admin:
        await bind(admin, "carol", "carol@idp", Role.OPERATOR)
        page = await (await browser.new_context()).new_page()
        await page.goto(admin.url + "/console/events")
        await page.get_by_role("link", name="Sign in with your identity provider").click()
        await expect(page).to_have_url(admin.url + "/console/events")
        await expect(page.locator("#whoami")).to_have_text("carol")
        await expect(page.locator("#timeline")).to_be_visible()


async def test_what_must_not_sign_anyone_in(start_admin: AdminFactory, provider: Provider) -> None:
    async with (
        start_admin(**settings_for(provider)) as admin,
        httpx.AsyncClient() as provider_client,  # the browser's side of the provider
    ):
        await bind(admin, "carol", "carol@idp", Role.OPERATOR)
        async with httpx.AsyncClient(base_url=admin.url) as client:
            start = await client.get("/console/signin/oidc")
            assert start.status_code == 303
            authorize = start.headers["location"]
            assert "code_challenge=" in authorize and "client_secret" not in authorize
            # The provider answers (no browser: follow its redirect by hand).
            back = (await provider_client.get(authorize)).headers["location"]
            callback = urlsplit(back)
            query = parse_qs(callback.query)
            # A forged state (a login-CSRF attempt with the attacker's code): refused.
            forged = await client.get(
                callback.path, params={"code": query["code"][0], "state": "forged"}
            )
            assert forged.status_code == 403
            assert COOKIE not in client.cookies
        # No flow cookie at all (the flow did not start in this browser): refused.
        async with httpx.AsyncClient(base_url=admin.url) as stranger:
            reply = await stranger.get(
                callback.path, params={"code": "x", "state": query["state"][0]}
            )
            assert reply.status_code == 401
            assert COOKIE not in stranger.cookies
        # A code redeemed without the right verifier (stolen in transit): the provider says
        # no, and nobody is signed in.
        async with httpx.AsyncClient(base_url=admin.url) as client:
            start = await client.get("/console/signin/oidc")
            back = urlsplit(
                (await provider_client.get(start.headers["location"])).headers["location"]
            )
            code = parse_qs(back.query)["code"][0]
            state = parse_qs(back.query)["state"][0]
            provider.codes[code]["code_challenge"] = "not-the-challenge"
            reply = await client.get(back.path, params={"code": code, "state": state})
            assert reply.status_code == 401
            assert "no access token" in reply.text
            assert COOKIE not in client.cookies
        # A subject the provider vouches for but no admin bound: not signed in, and told why.
        provider.subject = "mallory@idp"
        async with httpx.AsyncClient(base_url=admin.url) as client:
            start = await client.get("/console/signin/oidc")
            back = urlsplit(
                (await provider_client.get(start.headers["location"])).headers["location"]
            )
            params = {k: v[0] for k, v in parse_qs(back.query).items()}
            reply = await client.get(back.path, params=params)
            assert reply.status_code == 401
            assert "no GTM principal is bound to you" in reply.text
            assert COOKIE not in client.cookies
