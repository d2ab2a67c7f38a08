"""The audit log over the admin API: search with filters and a cursor, streaming export, a
decision by the id its response carried, and its replay."""

from __future__ import annotations

import csv
import io
import json
import time
from ipaddress import ip_address

from gtm.admin.permissions import Role
from gtm.audit.decision_id import id_tail, render_id
from gtm.audit.record import record_of
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import HealthState, RegionHealth
from gtm.runtime import Runtime
from tests.gtm.admin.conftest import AdminFactory

US, DE = "203.0.113.10", "198.51.100.10"


def count(runtime: Runtime, client: str, service: str, name: str, n: int) -> None:
    request = DecisionRequest(Channel.DNS, ip_address(client), service, name)
    decision = decide(request, runtime.store.current, time.time())
    runtime.writer.count(record_of(decision, channel="dns", name=name), n)


def id_of(row: dict[str, object]) -> str:
    tail = id_tail(str(row["client_network"]), str(row["name"]))
    at = int(row["first_at_us"]) / 1e6  # type: ignore[call-overload]
    return render_id(f"{row['node']}~".encode(), at, tail, 1).decode()


async def test_search_export_show_and_replay(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        runtime = admin.runtime
        count(runtime, US, "chat-eu", "chat.eu.gtm.example.", 5)
        count(runtime, DE, "chat", "chat.gtm.example.", 3)
        # One made while eu-west was down: its replay must put that back.
        now = time.time()
        runtime.swap(health={"eu-west": RegionHealth(HealthState.DOWN, now)})
        count(runtime, DE, "chat-eu", "chat.eu.gtm.example.", 2)
        runtime.swap(health={})
        await runtime.writer.flush()
        auditor = await admin.token("ada", Role.AUDITOR)
        viewer = await admin.token("vic", Role.VIEWER)
        async with admin.client(auditor) as a, admin.client(viewer) as v:
            assert (await v.get("/v1/decisions")).status_code == 403  # client networks
            page = (await a.get("/v1/decisions", params={"service": "chat-eu"})).json()
            assert len(page["rows"]) == 2 and page["next"] is None
            eu = (await a.get("/v1/decisions", params={"residency_class": "eu-personal"})).json()
            assert {r["service"] for r in eu["rows"]} == {"chat-eu"}
            first = (await a.get("/v1/decisions", params={"limit": 2})).json()
            assert len(first["rows"]) == 2 and first["next"] is not None
            rest = (await a.get("/v1/decisions", params={"after": first["next"]})).json()
            assert len(rest["rows"]) == 1 and rest["next"] is None
            by_region = (await a.get("/v1/decisions", params={"region": "eu-central"})).json()
            assert [r["count"] for r in by_region["rows"]] == [3, 2]

            lines = (await a.get("/v1/decisions/export")).text.splitlines()
            assert [json.loads(x)["count"] for x in lines] == [5, 3, 2]
            table = list(csv.DictReader(io.StringIO(
                (await a.get("/v1/decisions/export", params={"format": "csv"})).text
            )))  # fmt: skip
            assert [r["count"] for r in table] == ["5", "3", "2"]
            assert json.loads(table[0]["candidates"])[0]["region"]

            for row in [*page["rows"], *by_region["rows"]]:
                decision_id = id_of(row)
                shown = (await a.get(f"/v1/decisions/{decision_id}")).json()
                assert [r["id"] for r in shown] == [row["id"]]
                [replayed] = (await a.post(f"/v1/decisions/{decision_id}/replay")).json()
                assert replayed["matches"], replayed
            down = next(r for r in page["rows"] if r["region"] == "eu-central")
            verdicts = {c["region"]: c["reason"] for c in down["candidates"]}
            assert verdicts["eu-west"] == "down"  # and it replayed to the same answer above
            bad = await a.get("/v1/decisions/not-an-id")
            assert bad.status_code == 422
            elsewhere = id_of({**down, "node": "nowhere"})  # well formed, held by no row
            assert (await a.get(f"/v1/decisions/{elsewhere}")).status_code == 404


async def test_the_compliance_report_over_the_api(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        runtime = admin.runtime
        count(runtime, US, "chat-eu", "chat.eu.gtm.example.", 5)
        count(runtime, DE, "chat", "chat.gtm.example.", 3)
        await runtime.writer.flush()
        await runtime.anchor.checkpoint("checkpoint")
        auditor = await admin.token("ada", Role.AUDITOR)
        window = {"from": 0, "to": time.time() + 60}
        async with admin.client(auditor) as a:
            report = (await a.get("/v1/reports/compliance", params=window)).json()
            assert report["answers"] == 8
            assert report["outside_allowed"] == 0 and report["unverifiable"] == {}
            assert report["by_class"] == {"eu-personal": 5, "(unclassified)": 3}
            assert report["verification"]["breaks"] == []
            page = await a.get("/v1/reports/compliance", params={**window, "format": "html"})
            assert page.headers["content-type"].startswith("text/html")
            assert "0 answers outside the allowed regions" in page.text
            backwards = await a.get("/v1/reports/compliance", params={"from": 10, "to": 5})
            assert backwards.status_code == 422
