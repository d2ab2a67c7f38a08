"""The console over real HTTP on loopback: sign-in, the session cookie and its idle timeout,
CSRF and origin checks, escaping of everything people type, actions offered by role and refused
by the API, and the pages' data (regions on the map, live flows, decisions, evidence)."""

from __future__ import annotations

import json
import os
import re
import time
from ipaddress import ip_address
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet
from markupsafe import escape

from gtm.admin.console.session import COOKIE, Session, SessionCodec, load_key
from gtm.admin.permissions import Role
from gtm.audit.record import record_of
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.errors import ConfigError
from tests.gtm.admin.conftest import Admin, AdminFactory, documents
from tests.gtm.admin.console_client import csrf_of, post_form, sign_in
from tests.support.waiting import eventually

XSS = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def count(admin: Admin, client: str, times: int = 1) -> str:
    """Decide for ``client`` asking the first service's host, count it ``times`` into the audit
    writer as an answering path would; the host name asked."""
    snapshot = admin.runtime.store.current
    service = snapshot.topology.services[0]
    name = service.http_hosts[0]
    request = DecisionRequest(Channel.API, ip_address(client), service.id, name)
    for _ in range(times):
        decision = decide(request, snapshot, time.time())
        admin.runtime.count(record_of(decision, channel="api", name=name))
    return name


async def test_signing_in_sets_a_strict_http_only_cookie_and_shows_who_you_are(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        token = await admin.token("olga", Role.OPERATOR, Role.VIEWER)
        async with httpx.AsyncClient(base_url=admin.url) as anonymous:
            first = await anonymous.get("/console/")
            assert first.status_code == 303
            assert first.headers["location"].startswith("/console/signin")
        async with sign_in(admin.url, token) as client:
            cookie = next(c for c in client.cookies.jar if c.name == COOKIE)  # the session cookie
            assert cookie.has_nonstandard_attr("HttpOnly")
            assert cookie.get_nonstandard_attr("SameSite") == "strict"
            assert token not in cookie.value  # encrypted, not the token in the clear
            page = await client.get("/console/")
            assert page.status_code == 200
            assert "olga" in page.text and "operator" in page.text
            assert "default-src 'self'" in page.headers["content-security-policy"]
            assert page.headers["x-frame-options"] == "DENY"


async def test_a_bad_token_does_not_sign_in(start_admin: AdminFactory) -> None:
    async with start_admin() as admin, httpx.AsyncClient(base_url=admin.url) as client:
        form = await client.get("/console/signin")
        reply = await client.post(
            "/console/signin", data={"token": "gtm_nope.nope", "csrf": csrf_of(form.text)}
        )
        assert reply.status_code == 401
        assert "not valid" in reply.text
        assert COOKIE not in client.cookies


async def test_the_sign_in_form_needs_its_csrf_cookie(start_admin: AdminFactory) -> None:
    """Login CSRF: a cross-site page cannot sign a victim in as the attacker."""
    async with start_admin() as admin:
        token = await admin.token("olga", Role.OPERATOR)
        async with httpx.AsyncClient(base_url=admin.url) as client:
            reply = await client.post("/console/signin", data={"token": token, "csrf": "guess"})
            assert reply.status_code == 403
            assert COOKIE not in client.cookies


async def test_a_forged_or_missing_csrf_token_is_403_and_changes_nothing(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        token = await admin.token("olga", Role.OPERATOR)
        async with sign_in(admin.url, token) as client:
            for fields in ({"reason": "x"}, {"reason": "x", "csrf": "forged"}):
                reply = await client.post("/console/regions/eu-west/drain", data=fields)
                assert reply.status_code == 403
                assert "Nothing was changed" in reply.text
            # The right token from another site's page (Origin names it): refused too.
            html_page = (await client.get("/console/")).text
            reply = await client.post(
                "/console/regions/eu-west/drain",
                data={"reason": "x", "csrf": csrf_of(html_page)},
                headers={"origin": "https://attacker.example"},
            )
            assert reply.status_code == 403
        async with admin.client(token) as api:
            regions = {r["region"]: r for r in (await api.get("/v1/regions")).json()}
        assert regions["eu-west"]["override"] is None


async def test_an_operator_drains_a_region_and_the_map_shows_it(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        token = await admin.token("olga", Role.OPERATOR)
        async with sign_in(admin.url, token) as client:
            reply = await post_form(
                client,
                "/console/",
                "/console/regions/eu-west/drain",
                {"reason": "maintenance window", "for": "1h"},
            )
            assert reply.status_code == 303
            page = await client.get(reply.headers["location"])
            assert "eu-west: drain done" in page.text
            live = await client.get("/console/fleet/live")
            assert 'data-region="eu-west" data-state="draining"' in live.text
            assert 'data-region="us-east" data-state="up"' in live.text or (
                'data-region="us-east" data-state="unknown"' in live.text
            )
        async with admin.client(token) as api:
            events = (await api.get("/v1/events", params={"region": "eu-west"})).json()
        assert any(e["actor"] == "olga" and e["reason"] == "maintenance window" for e in events)


async def test_a_safety_refusal_is_shown_plainly(start_admin: AdminFactory) -> None:
    """Draining every EU region breaks the topology's safety rule for EU personal data: the API
    refuses (409) with the rule, and the console shows that rule, not a generic error."""
    async with start_admin() as admin:
        token = await admin.token("olga", Role.OPERATOR)
        async with sign_in(admin.url, token) as client:
            first = await post_form(
                client, "/console/", "/console/regions/eu-west/drain", {"reason": "one"}
            )
            assert first.status_code == 303
            second = await post_form(
                client, "/console/", "/console/regions/eu-central/drain", {"reason": "two"}
            )
            assert second.status_code == 409
            assert "Refused: nothing was changed" in second.text
            assert "safety" in second.text


async def test_actions_are_offered_by_role_and_the_api_refuses_the_rest(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        viewer = await admin.token("vic", Role.VIEWER)
        async with sign_in(admin.url, viewer) as client:
            page = await client.get("/console/")
            assert "/console/regions/eu-west/drain" not in page.text  # not offered
            assert 'href="/console/decisions"' not in page.text  # auditors only
            # Posted anyway, with a valid CSRF token: the API's 403, and nothing happens.
            reply = await client.post(
                "/console/regions/eu-west/drain",
                data={"reason": "just looking", "csrf": csrf_of(page.text)},
            )
            assert reply.status_code == 403
            assert "Refused" in reply.text
        async with admin.client(viewer) as api:
            regions = {r["region"]: r for r in (await api.get("/v1/regions")).json()}
            denied = (await api.get("/v1/events", params={"region": "-"})).json()
        assert regions["eu-west"]["override"] is None
        assert any(e["kind"] == "denied" and e["actor"] == "vic" for e in denied)


async def test_four_eyes_in_the_browser_and_html_is_escaped_everywhere(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        author = await admin.token(XSS, Role.POLICY_AUTHOR, Role.POLICY_APPROVER)
        approver = await admin.token("ann", Role.POLICY_APPROVER)
        body = documents()
        fields = {"topology": body["topology"], "reason": XSS}
        fields |= {f"policy:{name}": text for name, text in body["policies"].items()}
        fields["policy:eu-personal.yaml"] = (
            fields["policy:eu-personal.yaml"]
            .replace("jurisdictions: [EU]", "jurisdictions: [EU, US]")
            .replace("description: EU personal data stays in the EU.", f"description: {XSS}")
        )
        async with sign_in(admin.url, author) as client:
            created = await post_form(client, "/console/policies", "/console/policies/new", fields)
            assert created.status_code == 303, created.text
            page_url = created.headers["location"]
            submitted = await post_form(client, page_url, page_url + "/submit", {})
            assert submitted.status_code == 303
            page = await client.get(page_url)
            assert "proposed" in page.text
            assert "/approve" not in page.text  # the author is never offered approval
            assert "cannot approve it (four eyes)" in page.text
            diff = page.text.split('<pre class="diff">', 1)[1].split("</pre>", 1)[0]
            assert "&lt;script&gt;" in diff and "<script>" not in diff  # the policy's text
            forced = await post_form(
                client, page_url, page_url + "/approve", {"version": "x", "comment": ""}
            )
            assert forced.status_code in (403, 409)
            for text in (page.text, (await client.get("/console/policies")).text):
                assert XSS not in text
                assert str(escape(XSS)) in text
        async with sign_in(admin.url, approver) as client:
            page = await client.get(page_url)
            assert "/approve" in page.text
            assert '<span class="add">+    - US</span>' in page.text  # the diff, readable
            impact = await post_form(client, page_url, page_url + "/impact", {"since_h": "1"})
            assert impact.status_code == 200
            assert 'id="impact"' in impact.text
            async with admin.client(approver) as api:
                proposal_id = page_url.rsplit("/", 1)[1]
                version = (await api.get(f"/v1/proposals/{proposal_id}")).json()["version"]
            approved = await post_form(
                client, page_url, page_url + "/approve", {"version": version, "comment": XSS}
            )
            assert approved.status_code == 303
            page = await client.get(page_url)
            assert "approved" in page.text
            assert XSS not in page.text


async def test_live_flows_come_from_the_audit_store(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        token = await admin.token("vic", Role.VIEWER)
        count(admin, "100.65.1.1", times=30)

        async def flowing() -> bool:
            async with admin.client(token) as api:
                body = (await api.get("/v1/traffic", params={"window_s": 60})).json()
            return body["answers"] >= 30

        await eventually(flowing, within=20, what="the writer to flush 30 answers")
        async with sign_in(admin.url, token) as client:
            live = await client.get("/console/fleet/live")
        assert 'data-from="GB"' in live.text  # London in the test GeoIP


async def test_an_idle_session_ends_with_a_message(
    start_admin: AdminFactory, tmp_path: Path
) -> None:
    key = tmp_path / "console.key"
    key.write_bytes(os.urandom(48))
    key.chmod(0o600)
    async with start_admin(console_key_file=key) as admin:
        token = await admin.token("olga", Role.OPERATOR)
        codec = SessionCodec(load_key(key), idle_s=900, max_age_s=43200)
        long_ago = time.time() - 3600
        stale = codec.seal(Session("s1", token, "c", long_ago, long_ago))
        async with httpx.AsyncClient(base_url=admin.url, cookies={COOKIE: stale}) as client:
            reply = await client.get("/console/")
            assert reply.status_code == 303
            follow = await client.get(reply.headers["location"])
            assert "session has expired" in follow.text
        fresh = codec.seal(Session("s2", token, "c", time.time(), time.time()))
        async with httpx.AsyncClient(base_url=admin.url, cookies={COOKIE: fresh}) as client:
            assert (await client.get("/console/")).status_code == 200
        # A cookie sealed with another key is no session at all.
        other = SessionCodec(Fernet.generate_key(), idle_s=900, max_age_s=43200)
        forged = other.seal(Session("s3", token, "c", time.time(), time.time()))
        async with httpx.AsyncClient(base_url=admin.url, cookies={COOKIE: forged}) as client:
            reply = await client.get("/console/")
            assert reply.status_code == 303 and "expired" not in reply.headers["location"]


async def test_signing_out_ends_the_session_even_if_the_cookie_is_kept(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        token = await admin.token("olga", Role.OPERATOR)
        async with sign_in(admin.url, token) as client:
            kept = client.cookies[COOKIE]
            out = await post_form(client, "/console/", "/console/signout", {})
            assert out.status_code == 303
        async with httpx.AsyncClient(base_url=admin.url, cookies={COOKIE: kept}) as replay:
            reply = await replay.get("/console/")
            assert reply.status_code == 303


def test_a_loose_console_key_file_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "console.key"
    key.write_bytes(os.urandom(48))
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="must be 0600"):
        load_key(key)


async def test_decisions_search_explain_replay_and_export(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        token = await admin.token("audrey", Role.AUDITOR)
        name = count(admin, "198.51.100.7")

        async def written() -> bool:
            async with admin.client(token) as api:
                return bool((await api.get("/v1/decisions")).json()["rows"])

        await eventually(written, within=20, what="the decision row")
        async with sign_in(admin.url, token) as client:
            search = await client.get("/console/decisions", params={"name": name})
            assert "198.51.100.0/24" in search.text
            found = re.search(r'href="(/console/decisions/[^"?]+)">explain', search.text)
            assert found, "no explain link"
            explain_path = found.group(1)
            explained = await client.get(explain_path)
            assert explained.status_code == 200
            assert "Every candidate region and why" in explained.text
            replayed = await post_form(client, explain_path, explain_path + "/replay", {})
            assert replayed.status_code == 200
            assert "Same decision" in replayed.text
            exported = await client.get(
                "/console/decisions/export", params={"format": "jsonl", "name": name}
            )
            assert exported.status_code == 200
            rows = [json.loads(line) for line in exported.text.splitlines()]
            assert rows and rows[0]["client_network"] == "198.51.100.0/24"


async def test_an_admin_makes_a_principal_issues_a_token_once_and_revokes_it(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        root = await admin.token("root", Role.ADMIN)
        async with sign_in(admin.url, root) as client:
            made = await post_form(
                client,
                "/console/access",
                "/console/access/principals",
                {"name": "pat", "role:auditor": "on", "role:viewer": "on"},
            )
            assert made.status_code == 303
            # Nobody mints a token for someone else: the admin's form for pat is refused.
            other = await post_form(
                client, "/console/access", "/console/access/tokens", {"principal": "pat"}
            )
            assert other.status_code == 403 and "only for themself" in other.text
            issued = await post_form(
                client, "/console/access", "/console/access/tokens", {"principal": "root"}
            )
            assert issued.status_code == 201
            assert issued.headers["cache-control"] == "no-store"
            token = re.search(r'id="issued-token" readonly size="70" value="([^"]+)"', issued.text)
            assert token, "the new token is shown once"
            again = await client.get("/console/access")
            assert token.group(1) not in again.text  # and never again
        async with sign_in(admin.url, token.group(1)) as second:
            page = await second.get("/console/")
            assert "root" in page.text and "admin" in page.text
        pat = await admin.token("pat")  # pat's own token, from the key file's holder
        async with sign_in(admin.url, pat) as client:
            page = await client.get("/console/")
            assert "pat" in page.text and "auditor" in page.text
        async with sign_in(admin.url, root) as client:
            listing = (await client.get("/console/access")).text
            token_id = token.group(1).split("_")[1]  # gtm_<id>_<secret>
            target = f"/console/access/tokens/{token_id}/revoke"
            assert f'action="{target}"' in listing
            assert (await post_form(client, "/console/access", target, {})).status_code == 303
        async with httpx.AsyncClient(base_url=admin.url) as client:
            form = await client.get("/console/signin")
            refused = await client.post(
                "/console/signin", data={"token": token.group(1), "csrf": csrf_of(form.text)}
            )
            assert refused.status_code == 401


async def test_power_granted_in_the_console_takes_a_second_admin(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        root = await admin.token("root", Role.ADMIN)
        ida = await admin.token("ida", Role.ADMIN)
        async with sign_in(admin.url, root) as client:
            made = await post_form(
                client,
                "/console/access",
                "/console/access/principals",
                {"name": "paula", "role:policy-approver": "on"},
            )
            assert made.status_code == 303
            page = await client.get("/console/access")
            assert "waiting for another admin" in page.text
            assert "/console/access/grants/1/approve" not in page.text  # not for its proposer
            # Forged past the hidden button: the API refuses it too.
            refused = await post_form(
                client, "/console/access", "/console/access/grants/1/approve", {}
            )
            assert refused.status_code == 403
        async with sign_in(admin.url, ida) as client:
            page = await client.get("/console/access")
            assert 'action="/console/access/grants/1/approve"' in page.text
            approved = await post_form(
                client, "/console/access", "/console/access/grants/1/approve", {}
            )
            assert approved.status_code == 303
            page = await client.get("/console/access")
            assert "approved by ida" in page.text


async def test_an_auditor_opens_the_compliance_report(start_admin: AdminFactory) -> None:
    async with start_admin() as admin:
        token = await admin.token("audrey", Role.AUDITOR)
        async with sign_in(admin.url, token) as client:
            events = await client.get("/console/events")
            assert "/console/reports/compliance" in events.text
            report = await client.get("/console/reports/compliance")
            assert report.status_code == 200
            assert "<script" not in report.text
            assert "default-src 'none'" in report.headers["content-security-policy"]


async def test_the_evidence_page_shows_each_chain_and_the_verification(
    start_admin: AdminFactory,
) -> None:
    async with start_admin(audit_checkpoint_interval_s=0.5) as admin:
        token = await admin.token("audrey", Role.AUDITOR)
        count(admin, "198.51.100.7")

        async def listed() -> bool:
            async with admin.client(token) as api:
                chains = (await api.get("/v1/audit/chains")).json()["chains"]
            return any(c["chain"] == "admin-test" and c["last_checkpoint"] for c in chains)

        await eventually(listed, within=30, what="a signed checkpoint of the node's chain")
        async with sign_in(admin.url, token) as client:
            page = await client.get("/console/events")
        assert 'data-chain="admin-test"' in page.text
        assert 'id="verification"' in page.text
