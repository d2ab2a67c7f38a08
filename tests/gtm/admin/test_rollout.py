"""An activation is reported in force only when every configured member says it has it; a
member that has not is named, pending or (silent past the fence bound) fenced. Region state is
shown as each member holds it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from gtm.admin.permissions import Role
from gtm.admin.signer import PUBLIC_NAME
from gtm.fleet import shared_state
from gtm.fleet.shared_state import NodeStatus
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.gtm.admin.conftest import AdminFactory, through
from tests.gtm.admin.test_lifecycle import eu_answer, loose_proposal
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import eventually


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


@pytest.mark.postgres
@pytest.mark.parametrize("cut", ["reset", "black hole"])
async def test_a_partitioned_member_stays_pending_then_fenced_never_acknowledged(
    start_admin: AdminFactory, postgres: str, tmp_path: Path, geoip_path: Path, cut: str
) -> None:
    """Two members on PostgreSQL, the second reaching it through a proxy that is cut just
    before an activation. The rollout must not complete while that member is silent (the old
    count over the nodes that reported lately dropped it after the liveness bound and said
    complete); it is pending, then fenced only once it really is; healed, it acknowledges.

    A reset fails the member's calls at once; a black hole leaves them hanging (and the
    driver's cancellation with them): the fence must come on time all the same, or the
    fleet's "fenced since T" would be a claim the member does not keep."""
    server = make_url(postgres)
    proxy = TcpProxy(server.host or "127.0.0.1", server.port or 5432)
    await proxy.start()
    fleet = {"health_members": ("admin-test", "node-b"), "fence_after_s": 2.0}
    async with start_admin(database_url=postgres, node_live_within_s=1.0, **fleet) as admin:
        b_settings = Settings(
            config=DEMO, policies=(POLICIES,), geoip_path=geoip_path,
            database_url=through(postgres, proxy), spool_dir=tmp_path / "spool-b",
            node_id="node-b", probes=False, state_sync_interval_s=0.1,
            document_keys=(admin.keys / PUBLIC_NAME,), **fleet,
        )  # fmt: skip
        b = Runtime(b_settings)
        await b.start()
        try:
            alice = await admin.token("alice", Role.POLICY_AUTHOR)
            bob = await admin.token("bob", Role.POLICY_APPROVER)
            async with admin.client(alice) as a, admin.client(bob) as c:

                async def nodes() -> dict[str, Any]:
                    return {n["observer"]: n for n in (await c.get("/v1/nodes")).json()}

                async def both_live() -> bool:
                    return {n["status"] for n in (await nodes()).values()} == {"live"}

                await eventually(both_live, 30, "both members reporting")
                before = eu_answer(b)
                if cut == "reset":  # node-b is cut off from the database
                    await proxy.stop()
                else:
                    proxy.blackhole()
                p = (await a.post("/v1/proposals", json=loose_proposal())).json()
                await a.post(f"/v1/proposals/{p['id']}/submit")
                await c.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
                assert (await c.post(f"/v1/proposals/{p['id']}/activate")).status_code == 200
                url = f"/v1/proposals/{p['id']}/rollout"
                seen: list[dict[str, Any]] = []

                async def rolled(cond: str) -> bool:
                    seen.append((await c.get(url)).json())
                    out = seen[-1]
                    return out["acknowledged"] == ["admin-test"] and (
                        cond in out["silent"] or cond in out["fenced"]
                    )

                # Silent past the liveness bound: still pending, and said to be silent.
                await eventually(lambda: rolled("node-b"), 30, "node-b silent")
                assert seen[-1]["complete"] is False
                assert "node-b" in seen[-1]["pending"] or "node-b" in seen[-1]["fenced"]
                # It really does not answer the new policy: the old one, or (fenced) nothing.
                assert eu_answer(b) in (before, None) and eu_answer(admin.runtime) != before

                async def fenced() -> bool:
                    seen.append((await c.get(url)).json())
                    return "node-b" in seen[-1]["fenced"]

                await eventually(fenced, 30, "node-b fenced")
                # Claimed fenced: it is (restricted traffic fails closed there).
                assert b.store.current.fence is not None
                assert eu_answer(b) is None
                assert all(not r["complete"] for r in seen)
                listed = (await nodes())["node-b"]
                assert listed["status"] == "fenced" and listed["fenced_since"] is not None
                assert listed["document_sequence"] is None  # what it last reported
                regions = {r["region"]: r for r in (await c.get("/v1/regions")).json()}
                assert regions["eu-west"]["nodes"]["node-b"] == "fenced"

                if cut == "reset":  # healed: it catches up and says so
                    await proxy.start()
                else:
                    proxy.heal()

                async def complete() -> bool:
                    return bool((await c.get(url)).json()["complete"])

                await eventually(complete, 30, "rollout complete after the heal")
                assert b.store.current.fence is None and eu_answer(b) == eu_answer(admin.runtime)
        finally:
            await b.stop()
            await proxy.stop()
