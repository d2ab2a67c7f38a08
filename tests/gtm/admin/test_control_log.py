"""The control log against someone who holds the database password but no key file (issue 31):
each attack that worked while the control plane's rows were sealed one by one, now refused or
without effect, on SQLite and on PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import delete, insert, select, update

from gtm.admin import scheduler
from gtm.admin.permissions import Role
from gtm.admin.server import context_for
from gtm.admin.signer import load_signer
from gtm.audit.schema import (
    api_tokens,
    control_head,
    control_log,
    document_versions,
    principals,
    proposals,
    region_overrides,
)
from gtm.control.anchor import ControlAnchor, sink_checkpoints, verify_control_log
from gtm.control.log import ControlLog, LogRefused
from gtm.fleet.signed_documents import Manifest, content_digest
from tests.gtm.admin.conftest import Admin, AdminFactory, loosen_eu
from tests.gtm.admin.conftest import documents as demo_documents
from tests.gtm.admin.test_lifecycle import _insert_signed, eu_answer, synced
from tests.support.postgres import postgres_database
from tests.support.tamper import triggers_off

EU = ("eu-west", "eu-central")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None: the admin fixture's SQLite file; else a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield None
    else:
        with postgres_database() as url:
            yield url


async def _id_of(admin: Admin, name: str) -> str:
    async with admin.runtime.engine.connect() as conn:
        query = select(principals.c.id).where(principals.c.name == name)
        return str((await conn.execute(query)).scalar_one())


async def _activate(admin: Admin, author: str, approver: str, docs: dict[str, Any]) -> int:
    async with admin.client(author) as a, admin.client(approver) as b:
        p = (await a.post("/v1/proposals", json={**docs, "reason": "r"})).json()
        await a.post(f"/v1/proposals/{p['id']}/submit")
        await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
        assert (await b.post(f"/v1/proposals/{p['id']}/activate")).status_code == 200
    return int(p["id"])


def _strict() -> dict[str, Any]:
    return demo_documents(lambda n, t: t + "\n# reviewed\n" if n == "default.yaml" else t)


def _broken() -> float:
    return REGISTRY.get_sample_value("gtm_control_log_broken") or 0.0


async def test_a_version_swapped_under_a_real_approval_never_comes_into_force(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        async with admin.client(alice) as a:
            p = (await a.post("/v1/proposals", json={**_strict(), "reason": "a comment"})).json()
            await a.post(f"/v1/proposals/{p['id']}/submit")
        # The attacker stores EU-to-US content and points the proposal under review at it.
        loose = demo_documents(loosen_eu)
        swapped = content_digest(loose["topology"], loose["policies"])
        async with admin.runtime.engine.begin() as conn:
            await conn.execute(
                insert(document_versions),
                {
                    "id": swapped,
                    "topology": loose["topology"],
                    "policies": loose["policies"],
                    "created_at_us": 0,
                    "created_by": "alice",
                },
            )
            await conn.execute(
                update(proposals).where(proposals.c.id == p["id"]).values(version_id=swapped)
            )
        async with admin.client(bob) as b:
            shown = (await b.get(f"/v1/proposals/{p['id']}")).json()
            assert shown["version"] == p["version"]  # what the log says, not the row
            await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": shown["version"]})
            assert (await b.post(f"/v1/proposals/{p['id']}/activate")).status_code == 200
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) in EU


async def test_a_rollback_by_sql_alone_activates_nothing(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        loose = await _activate(admin, alice, bob, demo_documents(loosen_eu))
        await _activate(admin, alice, bob, _strict())
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) in EU
        async with admin.runtime.engine.begin() as conn:
            await conn.execute(
                update(proposals)
                .where(proposals.c.id == loose)
                .values(
                    state="approved",
                    activate_at_us=int(time.time() * 1e6),
                    activate_by=await _id_of(admin, "bob"),
                )
            )
        ctx = context_for(admin.runtime)
        await ctx.control.refresh(admin.runtime.engine)
        assert await scheduler.activate_due(ctx) == []
        await synced(admin.runtime)
        assert eu_answer(admin.runtime) in EU and admin.runtime.document_sequence == 2


async def test_override_rows_inserted_drain_and_force_nothing(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        root = await admin.token("root", Role.ADMIN, Role.OPERATOR)
        async with admin.runtime.engine.begin() as conn:
            for region, force in (("eu-central", None), ("eu-west", "down")):
                await conn.execute(
                    insert(region_overrides),
                    {
                        "region": region,
                        "drain": force is None,
                        "force": force,
                        "force_until_us": int((time.time() + 3600) * 1e6),
                        "actor": "root",
                        "reason": "by SQL",
                        "set_at_us": int(time.time() * 1e6),
                    },
                )
        await synced(admin.runtime)
        health = admin.runtime.store.current.health
        assert health["eu-central"].state.value not in ("draining", "down")
        assert health["eu-west"].state.value not in ("draining", "down")
        async with admin.client(root) as client:
            regions = {r["region"]: r for r in (await client.get("/v1/regions")).json()}
            assert regions["eu-central"]["override"] is None
            # The real thing, through the API, is in the log and in force.
            r = await client.post("/v1/regions/eu-west/drain", json={"reason": "maintenance"})
            assert r.status_code == 200, r.text
        await synced(admin.runtime)
        assert admin.runtime.store.current.health["eu-west"].state.value == "draining"


async def test_one_admin_cannot_complete_four_eyes_alone(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        root = await admin.token("root", Role.ADMIN)
        async with admin.client(root) as r:
            for name, role in (
                ("sock-author", "policy-author"),
                ("sock-approver", "policy-approver"),
            ):
                made = await r.post("/v1/principals", json={"name": name, "roles": [role]})
                assert made.status_code == 201 and made.json()["roles"] == []
                grant = made.json()["pending_grants"][0]
                # Not approved by the admin who proposed it, nor minted a token for.
                assert (await r.post(f"/v1/grants/{grant}/approve")).status_code == 403
                assert (await r.post(f"/v1/principals/{name}/tokens", json={})).status_code == 403
            # Nor does granting power to oneself work.
            mine = await r.post("/v1/principals/root/grants", json={"add": ["policy-approver"]})
            assert mine.status_code == 201 and mine.json()["state"] == "pending"
            assert (await r.post(f"/v1/grants/{mine.json()['id']}/approve")).status_code == 403
            me = (await r.get("/v1/whoami")).json()
            assert me["roles"] == ["admin"]
            events = (await r.get("/v1/events", params={"region": "-", "limit": 200})).json()
        denied = [e["detail"] for e in events if e["kind"] == "denied"]
        assert sum("approve_grant" in d for d in denied) == 3
        assert sum("create_token" in d for d in denied) == 2
        # A second admin completes it: the grants are in force.
        async with admin.client(await admin.token("ida", Role.ADMIN)) as ida:
            pending = [g for g in (await ida.get("/v1/grants")).json() if g["state"] == "pending"]
            for g in pending:
                assert (await ida.post(f"/v1/grants/{g['id']}/approve")).status_code == 200
            roles = {p["name"]: p["roles"] for p in (await ida.get("/v1/principals")).json()}
        assert roles["sock-approver"] == ["policy-approver"]
        assert roles["root"] == ["admin", "policy-approver"]


async def test_a_revoked_token_written_back_stays_revoked(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        carol = await admin.token("carol", Role.VIEWER)
        root = await admin.token("root", Role.ADMIN)
        token_id = carol.split("_")[1]
        async with admin.runtime.engine.connect() as conn:
            query = select(api_tokens).where(api_tokens.c.id == token_id)
            before = dict((await conn.execute(query)).mappings().one())
        async with admin.client(root) as r:
            assert (await r.delete(f"/v1/tokens/{token_id}")).status_code == 204
        # The row put back exactly as it was before the revocation (whatever it carried).
        async with admin.runtime.engine.begin() as conn:
            await conn.execute(delete(api_tokens).where(api_tokens.c.id == token_id))
            await conn.execute(insert(api_tokens), before)
        async with admin.client(carol) as c:
            assert (await c.get("/v1/whoami")).status_code == 401


async def test_a_control_log_cut_back_is_refused_loudly_and_the_last_state_kept(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        olga = await admin.token("olga", Role.OPERATOR)
        async with admin.client(olga) as o:
            r = await o.post("/v1/regions/eu-west/drain", json={"reason": "maintenance"})
            assert r.status_code == 200
            await synced(admin.runtime)
            assert admin.runtime.store.current.health["eu-west"].state.value == "draining"
            # The attacker deletes the drain's entry and moves the head back.
            engine = admin.runtime.engine
            async with engine.begin() as conn:
                await triggers_off(conn)
                newest = (await conn.execute(select(control_log.c.seq).order_by(
                    control_log.c.seq.desc()).limit(1))).scalar_one()  # fmt: skip
                before = (await conn.execute(select(control_log.c.entry_hash).where(
                    control_log.c.seq == newest - 1))).scalar_one()  # fmt: skip
                await conn.execute(delete(control_log).where(control_log.c.seq == newest))
                await conn.execute(update(control_head).values(seq=newest - 1, last_hash=before))
            await synced(admin.runtime)
            # The node keeps the drain it verified, and says the log is refused.
            assert admin.runtime.store.current.health["eu-west"].state.value == "draining"
            assert _broken() == 1
            # The admin service refuses to write after a refused log.
            r = await o.post("/v1/regions/eu-west/undrain", json={"reason": "x"})
            assert r.status_code == 503 and r.json()["error"] == "control_log_refused"
        # A reader that starts again from its mark on disk refuses it too.
        again = context_for(admin.runtime).control
        kept = await again.refresh(engine)  # from its own copy on disk, verified again
        assert again.refusal is not None and "cut back" in again.refusal
        assert "eu-west" in kept.overrides
        # A reader with no mark (a new admin node) reads a consistent, shorter log: the
        # checkpointed head outside the database is what catches that (gtm audit verify).


async def test_an_edited_or_hostile_entry_is_refused_with_its_reason(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        await admin.token("root", Role.ADMIN)
        engine = admin.runtime.engine
        keys = admin.runtime.document_keys
        fresh = ControlLog(keys)
        assert (await fresh.refresh(engine)).principal_named("root") is not None
        async with engine.begin() as conn:
            await triggers_off(conn)
            body = (
                await conn.execute(select(control_log.c.body).where(control_log.c.seq == 1))
            ).scalar_one()
            await conn.execute(
                update(control_log)
                .where(control_log.c.seq == 1)
                .values(body=body.replace('"admin"', '"policy-approver"'))
            )
        edited = ControlLog(keys)
        with pytest.raises(LogRefused):
            await edited.refresh(engine)
        assert edited.refusal is not None and "signature" in edited.refusal
        async with engine.begin() as conn:
            await triggers_off(conn)
            await conn.execute(delete(control_log))
            await conn.execute(
                insert(control_log),
                {
                    "seq": 1,
                    "prev_hash": "0" * 64,
                    "at_us": 0,
                    "kind": "principal.create",
                    "principal": "bootstrap",
                    "body": "not json",
                    "key_id": "x",
                    "signature": "y",
                    "entry_hash": "z",
                },
            )
        hostile = ControlLog(keys)
        with pytest.raises(LogRefused):  # refused with its reason; nothing else raised
            await hostile.refresh(engine)
        assert hostile.refusal is not None and "not JSON" in hostile.refusal


async def test_every_refusal_is_a_denied_event(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    async with start_admin(database_url=database_url) as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        carol = await admin.token("carol", Role.POLICY_AUTHOR)
        olga = await admin.token("olga", Role.OPERATOR)
        auditor = await admin.token("ada", Role.AUDITOR)
        async with admin.client(alice) as a, admin.client(carol) as c, admin.client(olga) as o:
            p = (await a.post("/v1/proposals", json={**_strict(), "reason": "r"})).json()
            for step in ("submit", "withdraw"):
                assert (await c.post(f"/v1/proposals/{p['id']}/{step}")).status_code == 403
            edit = await c.put(f"/v1/proposals/{p['id']}", json=demo_documents(loosen_eu))
            assert edit.status_code == 403
            # A 409 too: activating a draft.
            early = await a.post(f"/v1/proposals/{p['id']}/submit")
            assert early.status_code == 200
            again = await a.post(f"/v1/proposals/{p['id']}/submit")
            assert again.status_code == 409
            # The last EU region drained by an operator who asks to break the safety rules.
            await o.post("/v1/regions/eu-west/drain", json={"reason": "maintenance"})
            r = await o.post(
                "/v1/regions/eu-central/drain", json={"reason": "x", "override_safety": True}
            )
            assert r.status_code == 403
        async with admin.client(auditor) as au:
            events = (await au.get("/v1/events", params={"limit": 500})).json()
        denied = [(e["actor"], e["detail"]) for e in events if e["kind"] == "denied"]
        for what in ("submit", "withdraw", "edit"):
            assert any(a == "carol" and what in d for a, d in denied), (what, denied)
        assert any(a == "alice" and d.startswith("submit_proposal:") for a, d in denied), denied
        assert any(a == "olga" and "only an admin" in d for a, d in denied), denied


async def test_a_wiped_or_cut_back_control_log_is_named_by_its_checkpoints(
    start_admin: AdminFactory, database_url: str | None
) -> None:
    """A reader with no mark (a new admin node, an auditor) reads a consistent, shorter log: the
    head checkpointed outside the database is what names the cut."""
    async with start_admin(database_url=database_url) as admin:
        await admin.token("root", Role.ADMIN)
        await admin.token("olga", Role.OPERATOR)
        runtime, engine = admin.runtime, admin.runtime.engine
        ctx = context_for(runtime)
        await ctx.control.refresh(engine)
        anchor = ControlAnchor(
            ctx.control, runtime.checkpoint_sink, runtime.spool.key, runtime.spool.bound_store
        )
        assert await anchor.checkpoint_if_moved()
        checkpoints, bad = sink_checkpoints(runtime.checkpoint_sink)
        assert bad == [] and [c.seq for c in checkpoints] == [4]
        keys = runtime.document_keys
        assert await verify_control_log(engine, keys, checkpoints) == (4, [])
        # Cut back by one entry, head moved back: consistent in itself, not with the sink.
        async with engine.begin() as conn:
            await triggers_off(conn)
            await conn.execute(delete(control_log).where(control_log.c.seq == 4))
        checked, breaks = await verify_control_log(engine, keys, checkpoints)
        assert checked == 3
        assert [(b.node, b.node_seq) for b in breaks] == [("control_log", 4)]
        assert "cut back or wiped" in breaks[0].problem
        # Wiped: every entry gone.
        async with engine.begin() as conn:
            await triggers_off(conn)
            await conn.execute(delete(control_log))
        checked, breaks = await verify_control_log(engine, keys, checkpoints)
        assert checked == 0 and [b.node_seq for b in breaks] == [4]


async def test_an_activation_after_an_upgrade_follows_the_signed_sequence_nodes_hold(
    start_admin: AdminFactory,
) -> None:
    """A store upgraded from before the control log holds signed activations the log never saw
    (here sequence 3): the log's first activation must come after it, or nodes refuse it."""
    async with start_admin() as admin:
        strict = _strict()
        key = load_signer(admin.keys / "document-signing.key")
        body, signature = key.sign(
            Manifest(
                version=content_digest(strict["topology"], strict["policies"]),
                sequence=3,
                proposal=1,
                author="alice",
                approvers=("bob",),
                required=1,
                activated_at=time.time(),
                actor="bob",
                reason="before the upgrade",
                key="",
            )
        )
        await _insert_signed(
            admin.runtime.engine, strict["topology"], strict["policies"], body, signature
        )
        await synced(admin.runtime)
        assert admin.runtime.document_sequence == 3
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        await _activate(admin, alice, bob, demo_documents(loosen_eu))
        await synced(admin.runtime)
        assert admin.runtime.document_sequence == 4
        assert eu_answer(admin.runtime) == "us-east"
