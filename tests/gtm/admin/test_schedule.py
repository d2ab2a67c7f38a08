"""Scheduled activation: done at its time by an admin node, exactly once however many look."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import func, select

from gtm.admin import scheduler
from gtm.admin.permissions import Role
from gtm.admin.server import context_for
from gtm.audit.schema import documents
from tests.gtm.admin.conftest import AdminFactory
from tests.gtm.admin.test_lifecycle import loose_proposal


async def test_a_scheduled_activation_happens_once_at_its_time(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        async with admin.client(alice) as a, admin.client(bob) as b:
            p = (await a.post("/v1/proposals", json=loose_proposal())).json()
            await a.post(f"/v1/proposals/{p['id']}/submit")
            await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            at = time.time() + 1.0
            r = await b.post(f"/v1/proposals/{p['id']}/activate", json={"at": at})
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "approved" and abs(r.json()["activate_at"] - at) < 1e-5
            # Not yet due: nothing to do.
            assert await scheduler.activate_due(context_for(admin.runtime)) == []
            await asyncio.sleep(max(0.0, at - time.time()) + 0.05)  # its time, not a readiness
            # Three admin services at once (the server's own loop, and two more).
            done = await asyncio.gather(
                scheduler.activate_due(context_for(admin.runtime)),
                scheduler.activate_due(context_for(admin.runtime)),
            )
            deadline = time.monotonic() + 10
            while (await b.get(f"/v1/proposals/{p['id']}")).json()["state"] != "active":
                assert time.monotonic() < deadline, "the scheduled activation did not happen"
                await asyncio.sleep(0.05)
        assert sum(len(d) for d in done) <= 1
        async with admin.runtime.engine.connect() as conn:
            published = await conn.execute(select(func.count()).select_from(documents))
            assert published.scalar_one() == 1  # signed and published exactly once
        await admin.runtime.sync.sync_once()
        assert admin.runtime.document_sequence == 1
