"""Activating a version that sends answers out of their jurisdiction needs each leak named, in
the API and the CLI alike (the console asks the same way), and the acknowledgement is recorded
with the activation, with its counts."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import subprocess
import sys
import time
from ipaddress import ip_address
from typing import Any

import pytest

from gtm.admin.console import policies as console_policies
from gtm.admin.permissions import Role
from gtm.audit.record import record_of
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.fleet import shared_state
from tests.conftest import ROOT
from tests.gtm.admin.conftest import Admin, AdminFactory, documents, loosen_eu, run_gtm
from tests.gtm.admin.console_client import post_form, sign_in

US = "203.0.113.10"  # Washington in the test GeoIP data


async def _record_eu_personal_from_the_us(admin: Admin, answers: int) -> None:
    """Recorded traffic the loosened policy would move from the EU to the US."""
    runtime = admin.runtime
    name = "chat.eu.gtm.example."
    request = DecisionRequest(Channel.DNS, ip_address(US), "chat-eu", name)
    decision = decide(request, runtime.store.current, time.time())
    runtime.writer.count(record_of(decision, channel="dns", name=name), answers)
    await runtime.writer.flush()


async def _approved_leaking_proposal(admin: Admin) -> tuple[int, str]:
    """Proposal #N loosening the EU policy, approved by bob; (N, bob's token)."""
    alice = await admin.token("alice", Role.POLICY_AUTHOR)
    bob = await admin.token("bob", Role.POLICY_APPROVER)
    async with admin.client(alice) as a, admin.client(bob) as b:
        p = (await a.post("/v1/proposals", json={**documents(loosen_eu), "reason": "x"})).json()
        assert (await a.post(f"/v1/proposals/{p['id']}/submit")).status_code == 200
        r = await b.post(f"/v1/proposals/{p['id']}/approve", json={"version": p["version"]})
        assert r.status_code == 200, r.text
    return p["id"], bob


async def _acknowledgements(admin: Admin) -> list[str]:
    events = await shared_state.read_events(admin.runtime.engine, "-", 100)
    return [f"{e.actor}: {e.detail}" for e in events if "acknowledged" in e.detail]


async def test_the_api_refuses_an_unacknowledged_leak_and_records_the_acknowledged_one(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        await _record_eu_personal_from_the_us(admin, 1000)
        pid, bob = await _approved_leaking_proposal(admin)
        path = f"/v1/proposals/{pid}/activate"
        async with admin.client(bob) as b:
            # No acknowledgement, one naming another leak, one with no body at all: refused,
            # with the leak and its count named.
            bodies: list[dict[str, Any] | None] = [
                {},
                {"acknowledge": "eu-personal EU→JP"},
                {"acknowledge": "EU→US"},
                None,
            ]
            for body in bodies:
                r = await b.post(path, json=body) if body is not None else await b.post(path)
                assert r.status_code == 409, (body, r.text)
                error = r.json()
                assert error["error"] == "leak_not_acknowledged"
                assert "acknowledge='eu-personal EU→US'" in error["message"]
                [problem] = error["problems"]
                assert problem["location"] == "eu-personal EU→US"
                assert problem["message"].startswith("1000 answers of class eu-personal")
            # Nothing was activated, nor acknowledged.
            assert (await b.get(f"/v1/proposals/{pid}")).json()["state"] == "approved"
            assert await _acknowledgements(admin) == []
            # Named (as a terminal types the arrow): activated, and the leak recorded with who
            # accepted it and the answers it stood for.
            r = await b.post(path, json={"acknowledge": " eu-personal  EU->US ;"})
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "active"
        [recorded] = await _acknowledgements(admin)
        assert recorded == (
            f"bob: #{pid}: answers leaving their jurisdiction acknowledged: "
            "eu-personal EU→US (1000 answers)"
        )


async def test_a_proposal_not_approved_is_refused_for_what_it_is_before_any_leak(
    start_admin: AdminFactory,
) -> None:
    """Activating a submitted proposal is refused because it is not approved (no day's replay
    first, and no leak to acknowledge for a version that cannot be activated anyway)."""
    async with start_admin() as admin:
        await _record_eu_personal_from_the_us(admin, 40)
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        async with admin.client(alice) as a, admin.client(bob) as b:
            p = (await a.post("/v1/proposals", json={**documents(loosen_eu), "reason": "x"})).json()
            assert (await a.post(f"/v1/proposals/{p['id']}/submit")).status_code == 200
            for body in ({}, {"at": time.time() + 3600}):
                r = await b.post(f"/v1/proposals/{p['id']}/activate", json=body)
                assert r.status_code == 409, r.text
                assert r.json()["error"] != "leak_not_acknowledged", r.text
                assert "not approved" in r.json()["message"], r.text
        assert await _acknowledgements(admin) == []


async def test_a_scheduled_activation_needs_the_acknowledgement_too(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        await _record_eu_personal_from_the_us(admin, 40)
        pid, bob = await _approved_leaking_proposal(admin)
        later = time.time() + 3600
        async with admin.client(bob) as b:
            r = await b.post(f"/v1/proposals/{pid}/activate", json={"at": later})
            assert r.status_code == 409 and r.json()["error"] == "leak_not_acknowledged"
            r = await b.post(
                f"/v1/proposals/{pid}/activate",
                json={"at": later, "acknowledge": "eu-personal EU→US"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["activate_at"] == pytest.approx(later)
        assert len(await _acknowledgements(admin)) == 1


async def test_the_cli_shows_the_leak_and_activates_only_when_it_is_acknowledged(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        await _record_eu_personal_from_the_us(admin, 1000)
        pid, bob = await _approved_leaking_proposal(admin)
        env = {"GTM_ADMIN_URL": admin.url, "GTM_ADMIN_TOKEN": bob}
        refused = await asyncio.to_thread(run_gtm, ["proposal", "activate", str(pid)], env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "would send answers out of their jurisdiction" in refused.stderr
        assert "eu-personal EU→US: 1000 answers of class eu-personal" in refused.stderr
        hint = f"gtm proposal activate {pid} --acknowledge-leak 'eu-personal EU->US'"
        assert hint in refused.stderr
        wrong = await asyncio.to_thread(
            run_gtm,
            ["proposal", "activate", str(pid), "--acknowledge-leak", "eu-personal EU->JP"],
            env,
        )
        assert wrong.returncode == 1 and hint in wrong.stderr
        assert await _acknowledgements(admin) == []
        # The command the refusal printed, as printed, activates.
        active = await asyncio.to_thread(
            run_gtm,
            ["proposal", "activate", str(pid), "--acknowledge-leak", "eu-personal EU->US"],
            env,
        )
        assert active.returncode == 0, active.stdout + active.stderr
        assert f"#{pid} active" in active.stdout
        [recorded] = await _acknowledgements(admin)
        assert recorded.startswith("bob: ") and "eu-personal EU→US (1000 answers)" in recorded
        # Times as people read them, not unix seconds.
        shown = await asyncio.to_thread(run_gtm, ["proposal", "show", str(pid)], env)
        assert shown.returncode == 0, shown.stderr
        stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \((now|\d+ (s|min) ago)\)"
        assert re.search(rf"^  created {stamp}$", shown.stdout, re.M), shown.stdout
        assert re.search(rf"^  active since {stamp}, sequence 1$", shown.stdout, re.M)
        assert not re.search(r"\b1\d{9}\b", shown.stdout)  # no raw epoch


async def test_the_console_asks_again_when_the_api_finds_a_leak_its_check_missed(
    start_admin: AdminFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Traffic that moves between the console's check and the activation: the API refuses, and
    the console names the leak and asks, rather than showing a refusal."""
    async with start_admin() as admin:
        await _record_eu_personal_from_the_us(admin, 1000)
        pid, _ = await _approved_leaking_proposal(admin)
        approver = await admin.token("ann", Role.POLICY_APPROVER)
        # The console's own check sees no traffic (a window of a microsecond); the API's, a day.
        monkeypatch.setattr(console_policies, "LEAK_WINDOW_S", 1e-6)
        page_url = f"/console/policies/{pid}"
        async with sign_in(admin.url, approver) as client:
            asked = await post_form(client, page_url, page_url + "/activate", {"at": ""})
            assert asked.status_code == 409, asked.text
            confirm = asked.text.split('id="confirm-leak"', 1)[1].split("</section>", 1)[0]
            assert "<strong>1000</strong> answers of class <code>eu-personal</code>" in confirm
            assert re.search(r'name="acknowledge" value="eu-personal EU→US"', confirm)
        async with admin.client(approver) as a:
            assert (await a.get(f"/v1/proposals/{pid}")).json()["state"] == "approved"


def _gtm_at_a_terminal(
    args: list[str], env: dict[str, str], answer: str
) -> subprocess.CompletedProcess[str]:
    """The CLI with a terminal on stdin (a pseudo-terminal), typed ``answer`` into."""
    master, slave = pty.openpty()
    try:
        os.write(master, answer.encode())
        return subprocess.run(
            [sys.executable, "-m", "gtm", *args],
            env=os.environ | env,
            stdin=slave,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    finally:
        os.close(slave)
        os.close(master)


async def test_at_a_terminal_the_cli_asks_and_a_yes_acknowledges_the_leaks_it_listed(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        await _record_eu_personal_from_the_us(admin, 1000)
        pid, bob = await _approved_leaking_proposal(admin)
        env = {"GTM_ADMIN_URL": admin.url, "GTM_ADMIN_TOKEN": bob}
        args = ["proposal", "activate", str(pid)]
        no = await asyncio.to_thread(_gtm_at_a_terminal, args, env, "n\n")
        assert no.returncode == 1, no.stdout + no.stderr
        assert "Activate anyway, acknowledging each of these?" in no.stderr
        assert await _acknowledgements(admin) == []
        yes = await asyncio.to_thread(_gtm_at_a_terminal, args, env, "y\n")
        assert yes.returncode == 0, yes.stdout + yes.stderr
        assert "eu-personal EU→US: 1000 answers" in yes.stderr and f"#{pid} active" in yes.stdout
        [recorded] = await _acknowledgements(admin)
        assert recorded.startswith("bob: ") and "eu-personal EU→US (1000 answers)" in recorded
