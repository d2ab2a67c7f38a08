"""Rule 6 at the regional tier: tenant and priority come from a verified key, never a header;
/admin/* needs the admin token; secrets come from files or the environment, checked at start.

Each attack named in issue 19 has a test here that the code before it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from fastapi import FastAPI

from regional_lb.config import parse_config
from regional_lb.credentials import key_digest
from regional_lb.errors import ConfigError
from regional_lb.protocol.serving import running
from regional_lb.proxy.app import create_app
from tests.regional_lb.conftest import balancer, balancer_config, chat, eventually, idle, sim

CHAT = "/v1/chat/completions"
VIP_KEY = "sk-vip-" + "v" * 40


def _one_slot_for_standard(url: str, **extra: Any) -> Any:
    """One instance, two slots: the realtime tier may fill both, standard only one, and
    neither queues. So a second request is admitted only if it really is realtime."""
    tiers = [
        {"name": "realtime", "max_utilisation": 1.0, "queue_limit": 0},
        {"name": "standard", "max_utilisation": 0.5, "queue_limit": 0},
    ]
    cfg = balancer_config(
        [url],
        tiers=tiers,
        default_tier="standard",
        tenants={"vip": {"tier": "realtime", "key_sha256": [key_digest(VIP_KEY)]}},
        **extra,
    )
    return cfg.model_copy(
        update={"instances": [cfg.instances[0].model_copy(update={"max_concurrency": 2})]}
    )


async def test_forged_priority_or_tenant_headers_change_nothing() -> None:
    async with (
        sim(speedup=5.0) as (u1, _),
        balancer(_one_slot_for_standard(u1)) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=20) as c,
    ):
        hold = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=400)))
        await eventually(lambda: pool.admission.running == 1)
        forged = [
            {"X-Priority": "realtime"},
            {"X-Tenant": "vip"},
            {"X-Tenant": "vip", "X-Priority": "realtime"},
            {"Authorization": "Bearer sk-not-the-vip-key", "X-Priority": "realtime"},
        ]
        for headers in forged:
            r = await c.post(CHAT, json=chat(max_tokens=2), headers=headers)
            assert r.status_code == 429, headers  # standard's one slot is taken
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        # The real key is realtime: the reserved slot is its.
        r = await c.post(
            CHAT, json=chat(max_tokens=2), headers={"Authorization": f"Bearer {VIP_KEY}"}
        )
        assert r.status_code == 200
        assert (await hold).status_code == 200
        await eventually(lambda: idle(pool))


async def test_a_tenant_may_lower_its_priority_but_not_raise_it() -> None:
    async with (
        sim(speedup=5.0) as (u1, _),
        balancer(_one_slot_for_standard(u1)) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=20) as c,
    ):
        hold = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=400)))
        await eventually(lambda: pool.admission.running == 1)
        as_standard = {"Authorization": f"Bearer {VIP_KEY}", "X-Priority": "standard"}
        r = await c.post(CHAT, json=chat(max_tokens=2), headers=as_standard)
        assert r.status_code == 429  # asked for standard, got standard
        assert (await hold).status_code == 200
        await eventually(lambda: idle(pool))


async def test_callers_without_a_key_share_the_default_limits_whatever_they_claim() -> None:
    async with sim() as (u1, _):
        cfg = balancer_config([u1], default_tenant={"rate": 0.5, "burst": 2})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url) as c:
            # Rotating X-Tenant used to buy a fresh bucket per made-up name.
            codes = [
                (await c.post(CHAT, json=chat(max_tokens=2), headers={"X-Tenant": f"t{k}"}))
                for k in range(3)
            ]
            assert [r.status_code for r in codes] == [200, 200, 429]
            assert codes[2].json()["error"]["code"] == "rate_limit_exceeded"
            await eventually(lambda: idle(pool))


async def test_admin_needs_the_admin_token(tmp_path: Path) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("admin-" + "a" * 40 + "\n")
    token_file.chmod(0o600)
    async with sim() as (u1, _):
        cfg = balancer_config([u1], admin={"token": {"file": str(token_file)}})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Admin": "admin"}):
                r = await c.post("/admin/drain", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert (await c.get("/admin/instances", headers=headers)).status_code == 401
            assert not pool.draining
            good = {"Authorization": "Bearer admin-" + "a" * 40}
            assert (await c.post("/admin/drain", headers=good)).status_code == 200
            assert pool.draining
            # The OpenAI and operational routes are not behind the admin token.
            assert (await c.get("/livez")).status_code == 200


async def test_admin_without_a_token_is_served_on_loopback_only() -> None:
    async with sim() as (u1, _):
        app = create_app(balancer_config([u1]))
        remote = httpx.ASGITransport(app=app, client=("203.0.113.7", 40000))
        async with httpx.AsyncClient(transport=remote, base_url="http://lb") as c:
            r = await c.post("/admin/drain")
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        assert not app.state.pool.draining
        local = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=local, base_url="http://lb") as c:
            assert (await c.post("/admin/drain")).status_code == 200
        assert app.state.pool.draining


def test_secrets_come_from_env_or_a_private_file_and_fail_at_start(tmp_path: Path) -> None:
    base = {"region": "r", "instances": [{"id": "i", "url": "http://127.0.0.1:1"}]}
    with pytest.raises(ConfigError) as missing_env:
        parse_config({**base, "upstream_auth": {"token": {"env": "RLB_TEST_UNSET_VARIABLE"}}})
    assert "RLB_TEST_UNSET_VARIABLE" in str(missing_env.value)
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError) as missing_file:
        parse_config({**base, "admin": {"token": {"file": str(missing)}}})
    assert str(missing) in str(missing_file.value)
    loose = tmp_path / "loose"
    loose.write_text("s3kr1t-value\n")
    loose.chmod(0o644)
    with pytest.raises(ConfigError) as too_open:
        parse_config({**base, "upstream_auth": {"token": {"file": str(loose)}}})
    assert "chmod 600" in str(too_open.value)
    # The secret itself in the YAML is not a thing the schema accepts.
    with pytest.raises(ConfigError):
        parse_config({**base, "upstream_auth": {"token": "sk-in-clear"}})
    with pytest.raises(ConfigError):
        parse_config({**base, "upstream_auth": {"token": {"value": "sk-in-clear"}}})
    loose.chmod(0o600)
    cfg = parse_config({**base, "upstream_auth": {"token": {"file": str(loose)}}})
    assert cfg.upstream_auth is not None and cfg.upstream_auth.token.read() == "s3kr1t-value"
    assert "s3kr1t" not in cfg.model_dump_json()  # only where it lives is kept
    assert os.environ.get("RLB_TEST_UNSET_VARIABLE") is None


def _rsa_jwks(kid: str) -> tuple[Any, dict[str, Any]]:
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    return key, {"keys": [{**jwk, "kid": kid, "alg": "RS256", "use": "sig"}]}


def _token(key: Any, kid: str, **claims: Any) -> str:
    base = {"iss": "https://idp.test", "aud": "regional-lb", "exp": time.time() + 300}
    return jwt.encode({**base, **claims}, key, algorithm="RS256", headers={"kid": kid})


async def test_jwt_from_the_identity_provider_names_the_tenant_forgeries_do_not() -> None:
    key, jwks = _rsa_jwks("k1")
    other, _ = _rsa_jwks("k1")  # same kid, a key the provider never published
    idp = FastAPI()

    @idp.get("/jwks.json")
    async def keys() -> dict[str, Any]:
        return jwks

    async with running(idp) as idp_url, sim(speedup=5.0) as (u1, _):
        clients = {
            "jwt": {
                "jwks_url": f"{idp_url}/jwks.json",
                "issuer": "https://idp.test",
                "audience": "regional-lb",
            }
        }
        cfg = _one_slot_for_standard(u1, clients=clients)
        async with (
            balancer(cfg) as (url, pool),
            httpx.AsyncClient(base_url=url, timeout=20) as c,
        ):
            hold = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=400)))
            await eventually(lambda: pool.admission.running == 1)
            public_pem = key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            forged = [
                _token(other, "k1", tenant="vip"),  # not the provider's key
                _token(key, "k1", tenant="vip", exp=time.time() - 60),  # expired
                _token(key, "k1", tenant="vip", aud="someone-else"),
                _token(key, "k1", tenant="nobody"),  # not a tenant here
                # The classic confusion: the public key used as an HMAC secret.
                jwt.encode(
                    {
                        "iss": "https://idp.test",
                        "aud": "regional-lb",
                        "exp": time.time() + 300,
                        "tenant": "vip",
                    },
                    public_pem.decode()[:64],
                    algorithm="HS256",
                    headers={"kid": "k1"},
                ),
            ]
            for token in forged:
                r = await c.post(
                    CHAT, json=chat(max_tokens=2), headers={"Authorization": f"Bearer {token}"}
                )
                assert r.status_code == 429  # treated as an unknown caller: standard tier
            good = _token(key, "k1", tenant="vip")
            r = await c.post(
                CHAT, json=chat(max_tokens=2), headers={"Authorization": f"Bearer {good}"}
            )
            assert r.status_code == 200  # realtime: the reserved slot
            assert (await hold).status_code == 200
            await eventually(lambda: idle(pool))
