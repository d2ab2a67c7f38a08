"""Impact analysis: recorded answers replayed under a draft, weighted by their counts."""

from __future__ import annotations

import time
from ipaddress import ip_address

from gtm.admin.permissions import Role
from gtm.audit.record import record_of
from gtm.decision.routing import Channel, DecisionRequest, decide
from tests.gtm.admin.conftest import AdminFactory, documents, loosen_eu

US, DE = "203.0.113.10", "198.51.100.10"  # Washington and Frankfurt in the test GeoIP data


async def test_the_impact_of_a_draft_that_moves_eu_data_to_the_us(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        runtime = admin.runtime
        snapshot, now = runtime.store.current, time.time()
        # Recorded traffic: US clients with EU personal data (answered from the EU), German
        # clients of the unrestricted service (answered from Frankfurt), and US clients of it.
        for client, service, name, answers in (
            (US, "chat-eu", "chat.eu.gtm.example.", 1000),
            (DE, "chat", "chat.gtm.example.", 300),
            (US, "chat", "chat.gtm.example.", 200),
        ):
            request = DecisionRequest(Channel.DNS, ip_address(client), service, name)
            decision = decide(request, snapshot, now)
            runtime.writer.count(record_of(decision, channel="dns", name=name), answers)
        await runtime.writer.flush()
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        viewer = await admin.token("vera", Role.VIEWER)
        async with admin.client(alice) as a, admin.client(viewer) as v:
            p = (await a.post("/v1/proposals", json={**documents(loosen_eu), "reason": "x"})).json()
            r = await v.post(f"/v1/proposals/{p['id']}/impact", json={"since_s": 3600})
            assert r.status_code == 200, r.text
            report = r.json()
        assert report["answers"] == 1500 and report["inputs"] == 3
        assert report["moved"] == 1000 and report["left_jurisdiction"] == 1000
        assert report["newly_refused"] == 0 and report["newly_answered"] == 0
        [(move, n)] = report["by_move"].items()
        assert move.split(" -> ")[1] == "us-east" and move.split(" -> ")[0].startswith("eu-")
        assert n == 1000
        assert report["by_service"]["chat-eu"]["left_jurisdiction"] == 1000
        assert "chat" not in report["by_service"]  # unchanged traffic is not listed
        assert report["by_class"]["eu-personal"]["moved"] == 1000
        # The leak named as an approver acknowledges it: class, from where, to where.
        assert report["leaks"] == [
            {
                "residency_class": "eu-personal",
                "from_jurisdiction": "EU",
                "to_jurisdiction": "US",
                "answers": 1000,
            }
        ]
        [example] = report["examples"]
        assert example["left_jurisdiction"] and example["answers"] == 1000
        assert example["example"].startswith("admin-test#")
        assert example["client_network"] == "203.0.113.0/24"
