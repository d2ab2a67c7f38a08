"""The console's pages as a person reads them, over real HTTP on loopback: no Python repr or raw
JSON on a page, decisions newest first and found by name with or without the trailing dot, a
decision linked to the proposal that carried its documents, a replay as a table, the new-proposal
form that keeps what was typed, a draft that changes nothing refused (API and console), impact
tables in words, the rollout line, the favicon, and a refused page view titled as a view."""

from __future__ import annotations

import re
import time
from ipaddress import ip_address

import httpx

from gtm.admin.console.decisions import decision_link
from gtm.admin.permissions import Role
from gtm.audit.record import record_of
from gtm.decision.routing import Channel, DecisionRequest, decide
from tests.gtm.admin.conftest import Admin, AdminFactory, documents, loosen_eu
from tests.gtm.admin.console_client import csrf_of, post_form, sign_in
from tests.support.waiting import eventually

EU_NAME = "chat.eu.gtm.example"


def count(admin: Admin, client: str, *, channel: Channel, name: str) -> None:
    """One answer for ``client`` asking ``name`` (the chat-eu service), counted into the audit
    writer as the answering path of ``channel`` would."""
    snapshot = admin.runtime.store.current
    request = DecisionRequest(channel, ip_address(client), "chat-eu", name.rstrip("."))
    decision = decide(request, snapshot, time.time())
    admin.runtime.count(record_of(decision, channel=channel.value, name=name))


async def wait_rows(admin: Admin, token: str, n: int) -> None:
    async def written() -> bool:
        async with admin.client(token) as api:
            return len((await api.get("/v1/decisions")).json()["rows"]) >= n

    await eventually(written, within=20, what=f"{n} decision rows")


async def test_decisions_newest_first_found_with_or_without_the_trailing_dot(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        token = await admin.token("audrey", Role.AUDITOR)
        # A DNS row (the absolute name, with its dot), then later an HTTP row (the host).
        count(admin, "198.51.100.7", channel=Channel.DNS, name=EU_NAME + ".")
        await wait_rows(admin, token, 1)
        count(admin, "203.0.113.9", channel=Channel.API, name=EU_NAME)
        await wait_rows(admin, token, 2)
        async with admin.client(token) as api:
            for asked in (EU_NAME, EU_NAME + ".", EU_NAME.upper()):
                rows = (await api.get("/v1/decisions", params={"name": asked})).json()["rows"]
                assert {r["name"] for r in rows} == {EU_NAME, EU_NAME + "."}, asked
            first = (await api.get("/v1/decisions", params={"order": "newest", "limit": 1})).json()
            assert first["rows"][0]["client_network"] == "203.0.113.0/24"
            older = await api.get(
                "/v1/decisions", params={"order": "newest", "limit": 1, "after": first["next"]}
            )
            assert older.json()["rows"][0]["client_network"] == "198.51.100.0/24"
            oldest_first = (await api.get("/v1/decisions")).json()["rows"]
            assert oldest_first[0]["client_network"] == "198.51.100.0/24"  # the API's default
        async with sign_in(admin.url, token) as client:
            page = (await client.get("/console/decisions", params={"name": EU_NAME})).text
        assert "newest first" in page
        # Outcomes in words, their values kept for the search.
        assert '<option value="fail_closed" >failed closed (refused)</option>' in page
        assert "<td>answered</td>" in page and "<td>answer</td>" not in page
        newer, older_at = page.find("203.0.113.0/24"), page.find("198.51.100.0/24")
        assert 0 <= newer < older_at, "the newer row is not listed first"


async def test_a_decision_links_its_documents_to_the_proposal_and_replays_as_a_table(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        auditor = await admin.token("audrey", Role.AUDITOR, Role.VIEWER)
        author = await admin.token("pat", Role.POLICY_AUTHOR)
        async with admin.client(author) as api:
            # The nodes' own documents, stored as a version by a draft: the hashes a decision
            # made now records are that version's.
            draft = (await api.post("/v1/proposals", json=documents() | {"reason": "r"})).json()
        count(admin, "198.51.100.7", channel=Channel.API, name=EU_NAME)
        await wait_rows(admin, auditor, 1)
        async with admin.client(auditor) as api:
            row = (await api.get("/v1/decisions")).json()["rows"][0]
        async with sign_in(admin.url, auditor) as client:
            search = await client.get("/console/decisions")
            found = re.search(r'href="(/console/decisions/[^"?]+)">explain', search.text)
            assert found
            explained = await client.get(found.group(1))
            assert row["policy_version"] in explained.text
            assert f"version <code>{draft['version'][:12]}</code>" in explained.text
            assert f'href="/console/policies/{draft["id"]}">proposal #{draft["id"]}' in (
                explained.text
            )
            replayed = await post_form(client, found.group(1), found.group(1) + "/replay", {})
        assert replayed.status_code == 200
        replay = replayed.text.split('id="replay"', 1)[1]
        assert "Verdict for eu-west" in replay and "Outcome" in replay
        assert "{" not in replay and "&#34;" not in replay  # no dict, no JSON


async def test_the_new_proposal_form_keeps_what_was_typed_and_bad_urls_are_pages(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        author = await admin.token("pat", Role.POLICY_AUTHOR)
        async with sign_in(admin.url, author) as client:
            new = await client.get("/console/policies/new")
            assert new.status_code == 303 and new.headers["location"] == "/console/policies#new"
            for path in (
                "/console/policies/not-a-number",
                "/console/policies/99x/submit",
                "/console/no-such-page",
            ):
                lost = await client.get(path)
                assert lost.status_code in (404, 405), path
                assert lost.headers["content-type"].startswith("text/html"), path
                assert '"problems"' not in lost.text and '"detail"' not in lost.text
            body = documents()
            fields = {"topology": body["topology"], "reason": "tighten the EU rule"}
            fields |= {f"policy:{name}": text for name, text in body["policies"].items()}
            fields["policy:eu-personal.yaml"] += "\nnot_a_field: [unclosed\n"
            refused = await post_form(client, "/console/policies", "/console/policies/new", fields)
        assert refused.status_code == 422
        assert refused.headers["content-type"].startswith("text/html")
        assert "The draft was not saved" in refused.text
        assert "not_a_field: [unclosed" in refused.text  # the typed text is still in the form
        assert 'value="tighten the EU rule"' in refused.text
        assert 'id="refusal"' in refused.text and "eu-personal.yaml" in refused.text


async def test_a_draft_that_changes_nothing_is_refused_at_submission(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        author = await admin.token("pat", Role.POLICY_AUTHOR)
        approver = await admin.token("ann", Role.POLICY_APPROVER)
        async with admin.client(author) as api:
            same = (await api.post("/v1/proposals", json=documents() | {"reason": "r"})).json()
            refused = await api.post(f"/v1/proposals/{same['id']}/submit")
            assert refused.status_code == 409
            assert "changes nothing" in refused.json()["message"]
            assert (await api.get(f"/v1/proposals/{same['id']}")).json()["state"] == "draft"
            changed = await api.post(
                "/v1/proposals", json=documents(loosen_eu) | {"reason": "let the US in"}
            )
            pid = changed.json()["id"]
            assert (await api.post(f"/v1/proposals/{pid}/submit")).status_code == 200
        async with admin.client(approver) as api:
            version = (await api.get(f"/v1/proposals/{pid}")).json()["version"]
            approved = await api.post(f"/v1/proposals/{pid}/approve", json={"version": version})
            assert approved.status_code == 200, approved.text
            activated = await api.post(f"/v1/proposals/{pid}/activate", json={})
            assert activated.status_code == 200, activated.text
        async with admin.client(author) as api:
            # Now the loosened documents are in force: proposing them again changes nothing.
            again = await api.post("/v1/proposals", json=documents(loosen_eu) | {"reason": "again"})
            refused = await api.post(f"/v1/proposals/{again.json()['id']}/submit")
            assert refused.status_code == 409 and "changes nothing" in refused.json()["message"]
        async with sign_in(admin.url, author) as client:
            page_url = f"/console/policies/{again.json()['id']}"
            shown = await post_form(client, page_url, page_url + "/submit", {})
        assert shown.status_code == 409
        assert "changes nothing" in shown.text
        assert "Refused: nothing was changed" in shown.text  # a form: the words fit


async def test_impact_rollout_and_evidence_read_as_words(start_admin: AdminFactory) -> None:
    async with start_admin(audit_checkpoint_interval_s=0.5) as admin:
        author = await admin.token("pat", Role.POLICY_AUTHOR)
        approver = await admin.token("ann", Role.POLICY_APPROVER, Role.AUDITOR)
        count(admin, "100.67.0.5", channel=Channel.API, name=EU_NAME)  # Seattle asks, EU data
        await wait_rows(admin, approver, 1)
        async with admin.client(author) as api:
            created = await api.post(
                "/v1/proposals", json=documents(loosen_eu) | {"reason": "let the US in"}
            )
            pid = created.json()["id"]
            await api.post(f"/v1/proposals/{pid}/submit")
        page_url = f"/console/policies/{pid}"
        async with sign_in(admin.url, approver) as client:
            impact = await post_form(client, page_url, page_url + "/impact", {"since_h": "1"})
            assert impact.status_code == 200
            section = impact.text.split('id="impact"', 1)[1].split("</section>", 1)[0]
            assert "would leave their jurisdiction" in section
            for raw in ("newly_refused", "left_jurisdiction", "newly_answered", " -> "):
                assert raw not in section.replace('class="left-jurisdiction"', ""), raw
            assert "→" in section
            # Region ids and residency classes are names, shown as they are written.
            assert "<td>eu-west</td><td>us-west</td>" in section, section
            assert "<td>eu-personal</td>" in section and "eu personal" not in section
            version = (await client.get(page_url)).text
            version_id = re.search(r'name="version" value="([0-9a-f]+)"', version)
            assert version_id
            await post_form(client, page_url, page_url + "/approve", {"version": version_id[1]})
            await activate_acknowledging_the_leak(client, page_url)
            active = await client.get(page_url)
            rollout = active.text.split('id="rollout"', 1)[1].split("</p>", 1)[0]
            assert re.search(r"\d+ of \d+ nodes? acknowledged", rollout), rollout
            assert "(0 acknowledged)" not in rollout and not re.search(r"\w\(\d", rollout)
            evidence = await client.get("/console/events")
        assert "built-in method" not in evidence.text
        assert re.search(r"checkpoints, \d+ keys", evidence.text)


async def activate_acknowledging_the_leak(client: httpx.AsyncClient, page_url: str) -> None:
    """Activate in the console: asked first, with the leak named; then acknowledged."""
    asked = await post_form(client, page_url, page_url + "/activate", {"at": ""})
    assert asked.status_code == 409  # nothing activated yet
    confirm = asked.text.split('id="confirm-leak"', 1)[1].split("</section>", 1)[0]
    assert "would leave <strong>EU</strong> for <strong>US</strong>" in confirm
    assert "class <code>eu-personal</code>" in confirm
    key = re.search(r'name="acknowledge" value="([^"]+)"', confirm)
    assert key and key[1] == "eu-personal EU→US"
    # The acknowledgement without its box ticked is no acknowledgement.
    unticked = await client.post(
        page_url + "/activate", data={"csrf": csrf_of(asked.text), "acknowledge": key[1]}
    )
    assert unticked.status_code == 409
    assert "active" not in (await client.get(page_url)).text.split('id="proposal-state">', 1)[1][:8]
    done = await client.post(
        page_url + "/activate",
        data={"csrf": csrf_of(asked.text), "acknowledge": key[1], "understood": "on", "at": ""},
    )
    assert done.status_code == 303, done.text
    # The acknowledgement is evidence: in the event log, with who gave it.
    timeline = (await client.get("/console/events")).text
    assert "answers leaving their jurisdiction acknowledged: eu-personal EU→US" in timeline


async def test_favicon_is_served_and_a_refused_page_view_is_titled_as_a_view(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        viewer = await admin.token("vic", Role.VIEWER)
        async with sign_in(admin.url, viewer) as client:
            icon = await client.get("/favicon.ico", follow_redirects=True)
            assert icon.status_code == 200
            assert icon.headers["content-type"].startswith("image/svg+xml")
            fleet = await client.get("/console/")
            assert 'rel="icon"' in fleet.text
            access = await client.get("/console/access")
        assert access.status_code == 403
        assert "Refused: nothing was changed" not in access.text
        assert "Not shown: your roles do not include this page" in access.text
        assert csrf_of(access.text)  # still a signed-in page, with its sign-out form


async def test_the_compliance_report_opens_inside_the_console(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        auditor = await admin.token("audrey", Role.AUDITOR)
        async with sign_in(admin.url, auditor) as client:
            report = await client.get("/console/reports/compliance")
        assert report.status_code == 200
        nav = report.text.split('<header class="console-nav">', 1)[1].split("</header>", 1)[0]
        assert 'href="/console/events"' in nav and 'href="/console/decisions"' in nav
        assert "audrey" in nav
        assert "Residency class by serving jurisdiction" in report.text


async def test_a_decision_from_the_nodes_own_files_replays_after_a_version_is_activated(
    start_admin: AdminFactory,
) -> None:
    """Answered before any version was activated (from the node's files, stored nowhere), then
    a version goes into force: the decision still replays, on the files the node holds."""
    async with start_admin() as admin:
        auditor = await admin.token("audrey", Role.AUDITOR, Role.VIEWER)
        count(admin, "198.51.100.7", channel=Channel.API, name=EU_NAME)
        await wait_rows(admin, auditor, 1)
        author = await admin.token("pat", Role.POLICY_AUTHOR)
        approver = await admin.token("ann", Role.POLICY_APPROVER)
        async with admin.client(author) as a, admin.client(approver) as b:
            body = documents(loosen_eu) | {"reason": "r"}
            p = (await a.post("/v1/proposals", json=body)).json()
            assert (await a.post(f"/v1/proposals/{p['id']}/submit")).status_code == 200
            approve = {"version": p["version"]}
            assert (await b.post(f"/v1/proposals/{p['id']}/approve", json=approve)).is_success
            activated = await b.post(f"/v1/proposals/{p['id']}/activate", json={})
            assert activated.status_code == 200, activated.text
        async with admin.client(auditor) as api:
            row = (await api.get("/v1/decisions")).json()["rows"][-1]
            replayed = await api.post(f"/v1/decisions/{decision_link(row)}/replay")
        assert replayed.status_code == 200, replayed.text
        assert [x["matches"] for x in replayed.json()] == [True]
