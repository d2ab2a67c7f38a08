"""An activation is reported in force only when every live node says it has it; a node that
has not is named. Region state is shown as each live node holds it."""

from __future__ import annotations

import time

from gtm.admin.permissions import Role
from gtm.fleet import shared_state
from gtm.fleet.shared_state import NodeStatus
from tests.gtm.admin.conftest import AdminFactory
from tests.gtm.admin.test_lifecycle import loose_proposal


async def test_rollout_names_the_nodes_that_lag(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        # A second node that reports but has not applied anything (cut off, or behind).
        lagging = NodeStatus("node-z", "node-z", time.time() + 3600, None, 1, "t", "p", {})
        await shared_state.write_node_status(admin.runtime.engine, lagging)
        async with admin.client(alice) as a, admin.client(bob) as b:
            p = (await a.post("/v1/proposals", json=loose_proposal())).json()
            await a.post(f"/v1/proposals/{p['id']}/submit")
            await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            r = await b.get(f"/v1/proposals/{p['id']}/rollout")
            assert r.json()["complete"] is False and r.json()["sequence"] is None
            await b.post(f"/v1/proposals/{p['id']}/activate")
            await admin.runtime.sync.sync_once()
            rollout = (await b.get(f"/v1/proposals/{p['id']}/rollout")).json()
            assert rollout["acknowledged"] == ["admin-test"]
            assert rollout["pending"] == {"node-z": None} and rollout["complete"] is False
            nodes = {n["node"]: n for n in (await b.get("/v1/nodes")).json()}
            assert nodes["admin-test"]["document_sequence"] == 1
            regions = {r["region"]: r for r in (await b.get("/v1/regions")).json()}
            assert regions["eu-west"]["nodes"]["admin-test"] in ("up", "unknown")
            # The lagging node catches up: complete.
            caught_up = NodeStatus("node-z", "node-z", time.time() + 3600, 1, 2, "t", "p", {})
            await shared_state.write_node_status(admin.runtime.engine, caught_up)
            rollout = (await b.get(f"/v1/proposals/{p['id']}/rollout")).json()
            assert rollout["complete"] is True
            assert rollout["acknowledged"] == ["admin-test", "node-z"]
