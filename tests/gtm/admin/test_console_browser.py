"""The console in a real browser (Playwright driving Debian's chromium): sign-in, the live map,
an operator's drain, a policy approval with its impact, escaping, and pages without JavaScript."""

from __future__ import annotations

import re

from playwright.async_api import Browser, Page, expect

from gtm.admin.permissions import Role
from tests.gtm.admin.conftest import Admin, AdminFactory, documents, loosen_eu

XSS = '<img src=x onerror=alert("pwned")>'


async def sign_in(page: Page, admin: Admin, token: str) -> None:
    await page.goto(admin.url + "/console/")
    await expect(page).to_have_url(f"{admin.url}/console/signin?next=/console/")
    await page.get_by_label("Token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page).to_have_url(admin.url + "/console/")


async def test_an_operator_signs_in_sees_the_map_and_drains_a_region(
    start_admin: AdminFactory, browser: Browser
) -> None:
    async with start_admin() as admin:
        token = await admin.token("olga", Role.OPERATOR)
        context = await browser.new_context()
        page = await context.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        await sign_in(page, admin, token)
        await expect(page.locator("#whoami")).to_have_text("olga")
        regions = page.locator("#map g.region")
        await expect(regions).to_have_count(6)
        await expect(page.locator('#map g[data-region="eu-west"]')).to_have_attribute(
            "data-state", "unknown"
        )
        # Every visible form field has a label a screen reader can announce.
        unlabelled = await page.evaluate(
            """() => [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]
                 .filter(e => !e.labels || e.labels.length === 0).map(e => e.name)"""
        )
        assert unlabelled == []

        controls = page.locator("#controls-eu-west")
        await controls.locator("summary").click()
        drain = controls.locator('form[action$="/drain"]')
        await drain.get_by_label("Reason").fill(XSS)
        await drain.get_by_label("For").fill("1h")
        await drain.get_by_role("button", name="Drain eu-west").click()
        await expect(page.get_by_role("status")).to_contain_text("eu-west: drain done")
        await expect(page.locator('#map g[data-region="eu-west"]')).to_have_attribute(
            "data-state", "draining"
        )
        # The page's script swaps in the live map by itself (no reload).
        await expect(page.locator("#live")).to_have_attribute("data-updated", re.compile(r"\d+"))
        await page.goto(admin.url + "/console/events")
        await expect(page.locator("#timeline")).to_contain_text(XSS)  # shown as text
        assert dialogs == []  # and never run
        await context.close()


async def test_an_approver_reviews_the_impact_and_approves(
    start_admin: AdminFactory, browser: Browser
) -> None:
    async with start_admin() as admin:
        author = await admin.token("alice", Role.POLICY_AUTHOR)
        approver = await admin.token("bob", Role.POLICY_APPROVER)
        async with admin.client(author) as api:
            body = documents(loosen_eu) | {"reason": "let EU data into the US"}
            created = (await api.post("/v1/proposals", json=body)).json()
            await api.post(f"/v1/proposals/{created['id']}/submit")
        page = await (await browser.new_context()).new_page()
        await sign_in(page, admin, approver)
        await page.get_by_role("link", name="Policies").click()
        await page.get_by_role("link", name=f"#{created['id']}").click()
        await expect(page.locator("#proposal-state")).to_have_text("proposed")
        await expect(page.locator("pre.diff .add")).to_contain_text(["+    - US"])
        await page.get_by_role("button", name="Show impact").click()
        await expect(page.locator("#impact")).to_be_visible()
        await expect(page.locator("#left-jurisdiction")).to_contain_text("leave their jurisdiction")
        await page.get_by_label("Comment").fill("reviewed with legal")
        await page.get_by_role("button", name="Approve version").click()
        await expect(page.locator("#proposal-state")).to_have_text("approved")
        await expect(page.locator("#approvals")).to_contain_text("bob")


async def test_read_only_pages_work_without_javascript(
    start_admin: AdminFactory, browser: Browser
) -> None:
    async with start_admin() as admin:
        token = await admin.token("vic", Role.VIEWER, Role.AUDITOR)
        context = await browser.new_context(java_script_enabled=False)
        page = await context.new_page()
        await sign_in(page, admin, token)
        await expect(page.locator("#regions tbody tr")).to_have_count(6)
        for link, marker in (
            ("Policies", "#proposals"),
            ("Decisions", "#decisions"),
            ("Events & evidence", "#timeline"),
        ):
            await page.get_by_role("link", name=link).click()
            await expect(page.locator(marker)).to_be_visible()
        await context.close()
