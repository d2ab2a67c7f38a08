"""Who may call what: every operation of the OpenAPI document, every role, one table
(:data:`gtm.admin.permissions.OPERATIONS`); and the OpenAPI document checked in."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from gtm.admin import principals
from gtm.admin.permissions import OPERATIONS, READS, Role
from gtm.cli.control import openapi_document
from tests.conftest import ROOT
from tests.gtm.admin.conftest import AdminFactory

PLACEHOLDERS = {
    "name": "nobody",
    "proposal_id": "999999",
    "token_id": "0" * 16,
    "grant_id": "999999",
    "version_id": "0" * 64,
    "region": "nowhere",
    "decision_id": "nowhere~18c0000000~aaaaaaaa~1",
}


def operations() -> list[tuple[str, str, str]]:
    """(method, path with placeholders, operationId) for every operation in the OpenAPI."""
    out = []
    for path, methods in openapi_document()["paths"].items():
        concrete = re.sub(r"\{(\w+)\}", lambda m: PLACEHOLDERS[m.group(1)], path)
        for method, spec in methods.items():
            out.append((method.upper(), concrete, spec["operationId"]))
    return out


def test_every_operation_has_an_entry_and_every_entry_an_operation() -> None:
    served = {op for _, _, op in operations()}
    assert served - OPERATIONS.keys() == set(), "endpoints without a permission entry"
    assert OPERATIONS.keys() - served == set(), "permission entries without an endpoint"


def test_the_reads_are_the_gets_and_the_two_posts_that_only_compute() -> None:
    """READS (what a refused page view is, for the compliance report) follows the routes."""
    gets = {op for method, _, op in operations() if method == "GET"}
    assert gets | {"get_proposal_impact", "replay_decision"} == READS


def test_the_checked_in_openapi_is_the_one_served() -> None:
    checked_in = json.loads((ROOT / "gtm" / "admin" / "openapi.json").read_text())
    assert checked_in == openapi_document(), "run: gtm admin openapi > gtm/admin/openapi.json"


async def test_role_matrix(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        tokens = {role: await admin.token(f"only-{role}", role) for role in Role}
        async with admin.client(None) as anonymous:
            for method, path, op in operations():
                r = await anonymous.request(method, path, json={})
                assert r.status_code == 401, (op, r.status_code)
                assert r.json()["error"] == "unauthenticated"
                assert r.headers["www-authenticate"] == "Bearer"
        seen: dict[tuple[str, Role], int] = {}
        for role, token in tokens.items():
            async with admin.client(token) as client:
                for method, path, op in operations():
                    body: Any = {} if method in ("POST", "PUT") else None
                    r = await client.request(method, path, json=body)
                    seen[(op, role)] = r.status_code
                    if role in OPERATIONS[op]:
                        assert r.status_code not in (401, 403), (op, role, r.text)
                    else:
                        assert r.status_code == 403, (op, role, r.status_code)
                        assert r.json()["error"] == "forbidden"
        assert len(seen) == len(OPERATIONS) * len(Role)
        # Refusals are evidence: each was recorded in the event log with its principal.
        async with admin.client(tokens[Role.AUDITOR]) as auditor:
            events = (await auditor.get("/v1/events", params={"region": "-", "limit": 1000})).json()
        denied = {(e["actor"], e["detail"].split(":")[0]) for e in events if e["kind"] == "denied"}
        expected = {(f"only-{role}", op) for (op, role), status in seen.items() if status == 403}
        assert expected <= denied


async def test_a_revoked_or_malformed_token_is_refused(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        token = await admin.token("carol", Role.VIEWER)
        root = await admin.token("root", Role.ADMIN)
        async with admin.client(token) as carol, admin.client(root) as adm:
            assert (await carol.get("/v1/whoami")).json()["name"] == "carol"
            token_id = token.split("_")[1]
            assert (await adm.delete(f"/v1/tokens/{token_id}")).status_code == 204
            assert (await carol.get("/v1/whoami")).status_code == 401
            assert (await adm.delete(f"/v1/tokens/{token_id}")).status_code == 404
            listed = {t["id"]: t for t in (await adm.get("/v1/tokens")).json()}
            assert listed[token_id]["revoked_at"] is not None
            assert listed[token_id]["last_used_at"] is not None
        # The right shape with a wrong secret, and garbage.
        forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        for bad in (forged, "gtm_nothing", "Bearer", root + "x"):
            async with admin.client(bad) as client:
                assert (await client.get("/v1/whoami")).status_code == 401


async def test_tokens_expire(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        root = await admin.token("root", Role.ADMIN)
        async with admin.client(root) as adm:
            r = await adm.post("/v1/principals", json={"name": "dave", "roles": ["viewer"]})
            assert r.status_code == 201
            assert (
                await adm.post("/v1/principals", json={"name": "dave", "roles": ["viewer"]})
            ).status_code == 409
            # Nobody mints a token for someone else, an admin included (a 403, and evidence).
            other = await adm.post("/v1/principals/dave/tokens", json={"expires_in": "1h"})
            assert other.status_code == 403 and "only for themself" in other.json()["message"]
            r = await adm.post("/v1/principals/root/tokens", json={"expires_in": "1h"})
            assert r.status_code == 201
            hour = r.json()["token"]
            bad = await adm.post("/v1/principals/root/tokens", json={"expires_in": "soon"})
            assert bad.status_code == 422 and "duration" in bad.json()["message"]
            assert bad.json()["problems"][0]["location"] == "body.expires_in"
            forever = await adm.post("/v1/principals/root/tokens", json={"expires_in": "99999999d"})
            assert forever.status_code == 422 and "ten years at most" in forever.json()["message"]
            events = (await adm.get("/v1/events", params={"region": "-"})).json()
            assert any(
                e["kind"] == "denied" and "create_token: for dave" in e["detail"] for e in events
            )
        async with admin.client(hour) as client:
            assert (await client.get("/v1/whoami")).status_code == 200
        # An hour and a second on, the same token is refused.
        later = time.time() + 3601
        assert (
            await principals.authenticate(admin.runtime.engine, hour, later, admin.control) is None
        )
