"""`gtm region status` as an operator reads it: a header row, and each region's utilisation
from the admin API's node (capacity reports are pushed to nodes, not kept in the database)."""

from __future__ import annotations

import asyncio
import json
import re

from gtm.admin.permissions import Role
from regional_lb.capacity_report import CapacityReport
from tests.gtm.admin.conftest import AdminFactory, capacity_report, run_gtm


async def test_region_status_has_a_header_and_each_regions_utilisation(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:

        def report(seq: int) -> None:
            """A fresh report from eu-west: each gtm run below takes seconds on a loaded
            machine, longer together than a report stays fresh."""
            admin.runtime.apply_report(CapacityReport.model_validate(capacity_report(seq=seq)))

        report(1)
        viewer = await admin.token("vera", Role.VIEWER)
        env = {
            "GTM_DATABASE_URL": admin.runtime.settings.database_url,
            "GTM_DOCUMENT_KEYS": json.dumps([str(admin.keys / "document-signing.pub")]),
            "GTM_ADMIN_URL": admin.url,
            "GTM_ADMIN_TOKEN": viewer,
        }
        out = await asyncio.to_thread(run_gtm, ["region", "status"], env)
        assert out.returncode == 0, out.stderr
        header, *lines = out.stdout.splitlines()
        assert header.split()[:3] == ["REGION", "STATE", "UTIL"] and "IN FORCE" in header
        rows = {line.split()[0]: line.split() for line in lines}
        assert rows["eu-west"][2] == "42%"
        assert rows["us-east"][2] == "-"  # no report from it
        # Without the admin API: the table still, and why the column is empty.
        bare = {k: v for k, v in env.items() if not k.startswith("GTM_ADMIN")}
        alone = await asyncio.to_thread(run_gtm, ["region", "status"], bare | {"GTM_ADMIN_URL": ""})
        assert alone.returncode == 0, alone.stderr
        assert re.search(r"^eu-west\s+\S+\s+-\s", alone.stdout, re.M), alone.stdout
        assert "utilisation needs GTM_ADMIN_URL and GTM_ADMIN_TOKEN" in alone.stderr
        report(2)
        as_json = json.loads(
            (await asyncio.to_thread(run_gtm, ["region", "status", "--json"], env)).stdout
        )
        assert {r["region"]: r["utilisation"] for r in as_json}["eu-west"] == 0.42
