"""OIDC access tokens against an issuer's JWKS served on loopback: a verified subject bound to a
principal authenticates as it; everything an attacker can put in a token does not."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm
from sqlalchemy import update

from gtm.admin import oidc, principals
from gtm.admin.oidc import config_from
from gtm.admin.permissions import Role
from gtm.audit.schema import principals as principals_table
from gtm.errors import ConfigError
from tests.gtm.admin.conftest import AdminFactory

ISSUER = "https://idp.example.test/"
AUDIENCE = "gtm-admin"


class Issuer:
    """An identity provider's signing keys and its JWKS endpoint on a loopback port."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # kid -> private key
        self.published: list[dict[str, Any]] = []
        self.fetches = 0
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                issuer.fetches += 1
                body = json.dumps({"keys": issuer.published}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/jwks.json"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, kid: str, key: Any, *, publish: bool = True) -> None:
        self.keys[kid] = key
        if not publish:
            return
        public = key.public_key()
        if isinstance(key, rsa.RSAPrivateKey):
            jwk = json.loads(RSAAlgorithm.to_jwk(public))
        elif isinstance(key, ec.EllipticCurvePrivateKey):
            jwk = json.loads(ECAlgorithm.to_jwk(public))
        else:
            jwk = json.loads(OKPAlgorithm.to_jwk(public))
        self.published.append({**jwk, "kid": kid, "use": "sig"})

    def token(self, kid: str, alg: str = "RS256", **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice@idp", "iat": now, "exp": now + 300}
        body.update(claims)
        return jwt.encode(body, self.keys[kid], algorithm=alg, headers={"kid": kid})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    idp = Issuer()
    idp.add("k1", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    yield idp
    idp.close()


async def _bind(admin: Any, name: str, subject: str, *roles: Role) -> None:
    control = admin.control
    await control.refresh(admin.runtime.engine)
    async with admin.runtime.engine.begin() as conn:
        await principals.create(
            conn, name, roles, created_by="test", now=time.time(), node="test",
            control=control, oidc_subject=subject,
        )  # fmt: skip


async def test_a_bound_subject_acts_with_its_principals_roles(
    start_admin: AdminFactory, issuer: Issuer
) -> None:
    async with start_admin(oidc=(ISSUER, AUDIENCE, issuer.url)) as admin:
        await _bind(admin, "alice", "alice@idp", Role.POLICY_AUTHOR)
        async with admin.client(issuer.token("k1")) as client:
            r = await client.get("/v1/whoami")
            assert r.status_code == 200, r.text
            assert r.json()["name"] == "alice"
            assert r.json()["roles"] == ["policy-author"]
            # The principal's roles, not whatever the token claims.
        forged_roles = issuer.token("k1", roles=["admin"], groups=["admin"])
        async with admin.client(forged_roles) as client:
            assert (await client.get("/v1/principals")).status_code == 403
        # API tokens keep working beside OIDC.
        async with admin.client(await admin.token("root", Role.ADMIN)) as client:
            assert (await client.get("/v1/whoami")).json()["name"] == "root"


async def test_an_admin_binds_a_subject_over_the_api(
    start_admin: AdminFactory, issuer: Issuer
) -> None:
    async with start_admin(oidc=(ISSUER, AUDIENCE, issuer.url)) as admin:
        async with admin.client(await admin.token("root", Role.ADMIN)) as client:
            body = {"name": "bob", "roles": ["policy-approver"], "oidc_subject": "bob@idp"}
            r = await client.post("/v1/principals", json=body)
            assert r.status_code == 201, r.text
            assert r.json()["oidc_subject"] == "bob@idp"
            # Approver is power: it waits for a second admin.
            assert r.json()["roles"] == [] and len(r.json()["pending_grants"]) == 1
            again = await client.post("/v1/principals", json={**body, "name": "bob2"})
            assert again.status_code == 409
        async with admin.client(issuer.token("k1", sub="bob@idp")) as client:
            assert (await client.get("/v1/whoami")).status_code == 403  # no role yet
        async with admin.client(await admin.token("root2", Role.ADMIN)) as second:
            grant = r.json()["pending_grants"][0]
            assert (await second.post(f"/v1/grants/{grant}/approve")).status_code == 200
        async with admin.client(issuer.token("k1", sub="bob@idp")) as client:
            assert (await client.get("/v1/whoami")).json()["roles"] == ["policy-approver"]


@pytest.mark.parametrize(
    "attack",
    [
        "unbound subject",
        "wrong audience",
        "wrong issuer",
        "expired",
        "no exp",
        "alg none",
        "hmac with the public key",
        "attacker key under a published kid",
        "unknown kid",
        "tampered payload",
    ],
)
async def test_tokens_that_must_not_authenticate(
    start_admin: AdminFactory, issuer: Issuer, attack: str
) -> None:
    attacker = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    async with start_admin(oidc=(ISSUER, AUDIENCE, issuer.url)) as admin:
        await _bind(admin, "root-idp", "alice@idp", Role.ADMIN)
        now = int(time.time())
        if attack == "unbound subject":
            token = issuer.token("k1", sub="mallory@idp")
        elif attack == "wrong audience":
            token = issuer.token("k1", aud="another-app")
        elif attack == "wrong issuer":
            token = issuer.token("k1", iss="https://evil.example.test/")
        elif attack == "expired":
            token = issuer.token("k1", iat=now - 3600, exp=now - 600)
        elif attack == "no exp":
            token = jwt.encode(
                {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice@idp", "iat": now},
                issuer.keys["k1"],
                algorithm="RS256",
                headers={"kid": "k1"},
            )
        elif attack == "alg none":
            token = jwt.encode(
                {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice@idp", "iat": now, "exp": now + 300},
                None,
                algorithm="none",
                headers={"kid": "k1"},
            )
        elif attack == "hmac with the public key":
            public_pem = (
                issuer.keys["k1"]
                .public_key()
                .public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )
            token = _hs256(
                {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice@idp", "iat": now, "exp": now + 300},
                public_pem,
                "k1",
            )
        elif attack == "attacker key under a published kid":
            issuer.keys["evil"] = attacker
            token = jwt.encode(
                {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice@idp", "iat": now, "exp": now + 300},
                attacker,
                algorithm="RS256",
                headers={"kid": "k1"},
            )
        elif attack == "unknown kid":
            issuer.add("k9", attacker, publish=False)
            token = issuer.token("k9")
        else:
            header, _payload, signature = issuer.token("k1", sub="someone@idp").split(".")
            forged = jwt.utils.base64url_encode(
                json.dumps(
                    {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice@idp", "exp": now + 300}
                ).encode()
            ).decode()
            token = f"{header}.{forged}.{signature}"
        async with admin.client(token) as client:
            r = await client.get("/v1/whoami")
        assert r.status_code == 401, (attack, r.text)
        assert r.json()["error"] == "unauthenticated"


def _hs256(claims: dict[str, Any], secret: bytes, kid: str) -> str:
    """HS256 by hand: PyJWT refuses a PEM as an HMAC secret, an attacker's tool does not."""
    import hashlib
    import hmac

    enc = jwt.utils.base64url_encode
    header = enc(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    payload = enc(json.dumps(claims).encode())
    signature = enc(hmac.new(secret, header + b"." + payload, hashlib.sha256).digest())
    return (header + b"." + payload + b"." + signature).decode()


async def test_a_subject_written_into_the_database_grants_nothing(
    start_admin: AdminFactory, issuer: Issuer
) -> None:
    """A database writer binds their own identity-provider account to an admin principal."""
    async with start_admin(oidc=(ISSUER, AUDIENCE, issuer.url)) as admin:
        root = await admin.token("root", Role.ADMIN)
        async with admin.runtime.engine.begin() as conn:
            await conn.execute(
                update(principals_table)
                .where(principals_table.c.name == "root")
                .values(oidc_subject="mallory@idp")
            )
        async with admin.client(issuer.token("k1", sub="mallory@idp")) as client:
            assert (await client.get("/v1/whoami")).status_code == 401
        # The row is a cache of the control log: root is still who the log says, unbound.
        async with admin.client(root) as client:
            me = (await client.get("/v1/whoami")).json()
            assert me["name"] == "root" and me["oidc_subject"] is None


async def test_keys_rotate_without_a_restart_and_other_key_types_work(
    start_admin: AdminFactory, issuer: Issuer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The refetch cooldown (see the flood test) would hold a new key back for 30 s.
    monkeypatch.setattr(oidc, "REFETCH_COOLDOWN_S", 0.0)
    async with start_admin(oidc=(ISSUER, AUDIENCE, issuer.url)) as admin:
        await _bind(admin, "alice", "alice@idp", Role.VIEWER)
        async with admin.client(issuer.token("k1")) as client:
            assert (await client.get("/v1/whoami")).status_code == 200
        fetched = issuer.fetches
        # The issuer publishes new keys after GTM cached its JWKS.
        issuer.add("k2", ec.generate_private_key(ec.SECP256R1()))
        issuer.add("k3", ed25519.Ed25519PrivateKey.generate())
        for kid, alg in (("k2", "ES256"), ("k3", "EdDSA")):
            async with admin.client(issuer.token(kid, alg)) as client:
                r = await client.get("/v1/whoami")
                assert r.status_code == 200, (alg, r.text)
        assert issuer.fetches > fetched
        # A token may not pick an algorithm of another family for a published key: RS256
        # under the EC key's kid is refused before any verification.
        now = int(time.time())
        claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice@idp", "iat": now, "exp": now + 60}
        mixed = jwt.encode(claims, issuer.keys["k1"], algorithm="RS256", headers={"kid": "k2"})
        async with admin.client(mixed) as client:
            assert (await client.get("/v1/whoami")).status_code == 401


async def test_a_flood_of_unknown_kids_does_not_flood_the_issuer(
    start_admin: AdminFactory, issuer: Issuer
) -> None:
    async with start_admin(oidc=(ISSUER, AUDIENCE, issuer.url)) as admin:
        await _bind(admin, "alice", "alice@idp", Role.VIEWER)
        async with admin.client(issuer.token("k1")) as client:
            assert (await client.get("/v1/whoami")).status_code == 200
        fetched = issuer.fetches
        attacker = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        for n in range(30):
            issuer.add(f"made-up-{n}", attacker, publish=False)
            async with admin.client(issuer.token(f"made-up-{n}")) as client:
                assert (await client.get("/v1/whoami")).status_code == 401
        assert issuer.fetches - fetched <= 1


async def test_an_unreachable_issuer_is_503_not_401(
    start_admin: AdminFactory, issuer: Issuer
) -> None:
    issuer.close()  # nothing listens on its port any more
    async with start_admin(oidc=(ISSUER, AUDIENCE, issuer.url)) as admin:
        async with admin.client(issuer.token("k1")) as client:
            r = await client.get("/v1/whoami")
        assert r.status_code == 503
        assert r.json()["error"] == "identity_provider_unavailable"


def test_oidc_settings_are_all_or_nothing_and_https() -> None:
    assert config_from(None, None, None) is None
    with pytest.raises(ConfigError) as half:
        config_from(ISSUER, None, "https://idp.example.test/jwks")
    assert "GTM_ADMIN_OIDC_AUDIENCE" in str(half.value)
    with pytest.raises(ConfigError) as plain:
        config_from(ISSUER, AUDIENCE, "http://idp.example.test/jwks")
    assert "https" in str(plain.value)
    assert config_from(ISSUER, AUDIENCE, "http://127.0.0.1:1/jwks") is not None
