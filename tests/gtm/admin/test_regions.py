"""Operator controls over the admin API, under the authenticated principal and the topology's
safety rules (no residency class left without an allowed region in service, at most half of
the regions out at once), with an admin's override on the record."""

from __future__ import annotations

from gtm.admin.permissions import Role
from gtm.decision.snapshot import HealthState
from tests.gtm.admin.conftest import AdminFactory


async def test_drains_obey_the_safety_rules_unless_an_admin_overrides(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        ops = await admin.token("olga", Role.OPERATOR)
        boss = await admin.token("root", Role.OPERATOR, Role.ADMIN)
        async with admin.client(ops) as o, admin.client(boss) as b:
            r = await o.post("/v1/regions/eu-west/drain", json={"reason": "GPU driver upgrade"})
            assert r.status_code == 200, r.text
            assert r.json() == {
                "region": "eu-west",
                "override": "drained",
                "broke_safety_rules": [],
            }
            await admin.runtime.sync.sync_once()
            assert admin.runtime.store.current.health["eu-west"].state is HealthState.DRAINING
            # The EU's last region: EU personal data would be refused everywhere.
            r = await o.post("/v1/regions/eu-central/drain", json={"reason": "also"})
            assert r.status_code == 409, r.text
            assert "residency class eu-personal would have no allowed region" in r.json()["message"]
            assert r.json()["problems"][0]["source"] == "safety"
            # An operator cannot override; an admin can, and it is on the record.
            forced = {"reason": "datacentre fire", "override_safety": True}
            assert (await o.post("/v1/regions/eu-central/drain", json=forced)).status_code == 403
            r = await b.post("/v1/regions/eu-central/drain", json=forced)
            assert r.status_code == 200 and r.json()["broke_safety_rules"]
            # India's only region, then too many regions out at once.
            r = await o.post(
                "/v1/regions/ap-south/force", json={"state": "down", "for": "1h", "reason": "x"}
            )
            assert r.status_code == 409 and "in-personal" in r.json()["message"]
            assert (
                await o.post("/v1/regions/us-east/drain", json={"reason": "x"})
            ).status_code == 200
            r = await o.post("/v1/regions/us-west/weight", json={"weight": 0, "reason": "x"})
            assert r.status_code == 409 and "4 regions out of service" in r.json()["message"]
            # Undoing is never refused, even with rules still broken.
            r = await o.post("/v1/regions/eu-central/undrain", json={"reason": "fire out"})
            assert r.status_code == 200 and r.json()["override"] is None
            # Bad input.
            assert (
                await o.post("/v1/regions/atlantis/drain", json={"reason": "x"})
            ).status_code == 404
            bad = await o.post(
                "/v1/regions/us-west/force", json={"state": "down", "for": "soon", "reason": "x"}
            )
            assert bad.status_code == 422 and bad.json()["problems"][0]["location"] == "body.for"
            # Past what the database's integers hold: a clear 422, not a 500.
            forever = {"reason": "x", "for": "999999999999999d"}
            r = await o.post("/v1/regions/us-west/drain", json=forever)
            assert r.status_code == 422 and "ten years at most" in r.json()["message"]
            listed = {r["region"]: r for r in (await o.get("/v1/regions")).json()}
            assert listed["eu-west"]["override_by"] == "olga: GPU driver upgrade"
            assert listed["eu-west"]["out_of_service"] and not listed["us-west"]["out_of_service"]
            events = (await b.get("/v1/events", params={"limit": 50})).json()
        assert any(e["kind"] == "safety" and e["actor"] == "root" for e in events)
        assert any(
            e["kind"] == "override" and e["region"] == "eu-west" and e["actor"] == "olga"
            for e in events
        )
