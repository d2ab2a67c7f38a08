"""``gtm report compliance`` on a store with real decisions: 0 answers outside the allowed
regions, recomputed from the recorded inputs; a row edited to answer chat.eu from the US is
found by the recomputation (the row's own outcome is not trusted) and by the chains."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.gtm.cli.test_cli import ROOT, env, run  # noqa: F401 (env is a fixture)

SEED = """
import asyncio
from ipaddress import ip_address
from gtm.settings import load_settings
from gtm.runtime import Runtime
from gtm.audit.record import record_of
from gtm.decision.routing import DecisionRequest, Channel, decide
from gtm.fleet.region_state import RegionEvent
from gtm.fleet.shared_state import append_events

async def main():
    rt = Runtime(load_settings())
    await rt.start()
    for i in range(40):
        for service, name in (("chat", "chat.gtm.example"), ("chat-eu", "chat.eu.gtm.example")):
            for client in (f"198.51.100.{i}", f"203.0.113.{i}", f"100.99.1.{i}"):
                req = DecisionRequest(Channel.DNS, ip_address(client), service, name)
                rt.count(record_of(decide(req, rt.store.current, 0.0), channel="dns", name=name))
    await append_events(rt.engine, [RegionEvent(1e9, "op", "eu-west", "override", "draining",
        "up", "drained", actor="alice", reason="<b>maintenance</b>"),
        # Refusals: a page view by a role without the read, and an attempted change.
        RegionEvent(1e9 + 1, "op", "-", "denied", None, None, "list_principals: roles viewer",
            actor="vic"),
        RegionEvent(1e9 + 2, "op", "-", "denied", None, None, "drain_region: roles viewer",
            actor="vic")])
    await rt.stop()

asyncio.run(main())
"""


def test_the_report_recomputes_every_answer_and_catches_an_edited_one(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    subprocess.run([sys.executable, "-c", SEED], env=env, cwd=ROOT, check=True, timeout=120)
    window = ["--from", "2000-01-01T00:00:00+00:00", "--to", "2999-01-01T00:00:00+00:00"]
    out = run(["report", "compliance", *window, "--format", "json"], env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["answers"] == 240
    assert report["outside_allowed"] == 0
    assert report["unverifiable"] == {}
    assert sum(report["by_service"].values()) == 240
    assert report["by_class"]["eu-personal"] == 120
    # chat.eu is answered only in the EU; the rest wherever is nearest.
    assert report["by_jurisdiction"].get("EU", 0) >= 120
    assert report["verification"]["breaks"] == []
    assert report["operator_actions"][0]["actor"] == "alice"
    # The refused page view changed nothing: counted, not an operator action; the refused
    # change is listed.
    listed = [a["detail"] for a in report["operator_actions"]]
    assert "drain_region: roles viewer" in listed
    assert "list_principals: roles viewer" not in listed and report["refused_reads"] == 1
    # Residency class by the jurisdiction that served it: EU personal data only in the EU.
    eu = report["by_class_jurisdiction"]["eu-personal"]
    assert set(eu) <= {"EU", "(not answered)"} and sum(eu.values()) == 120 and eu["EU"] > 0
    assert sum(report["by_class_jurisdiction"]["(unclassified)"].values()) == 120
    (policy,) = report["policies"].values()
    assert policy["answers"] == 240

    html_file = tmp_path / "report.html"
    page = run(["report", "compliance", *window, "-o", str(html_file)], env)
    assert page.returncode == 0, page.stderr
    html = html_file.read_text()
    assert "0 answers outside the allowed regions, recomputed" in html
    assert "<svg" in html and "eu-personal" in html
    assert "&lt;b&gt;maintenance&lt;/b&gt;" in html and "<b>maintenance" not in html
    assert "<table id=class-jurisdiction>" in html and "(not answered)" in html
    assert "1 refused page views" in html
    assert "<p>None.</p>" not in html  # every empty table says what there is none of

    # Someone with the database password moves an EU answer to the US.
    db = sqlite3.connect(env["GTM_DATABASE_URL"].removeprefix("sqlite:///"))
    with db:
        db.execute(
            "UPDATE decisions SET region = 'us-east' WHERE id = "
            "(SELECT min(id) FROM decisions WHERE service = 'chat-eu' AND region IS NOT NULL)"
        )
    db.close()
    tampered = run(["report", "compliance", *window, "--format", "json"], env)
    assert tampered.returncode == 1
    found = json.loads(tampered.stdout)
    assert found["outside_allowed"] >= 1
    assert found["outside_examples"][0]["region"] == "us-east"
    assert found["verification"]["breaks"]
    # Retention refuses to remove rows while the store does not verify.
    refused = run(["audit", "retain", "--before", "2999-01-01T00:00:00+00:00", "--yes"], env)
    assert refused.returncode == 1 and "refusing retention" in refused.stderr


def test_retention_from_the_command_line(env: dict[str, str]) -> None:  # noqa: F811
    subprocess.run([sys.executable, "-c", SEED], env=env, cwd=ROOT, check=True, timeout=120)
    cut = ["audit", "retain", "--before", "2999-01-01T00:00:00+00:00"]
    dry = run(cut, env)
    assert dry.returncode == 0 and "would remove up to" in dry.stdout
    done = run([*cut, "--yes"], env)
    assert done.returncode == 0, done.stderr
    assert "cli-node:" in done.stdout and "cut signed" in done.stdout
    verify = run(["audit", "verify"], env)
    assert verify.returncode == 0, verify.stdout
    assert "CUT cli-node#" in verify.stdout and "0 decision row(s)" in verify.stdout
