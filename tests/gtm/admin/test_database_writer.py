"""Attacks by someone who holds the database password, found in review, each refused: minting a
token or an approver, inserting approvals, rewriting a proposal's author, swapping the content
under review, lowering the approvals needed, and rolling a restarted node back to an older
signed version."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, insert, select, update

from gtm.admin.permissions import Role
from gtm.admin.tokens import new_token
from gtm.audit.schema import (
    api_tokens,
    approvals,
    document_versions,
    documents,
    principals,
    proposals,
)
from gtm.runtime import Runtime
from tests.gtm.admin.conftest import Admin, AdminFactory, loosen_eu
from tests.gtm.admin.conftest import documents as demo_documents
from tests.gtm.admin.test_lifecycle import _insert_signed, eu_answer, loose_proposal, synced


async def _id_of(admin: Admin, name: str) -> str:
    async with admin.runtime.engine.connect() as conn:
        query = select(principals.c.id).where(principals.c.name == name)
        return str((await conn.execute(query)).scalar_one())


async def _proposed(admin: Admin, author_token: str) -> dict[str, Any]:
    async with admin.client(author_token) as a:
        p: dict[str, Any] = (await a.post("/v1/proposals", json=loose_proposal())).json()
        await a.post(f"/v1/proposals/{p['id']}/submit")
    return p


async def test_a_token_row_written_into_the_database_authenticates_no_one(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        await admin.token("bob", Role.POLICY_APPROVER)
        forged = new_token()
        async with admin.runtime.engine.begin() as conn:
            await conn.execute(
                insert(api_tokens),
                {
                    "id": forged.id,
                    "principal_id": await _id_of(admin, "bob"),
                    "secret_hash": forged.secret_hash,
                    "created_at_us": 0,
                    "created_by": "mallory",
                },
            )
            # And a principal minted the same way, with a token of its own.
            await conn.execute(
                insert(principals),
                {
                    "id": "p_mallory",
                    "name": "mallory",
                    "roles": ["policy-approver", "admin"],
                    "created_at_us": 0,
                    "created_by": "mallory",
                    "disabled": False,
                },
            )
        async with admin.client(forged.text) as b:
            assert (await b.get("/v1/whoami")).status_code == 401
        async with admin.client(await admin.token("root", Role.ADMIN)) as root:
            names = {p["name"] for p in (await root.get("/v1/principals")).json()}
        assert "mallory" not in names and {"bob", "root"} <= names


async def test_approvals_inserted_into_the_database_approve_nothing(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR, Role.POLICY_APPROVER)
        await admin.token("bob", Role.POLICY_APPROVER)
        await admin.token("vera", Role.VIEWER)
        p = await _proposed(admin, alice)
        async with admin.runtime.engine.begin() as conn:
            for name in ("bob", "vera"):
                await conn.execute(
                    insert(approvals),
                    {
                        "proposal_id": p["id"],
                        "principal_id": await _id_of(admin, name),
                        "version_id": p["version"],
                        "at_us": int(time.time() * 1e6),
                        "comment": "",
                    },
                )
            await conn.execute(
                update(proposals).where(proposals.c.id == p["id"]).values(state="approved")
            )
        async with admin.client(alice) as a:
            r = await a.post(f"/v1/proposals/{p['id']}/activate")
            # The verified log holds no approval: the proposal is still only proposed.
            assert r.status_code == 409 and "proposed, not approved" in r.json()["message"]
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) != "us-east"


async def test_a_rewritten_author_is_refused(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR, Role.POLICY_APPROVER)
        p = await _proposed(admin, alice)
        await admin.token("carol", Role.POLICY_AUTHOR)
        # Make carol the "author" so that alice can approve her own change.
        async with admin.runtime.engine.begin() as conn:
            await conn.execute(
                update(proposals)
                .where(proposals.c.id == p["id"])
                .values(author_id=await _id_of(admin, "carol"))
            )
        async with admin.client(alice) as a:
            # The author is what the signed log says: alice, whatever the row now claims.
            assert (await a.get(f"/v1/proposals/{p['id']}")).json()["author"] == "alice"
            r = await a.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            assert r.status_code == 403 and "may not approve" in r.json()["message"]


async def test_content_swapped_under_review_is_shown_and_activated_from_nowhere(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        p = await _proposed(admin, alice)
        async with admin.runtime.engine.begin() as conn:
            await conn.execute(
                update(document_versions)
                .where(document_versions.c.id == p["version"])
                .values(policies=demo_documents()["policies"])
            )
        async with admin.client(bob) as b:
            for path in (f"/v1/proposals/{p['id']}/diff", f"/v1/versions/{p['version']}"):
                r = await b.get(path)
                assert r.status_code == 409 and r.json()["error"] == "tampered", path
            await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            r = await b.post(f"/v1/proposals/{p['id']}/activate")
            assert r.status_code == 409 and r.json()["error"] == "tampered"


async def test_lowering_the_approvals_needed_in_the_database_does_not_count(
    start_admin: AdminFactory,
) -> None:
    async with start_admin(approvals=2) as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        p = await _proposed(admin, alice)
        async with admin.client(bob) as b:
            await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            async with admin.runtime.engine.begin() as conn:
                await conn.execute(
                    update(proposals)
                    .where(proposals.c.id == p["id"])
                    .values(required_approvals=1, state="approved")
                )
            r = await b.post(f"/v1/proposals/{p['id']}/activate")
            # The log's proposal still needs two: one approval leaves it proposed.
            assert r.status_code == 409 and "proposed, not approved" in r.json()["message"]


async def _two_activations(admin: Admin) -> None:
    alice = await admin.token("alice", Role.POLICY_AUTHOR)
    bob = await admin.token("bob", Role.POLICY_APPROVER)
    strict = demo_documents(lambda n, t: t + "\n# reviewed\n" if n == "default.yaml" else t)
    async with admin.client(alice) as a, admin.client(bob) as b:
        for docs in (demo_documents(loosen_eu), strict):
            p = (await a.post("/v1/proposals", json={**docs, "reason": "r"})).json()
            await a.post(f"/v1/proposals/{p['id']}/submit")
            await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            assert (await b.post(f"/v1/proposals/{p['id']}/activate")).status_code == 200
    await synced(admin.runtime)
    assert admin.runtime.document_sequence == 2


async def test_a_restarted_node_is_not_rolled_back(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        await _two_activations(admin)
        engine = admin.runtime.engine
        async with engine.connect() as conn:
            first = (
                (await conn.execute(documents.select().where(documents.c.sequence == 1)))
                .mappings()
                .one()
            )
        # Withhold the newest activation and flood the table with copies of the older one.
        async with engine.begin() as conn:
            await conn.execute(delete(documents).where(documents.c.sequence == 2))
        for _ in range(120):
            await _insert_signed(
                engine,
                first["topology"],
                first["policies"],
                first["manifest"].encode(),
                first["signature"],
            )
        restarted = Runtime(admin.runtime.settings)  # same node, same disk
        await restarted.start()
        try:
            # Activation 2, from its own verified copy: not version 1, nor its files.
            assert restarted.document_sequence == 2
            assert eu_answer(restarted) != "us-east"
        finally:
            await restarted.stop()
