"""The fleet gauges the alerts on a silent member and on a rollout left pending read
(gtm.admin.fleet_watch): exported by a running admin service from the roster it reads."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from gtm.admin import fleet_watch
from gtm.admin.permissions import Role
from gtm.fleet import roster, shared_state
from gtm.fleet.shared_state import NodeStatus
from tests.gtm.admin.conftest import AdminFactory
from tests.gtm.admin.test_lifecycle import loose_proposal
from tests.support.waiting import eventually

WITHIN_S = 60.0  # generous: conditions polled for


def _gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_a_silent_member_and_a_pending_rollout_are_exported(
    start_admin: AdminFactory,
) -> None:
    async with start_admin(health_members=("admin-test", "node-y")) as admin:
        # node-y reported once, 100 s ago: silent past the (5 s) liveness bound.
        gone = NodeStatus("node-y", "node-y", time.time() - 100, None, 1, "t", "p", {})
        await shared_state.write_node_status(admin.runtime.engine, gone)
        await eventually(
            lambda: (_gauge("gtm_fleet_member_silence_seconds", member="node-y") or 0) >= 100,
            WITHIN_S,
            "node-y's silence exported",
        )
        assert _gauge("gtm_fleet_live_bound_seconds") == 5.0
        assert (_gauge("gtm_fleet_member_silence_seconds", member="admin-test") or 0) < 100
        assert _gauge("gtm_fleet_rollout_pending_members") == 0  # nothing activated yet

        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        async with admin.client(alice) as a, admin.client(bob) as b:
            p = (await a.post("/v1/proposals", json=loose_proposal())).json()
            await a.post(f"/v1/proposals/{p['id']}/submit")
            await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
            assert (await b.post(f"/v1/proposals/{p['id']}/activate")).status_code == 200
        # In force on admin-test (it syncs), never on node-y: one member pending.
        await eventually(
            lambda: _gauge("gtm_fleet_rollout_pending_members") == 1,
            WITHIN_S,
            "the rollout pending on node-y",
        )
        assert (_gauge("gtm_fleet_rollout_age_seconds") or 0) >= 0


def _entry(member: str, last: float | None, sequence: int | None) -> roster.Entry:
    state = roster.NEVER if last is None else roster.LIVE
    return roster.Entry(member, True, state, last, None, sequence, ())


def test_the_gauges_as_of_now() -> None:
    entries = [_entry("a", 99.5, 3), _entry("b", 40.0, 2), _entry("c", None, None)]
    found = fleet_watch.gauges(entries, fleet_watch.Activation(3, 90.0), 100.0, 70.0)
    # A member that never reported is silent since the watch began, not since the epoch.
    assert found.silence == {"a": 0.5, "b": 60.0, "c": 30.0}
    assert (found.pending, found.rollout_age) == (2, 10.0)
    # Nothing activated: nothing pending.
    assert fleet_watch.gauges(entries, None, 100.0, 70.0).pending == 0
    newest = fleet_watch.newest_activation([(None, None), (2, 50.0), (3, 90.0), (None, 95.0)])
    assert newest == fleet_watch.Activation(3, 90.0)
