"""The admin service on PostgreSQL with nothing more than the gtm_admin role (migration 0007):
principals, tokens, a proposal through approval and signed activation, an operator control."""

from __future__ import annotations

import pytest

from gtm.admin.permissions import Role
from tests.gtm.admin.conftest import AdminFactory, documents, loosen_eu

pytestmark = pytest.mark.postgres


async def test_the_admin_service_runs_on_its_role(
    postgres_logins: dict[str, str], start_admin: AdminFactory
) -> None:
    async with start_admin(database_url=postgres_logins["gtm_admin"]) as admin:
        root = await admin.token("root", Role.ADMIN, Role.POLICY_AUTHOR, Role.OPERATOR)
        async with admin.client(root) as client:
            made = await client.post(
                "/v1/principals", json={"name": "bob", "roles": ["policy-approver"]}
            )
            assert made.status_code == 201, made.text
            grant = made.json()["pending_grants"][0]
            # A real change: a draft of the documents already in force is refused at submission.
            body = {**documents(loosen_eu), "reason": "test"}
            draft = await client.post("/v1/proposals", json=body)
            assert draft.status_code == 201, draft.text
            proposal = draft.json()
            submitted = await client.post(f"/v1/proposals/{proposal['id']}/submit")
            assert submitted.status_code == 200, submitted.text
            drain = await client.post("/v1/regions/eu-west/drain", json={"reason": "test"})
            assert drain.status_code == 200, drain.text
        async with admin.client(await admin.token("ida", Role.ADMIN)) as second:
            granted = await second.post(f"/v1/grants/{grant}/approve")
            assert granted.status_code == 200, granted.text
        async with admin.client(await admin.token("bob")) as bob:
            approved = await bob.post(
                f"/v1/proposals/{proposal['id']}/approve", json={"version": proposal["version"]}
            )
            assert approved.status_code == 200, approved.text
            active = await bob.post(f"/v1/proposals/{proposal['id']}/activate", json={})
            assert active.status_code == 200, active.text
