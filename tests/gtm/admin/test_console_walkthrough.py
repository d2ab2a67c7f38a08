"""A newcomer's walk through the console in a real browser: each of the demo's people signs in,
follows every link the navigation and the pages offer, and does what their roles allow (draft,
submit, be refused by four-eyes, approve as someone else, review the impact, acknowledge the
leak and activate, drain and undrain, search decisions, explain and replay one, open the
compliance report, issue a token and add a principal). Every page reached must show no Python
repr, no raw JSON error, no browser console error, and no accessibility violation of serious or
critical impact (axe-core)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from playwright.async_api import Browser, ConsoleMessage, Page, Response, expect

from gtm.audit.record import record_of
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.demo.scenario import PEOPLE
from tests.gtm.admin.conftest import Admin, AdminFactory, loosen_eu
from tests.support import axe
from tests.support.waiting import eventually

# What a page must never show: Python's reprs, a traceback, a dict printed as it is.
REPR = re.compile(
    r"<built-in method|<bound method|<function [\w.]+ at|object at 0x[0-9a-f]+|"
    r"Traceback \(most recent call last\)|\{'\w+': "
)
# Clients the test GeoIP data places: Washington, Frankfurt, Tokyo.
CLIENTS = ("203.0.113.10", "198.51.100.7", "192.0.2.9")


@dataclass
class Walk:
    """One person's tab, and everything wrong it has seen."""

    page: Page
    base: str
    axe_js: Path
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # console errors since the last check
    documents: dict[str, tuple[int, str]] = field(default_factory=dict)  # url -> status, type
    expected: dict[str, int] = field(default_factory=dict)  # path -> a status the step expects
    seen: set[str] = field(default_factory=set)  # kinds of page this person has visited
    axed: set[str] = field(default_factory=set)  # kinds of page anyone has had axe check
    pages: int = 0

    def listen(self) -> None:
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        self.page.on("response", self._response)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type != "error":
            return
        where = str(message.location.get("url", ""))
        # A page answered with the status its step expects (a refusal is a 403, the leak
        # confirmation a 409): the browser logs the status, which is no fault of the page.
        if message.text.startswith("Failed to load resource") and any(
            urlsplit(where).path == path and f"status of {status}" in message.text
            for path, status in self.expected.items()
        ):
            return
        self.errors.append(f"{message.text} ({where})")

    def _response(self, response: Response) -> None:
        if response.request.resource_type == "document":
            content_type = response.headers.get("content-type", "")
            self.documents[response.url] = (response.status, content_type)

    async def check(self, what: str, again: bool = False) -> None:
        """The page now shown: no repr, no raw JSON, no console error, no serious axe finding."""
        page = self.page
        await page.wait_for_load_state("load")
        self.pages += 1
        url = page.url
        status, content_type = self.documents.get(url, (200, "text/html"))
        where = f"{what} [{urlsplit(url).path}]"
        if "json" in content_type:
            self.problems.append(f"{where}: a raw JSON body ({status})")
        html = await page.content()
        text = await page.inner_text("body")
        for found in {m.group(0) for m in REPR.finditer(html)}:
            self.problems.append(f"{where}: shows a Python repr {found!r}")
        if text.lstrip().startswith(("{", "[")):
            self.problems.append(f"{where}: the page is raw JSON: {text[:80]!r}")
        self.problems += [f"{where}: console error: {e}" for e in self.errors]
        self.errors.clear()
        # axe takes about a second a page: a page a link leads to is checked by the first
        # person who reaches it (what differs between people is in the pages of the steps).
        if again and kind(url) in self.axed:
            return
        self.axed.add(kind(url))
        if not await page.evaluate("() => typeof axe !== 'undefined'"):
            await page.add_script_tag(path=str(self.axe_js))
        found = await page.evaluate(axe.RUN, list(axe.IMPACTS))
        for v in found:
            nodes = "; ".join(v["nodes"])
            self.problems.append(f"{where}: axe {v['impact']} {v['id']} ({v['help']}): {nodes}")

    async def visit(
        self, href: str, what: str = "link", status: int | None = None, again: bool = False
    ) -> None:
        if status is not None:
            self.expected[urlsplit(href).path] = status
        await self.page.goto(self.base + href if href.startswith("/") else href)
        await self.check(what, again)

    async def crawl(self) -> None:
        """Every console page linked from the pages reached, one of each kind (one proposal,
        one decision: the rest are the same page with other rows)."""
        queue = await self._links()
        while queue:
            href = queue.pop(0)
            if kind(href) in self.seen:
                continue
            self.seen.add(kind(href))
            await self.visit(href, "crawl", again=True)
            queue += await self._links()

    async def _links(self) -> list[str]:
        hrefs: list[str] = await self.page.eval_on_selector_all(
            "a[href]", "els => els.map(e => e.getAttribute('href'))"
        )
        out = []
        for href in hrefs:
            path = href.split("#", 1)[0]
            if not path.startswith("/console/") or path.startswith("/console/static/"):
                continue
            if path.startswith(("/console/decisions/export", "/console/signin")):
                continue  # a download; the sign-in page (every person has passed it)
            if kind(path) not in self.seen:
                out.append(path)
        return out


def kind(href: str) -> str:
    """A page's kind: its path with an id or a query left out (``/console/policies/*``)."""
    parts = urlsplit(href).path.strip("/").split("/")
    return "/" + "/".join(parts[:2]) + ("/*" if len(parts) > 2 else "")


async def record_traffic(admin: Admin, per_client: int = 40) -> None:
    """Answers in the audit store from three countries, DNS and HTTP, for both services."""
    runtime = admin.runtime
    for client in CLIENTS:
        for service, name in (("chat", "chat.gtm.example"), ("chat-eu", "chat.eu.gtm.example")):
            for channel in (Channel.DNS, Channel.HTTP):
                request = DecisionRequest(channel, ip_address(client), service, name)
                decision = decide(request, runtime.store.current, time.time())
                asked = name + "." if channel is Channel.DNS else name
                runtime.writer.count(
                    record_of(decision, channel=channel.value, name=asked), per_client
                )
    await runtime.writer.flush()


async def signed_in(
    browser: Browser, admin: Admin, axe_js: Path, axed: set[str], token: str, name: str
) -> Walk:
    # The console forbids inline scripts (CSP); the test's own checker is let in.
    context = await browser.new_context(bypass_csp=True, viewport={"width": 1280, "height": 900})
    walk = Walk(await context.new_page(), admin.url, axe_js, axed=axed)
    walk.listen()
    await walk.visit("/console/signin", "sign-in", again=True)
    await walk.page.get_by_label("Token").fill(token)
    await walk.page.get_by_role("button", name="Sign in").click()
    await expect(walk.page).to_have_url(admin.url + "/console/")
    await expect(walk.page.locator("#whoami")).to_have_text(name)
    await walk.check("fleet after sign-in")
    walk.seen.add(kind("/console/"))
    return walk


async def author_drafts_submits_and_is_refused_by_four_eyes(walk: Walk) -> int:
    page = walk.page
    await walk.visit("/console/policies", "policies")
    await page.get_by_label("Reason (recorded with every step)").fill("let EU data into the US")
    eu = page.get_by_label("Policy file eu-personal.yaml")
    await eu.fill(loosen_eu("eu-personal.yaml", await eu.input_value()))
    await page.get_by_role("button", name="Save draft").click()
    await expect(page.locator("#proposal-state")).to_have_text("draft")
    await walk.check("a saved draft")
    proposal = int(page.url.rsplit("/", 1)[1])
    await page.get_by_role("button", name="Submit for approval").click()
    await expect(page.locator("#proposal-state")).to_have_text("proposed")
    await walk.check("a submitted proposal")
    # The author holds the approver role too: the page offers no approval, and a hand-made
    # approval is refused by the API for what it is, four-eyes.
    await expect(page.get_by_text("so you cannot approve it (four eyes)")).to_be_visible()
    walk.expected[f"/console/policies/{proposal}/approve"] = 403
    async with page.expect_navigation():
        await page.evaluate(
            """(id) => {
              const f = document.createElement("form");
              f.method = "post"; f.action = `/console/policies/${id}/approve`;
              for (const [k, v] of [["csrf", document.querySelector("input[name=csrf]").value],
                                    ["version", ""]]) {
                const i = document.createElement("input");
                i.type = "hidden"; i.name = k; i.value = v; f.append(i);
              }
              document.body.append(f); f.submit();
            }""",
            proposal,
        )
    await expect(page.locator("#refused-title")).to_have_text("Refused: nothing was changed")
    await expect(page.locator("#refusal")).to_contain_text(
        "author of proposal #" + str(proposal) + " may not approve it"
    )
    await walk.check("four-eyes refusal")
    return proposal


async def approver_reviews_approves_acknowledges_and_activates(walk: Walk, proposal: int) -> None:
    page = walk.page
    await walk.visit(f"/console/policies/{proposal}", "the waiting proposal")
    await page.get_by_role("button", name="Show impact").click()
    await expect(page.locator("#left-jurisdiction")).to_contain_text("leave their jurisdiction")
    await walk.check("impact")
    await page.get_by_label("Comment").fill("reviewed with legal")
    await page.get_by_role("button", name=re.compile("^Approve version")).click()
    await expect(page.locator("#proposal-state")).to_have_text("approved")
    await walk.check("approved")
    walk.expected[f"/console/policies/{proposal}/activate"] = 409
    await page.get_by_role("button", name="Activate", exact=True).click()
    confirm = page.locator("#confirm-leak")
    await expect(confirm).to_contain_text("would leave EU for US")
    await walk.check("leak acknowledgement")
    await confirm.get_by_role("checkbox").check()
    await confirm.get_by_role("button", name="Activate anyway").click()
    await expect(page.locator("#proposal-state")).to_have_text("active")
    await walk.check("activated")


async def operator_drains_and_undrains(walk: Walk, admin: Admin) -> None:
    page = walk.page
    await record_traffic(admin)  # the map counts the last 5 s: flows on it while it is checked
    await walk.visit("/console/", "fleet")
    await expect(page.locator("#map .flow").first).to_be_attached()
    controls = page.locator("#controls-eu-west")
    await controls.locator("summary").click()
    drain = controls.locator('form[action$="/drain"]')
    await drain.get_by_label("Reason").fill("walkthrough")
    await drain.get_by_label("For").fill("10m")
    await drain.get_by_role("button", name="Drain eu-west").click()
    await expect(page.get_by_role("status")).to_contain_text("eu-west: drain done")
    await walk.check("drained")
    controls = page.locator("#controls-eu-west")
    await controls.locator("summary").click()
    undrain = controls.locator('form[action$="/undrain"]')
    await undrain.get_by_label("Reason").fill("walkthrough over")
    await undrain.get_by_role("button", name="Undrain eu-west").click()
    await expect(page.get_by_role("status")).to_contain_text("eu-west: undrain done")
    await walk.check("undrained")


async def auditor_searches_explains_replays_and_reports(walk: Walk) -> None:
    page = walk.page
    await walk.visit("/console/decisions", "decisions")
    await page.get_by_label("Name").fill("chat.eu.gtm.example")
    await page.get_by_role("button", name="Search").click()
    await expect(page.locator("#decisions tbody tr").first).to_be_visible()
    await walk.check("decision search")
    await page.locator("#decisions tbody a").first.click()
    await expect(page.locator("section.decision").first).to_be_visible()
    await walk.check("a decision explained")
    await page.get_by_role("button", name="Replay under the versions it names").click()
    await expect(page.locator("#replay")).to_be_visible()
    await walk.check("replay")
    await walk.visit("/console/events", "events")
    await page.get_by_role("button", name="Open the report").click()
    await expect(page.locator("#class-jurisdiction")).to_be_visible()
    await walk.check("compliance report")


async def admin_issues_a_token_and_adds_a_principal(walk: Walk) -> None:
    page = walk.page
    await walk.visit("/console/access", "access")
    await page.get_by_role("button", name="Issue token").click()
    await expect(page.locator("#issued-token")).to_have_value(re.compile("^gtm_"))
    await walk.check("a token issued")
    await walk.visit("/console/access", "access")
    form = page.locator('form[action="/console/access/principals"]')
    await form.get_by_label("Name").fill("walk-viewer")
    await form.get_by_label("viewer", exact=True).check()
    await form.get_by_role("button", name="Create").click()
    await expect(page.locator("#principals")).to_contain_text("walk-viewer")
    await walk.check("a principal added")


async def test_each_demo_person_walks_the_console_without_a_fault(
    start_admin: AdminFactory, browser: Browser, axe_script: Path
) -> None:
    async with start_admin() as admin:
        tokens = {name: await admin.token(name, *roles) for name, roles in PEOPLE.items()}
        async with admin.client(tokens["demo-auditor"]) as api:
            await record_traffic(admin)

            async def written() -> bool:
                return bool((await api.get("/v1/decisions")).json()["rows"])

            await eventually(written, within=20, what="decision rows")
        problems: list[str] = []
        axed: set[str] = set()
        visited: dict[str, int] = {}
        steps: list[tuple[str, Any]] = [
            ("demo-author", author_drafts_submits_and_is_refused_by_four_eyes),
            ("demo-approver", approver_reviews_approves_acknowledges_and_activates),
            ("demo-operator", operator_drains_and_undrains),
            ("demo-auditor", auditor_searches_explains_replays_and_reports),
            ("demo-admin", admin_issues_a_token_and_adds_a_principal),
        ]
        proposal = 0
        for name, step in steps:
            walk = await signed_in(browser, admin, axe_script, axed, tokens[name], name)
            if name == "demo-author":
                proposal = await step(walk)
            elif name == "demo-approver":
                await step(walk, proposal)
            elif name == "demo-operator":
                await step(walk, admin)
            else:
                await step(walk)
            await walk.crawl()
            # A page that names nothing: the console's own 404 page, not the API's JSON.
            await walk.visit("/console/no-such-page", "a missing page", status=404, again=True)
            problems += [f"{name}: {p}" for p in walk.problems]
            visited[name] = walk.pages
            await walk.page.context.close()
        assert problems == [], "\n".join(problems)
        # Each person reached the sections their roles open (a walk that saw nothing proves
        # nothing).
        assert all(n >= 6 for n in visited.values()), visited
