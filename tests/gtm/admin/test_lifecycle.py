"""Policy changes through the admin API: four-eyes approval, signed activation, and every way
around it the issue names (the author approving, a second token of the author, a row marked
approved in the database, a document row without a valid signature, an old one replayed
(never in force; counted as superseded, not as an alarm)."""

from __future__ import annotations

import time
from dataclasses import replace
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import REGISTRY
from sqlalchemy import insert, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.admin.permissions import Role
from gtm.admin.signer import PRIVATE_NAME, generate, load_signer
from gtm.audit.schema import documents, proposals
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.fleet.signed_documents import Manifest, content_digest
from gtm.runtime import Runtime
from tests.gtm.admin.conftest import AdminFactory, loosen_eu
from tests.gtm.admin.conftest import documents as demo_documents

US_CLIENT = "203.0.113.10"  # the test GeoIP database places it in the US


def loose_proposal() -> dict[str, Any]:
    return {**demo_documents(loosen_eu), "reason": "EU data to the US"}


def eu_answer(runtime: Runtime) -> str | None:
    """Where the node sends a US client's EU personal data now."""
    request = DecisionRequest(Channel.DNS, ip_address(US_CLIENT), "chat-eu", "chat-eu")
    return decide(request, runtime.store.current, time.time()).region


async def synced(runtime: Runtime) -> None:
    await runtime.sync.sync_once()


async def test_four_eyes_from_draft_to_in_force(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        # The author holds both roles: four-eyes is about people, not roles.
        alice = await admin.token("alice", Role.POLICY_AUTHOR, Role.POLICY_APPROVER)
        alice_again = await admin.token("alice", Role.POLICY_AUTHOR, Role.POLICY_APPROVER)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        assert eu_answer(admin.runtime) in ("eu-west", "eu-central")
        async with (
            admin.client(alice) as a,
            admin.client(alice_again) as a2,
            admin.client(bob) as b,
        ):
            r = await a.post("/v1/proposals", json={**demo_documents(loosen_eu), "reason": "x"})
            assert r.status_code == 201, r.text
            proposal = r.json()
            pid, version = proposal["id"], proposal["version"]
            assert proposal["state"] == "draft"
            # Nothing to approve until it is proposed.
            assert (
                await b.post(f"/v1/proposals/{pid}/approve", json={"version": version})
            ).status_code == 409
            assert (await a.post(f"/v1/proposals/{pid}/submit")).json()["state"] == "proposed"
            # The diff a reviewer reads: the EU rule now also allows the US.
            diff = (await b.get(f"/v1/proposals/{pid}/diff")).json()
            assert [f["file"] for f in diff["files"]] == ["policies/eu-personal.yaml"]
            assert "+    - US" in diff["files"][0]["diff"]
            # Its author may not approve it, with either of its tokens.
            for client in (a, a2):
                r = await client.post(f"/v1/proposals/{pid}/approve", json={"version": version})
                assert r.status_code == 403 and "author" in r.json()["message"]
            # The author changes it after bob read it: bob's approval names a stale version.
            edited = demo_documents(lambda n, t: loosen_eu(n, t).replace("processed in EU", "kept"))
            changed = (await a.put(f"/v1/proposals/{pid}", json=edited)).json()
            assert changed["state"] == "draft" and changed["version"] != version
            await a.post(f"/v1/proposals/{pid}/submit")
            r = await b.post(f"/v1/proposals/{pid}/approve", json={"version": version})
            assert r.status_code == 409 and "read it again" in r.json()["message"]
            # Not approved: it cannot be activated.
            assert (await b.post(f"/v1/proposals/{pid}/activate")).status_code == 409
            r = await b.post(
                f"/v1/proposals/{pid}/approve",
                json={"version": changed["version"], "comment": "read the diff"},
            )
            assert r.json()["state"] == "approved"
            active = (await b.post(f"/v1/proposals/{pid}/activate")).json()
            assert active["state"] == "active" and active["sequence"] == 1
            assert (await b.get("/v1/versions/active")).json()["id"] == changed["version"]
        await synced(admin.runtime)
        assert admin.runtime.document_sequence == 1
        assert eu_answer(admin.runtime) == "us-east"  # nearest, now allowed
        async with admin.client(bob) as b:
            events = (await b.get("/v1/events", params={"region": "-"})).json()
        kinds = [(e["kind"], e["actor"]) for e in events]
        assert ("activation", "bob") in kinds and ("approval", "bob") in kinds
        assert ("denied", "alice") in kinds  # the refused self-approvals are on the record


async def test_invalid_documents_get_every_problem_with_its_path(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        body = demo_documents(
            lambda n, t: (
                t.replace("jurisdictions: [EU]", "jurisdictions: [EU, XX]")
                if n == "eu-personal.yaml"
                else t
            )
        )
        body["topology"] = body["topology"].replace("ttl: 30", "ttl: -5", 1)
        async with admin.client(alice) as a:
            r = await a.post("/v1/proposals", json={**body, "reason": "typo"})
            assert r.status_code == 422, r.text
            error = r.json()
            assert error["error"] == "invalid_documents"
            assert error["problems"], error
            assert all(p["source"] and p["message"] for p in error["problems"])
            r = await a.post("/v1/proposals", json={"topology": 1})
            assert r.status_code == 422 and r.json()["error"] == "invalid_request"
            assert {p["location"] for p in r.json()["problems"]} >= {"body.policies", "body.reason"}
            assert (await a.get("/v1/proposals/12345")).status_code == 404


async def test_a_database_writer_cannot_change_routing(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        engine = admin.runtime.engine
        before = eu_answer(admin.runtime)
        loose = demo_documents(loosen_eu)
        now = time.time()

        # 1. A document row written straight into the database, unsigned.
        async with engine.begin() as conn:
            await conn.execute(
                insert(documents),
                {
                    "published_at_us": int(now * 1e6),
                    "topology": loose["topology"],
                    "policies": loose["policies"],
                    "fingerprint": "x",
                    "actor": "mallory",
                    "reason": "unsigned",
                },
            )
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) == before and admin.runtime.document_sequence is None

        # 2. A proposal marked "approved" in the database, with no approval behind it.
        alice = await admin.token("alice", Role.POLICY_AUTHOR, Role.POLICY_APPROVER)
        async with admin.client(alice) as a:
            pid = (await a.post("/v1/proposals", json={**loose, "reason": "sneak"})).json()["id"]
            async with engine.begin() as conn:
                await conn.execute(
                    update(proposals).where(proposals.c.id == pid).values(state="approved")
                )
            r = await a.post(f"/v1/proposals/{pid}/activate")
            # The control log says it is a draft: the row's "approved" is no state at all.
            assert r.status_code == 409 and "draft, not approved" in r.json()["message"]

        # 3. A manifest signed with a key the nodes do not trust, and a forged signature.
        other = load_signer(_other_key(admin.keys.parent))
        manifest = Manifest(
            version=content_digest(loose["topology"], loose["policies"]),
            sequence=99,
            proposal=pid,
            author="alice",
            approvers=("bob",),
            required=1,
            activated_at=now,
            actor="bob",
            reason="forged",
            key="",
        )
        body, signature = other.sign(manifest)
        real = load_signer(admin.keys / PRIVATE_NAME)
        real_body, real_signature = real.sign(manifest)
        # A genuine signature over one manifest, attached to different content.
        tampered = demo_documents(lambda n, t: t.replace("[EU]", "[US]"))
        # A genuine record whose author approved it alone (an admin-service bug, say).
        self_approved, self_signature = real.sign(replace(manifest, approvers=("alice",)))
        for topology, policies, text, sig in (
            (loose["topology"], loose["policies"], body, signature),
            (loose["topology"], loose["policies"], real_body, "00" * 64),
            (tampered["topology"], tampered["policies"], real_body, real_signature),
            (loose["topology"], loose["policies"], self_approved, self_signature),
        ):
            await _insert_signed(engine, topology, policies, text, sig)
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) == before and admin.runtime.document_sequence is None
        refused = _refusals()
        for reason in ("unsigned", "unknown_key", "bad_signature", "content_mismatch", "four_eyes"):
            assert refused.get(reason, 0) >= 1, (reason, refused)

        # 4. A genuine activation, then the old loose version replayed as the newest row.
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        async with admin.client(alice) as a, admin.client(bob) as b:
            strict = demo_documents(lambda n, t: t + "\n# reviewed\n" if n == "default.yaml" else t)
            p1 = (await a.post("/v1/proposals", json={**loose, "reason": "loosen"})).json()
            await a.post(f"/v1/proposals/{p1['id']}/submit")
            await b.post(f"/v1/proposals/{p1['id']}/approve", json={"version": p1["version"]})
            assert (await b.post(f"/v1/proposals/{p1['id']}/activate")).status_code == 200
            await synced(admin.runtime)
            assert eu_answer(admin.runtime) == "us-east"
            p2 = (await a.post("/v1/proposals", json={**strict, "reason": "tighten"})).json()
            await a.post(f"/v1/proposals/{p2['id']}/submit")
            await b.post(f"/v1/proposals/{p2['id']}/approve", json={"version": p2["version"]})
            assert (await b.post(f"/v1/proposals/{p2['id']}/activate")).status_code == 200
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) in ("eu-west", "eu-central")
        assert admin.runtime.document_sequence == 2
        async with engine.connect() as conn:
            first = await conn.execute(documents.select().where(documents.c.sequence == 1))
            row = first.mappings().one()
        superseded = REGISTRY.get_sample_value("gtm_documents_superseded_total") or 0.0
        refusals = _refusals()
        await _insert_signed(
            engine, row["topology"], row["policies"], row["manifest"].encode(), row["signature"]
        )
        await synced(admin.runtime)
        # Never in force; and, validly signed, it can only be old: no alarm (issue 33).
        assert eu_answer(admin.runtime) in ("eu-west", "eu-central")
        assert (REGISTRY.get_sample_value("gtm_documents_superseded_total") or 0.0) > superseded
        assert _refusals() == refusals


def _other_key(directory: Path) -> Path:
    private, _ = generate(directory / "other-key")
    return private


async def _insert_signed(
    engine: AsyncEngine, topology: str, policies: Any, manifest: bytes, signature: str
) -> None:
    record = orjson.loads(manifest)
    async with engine.begin() as conn:
        await conn.execute(
            insert(documents),
            {
                "published_at_us": int(time.time() * 1e6),
                "topology": topology,
                "policies": policies,
                "fingerprint": "x",
                "actor": "mallory",
                "reason": "inserted",
                "version_id": record["version"],
                "sequence": record["sequence"],
                "manifest": manifest.decode(),
                "signature": signature,
            },
        )


def _refusals() -> dict[str, float]:
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name == "gtm_documents_refused":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["reason"]] = sample.value
    return out


async def test_required_approvals_are_distinct_people(start_admin: AdminFactory) -> None:
    async with start_admin(approvals=2) as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        carol = await admin.token("carol", Role.POLICY_APPROVER)
        async with admin.client(alice) as a, admin.client(bob) as b, admin.client(carol) as c:
            p = (
                await a.post("/v1/proposals", json={**demo_documents(loosen_eu), "reason": "x"})
            ).json()
            assert p["required_approvals"] == 2
            await a.post(f"/v1/proposals/{p['id']}/submit")
            r = await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            assert r.json()["state"] == "proposed"
            again = await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            assert again.status_code == 409
            r = await c.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            assert r.json()["state"] == "approved"
            active = await c.post(f"/v1/proposals/{p['id']}/activate")
            assert active.status_code == 200
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) == "us-east"


async def test_a_node_without_the_signing_key_reads_but_writes_nothing(
    start_admin: AdminFactory,
) -> None:
    async with start_admin(signing=False) as admin:
        # Tokens sealed by the admin service verify here with the public key alone.
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        async with admin.client(alice) as a:
            assert (await a.get("/v1/whoami")).json()["name"] == "alice"
            r = await a.post("/v1/proposals", json=loose_proposal())
            assert r.status_code == 409 and r.json()["error"] == "cannot_sign"
            assert (await a.get("/v1/proposals")).json() == []
