"""Take the README's console screenshots from a running ``make demo`` (run by hand).

Usage: ``python tools/console_screenshots.py http://127.0.0.1:8081 var/demo-tokens docs/img``
(the console URL and tokens file the demo printed). Signs in as demo-operator for the fleet map
(the map alone), as demo-approver for the waiting proposal with its impact and the
acknowledgement its activation asks for (it approves the proposal: take them from a demo you can
throw away), and as demo-auditor for the compliance report's class x jurisdiction table; needs
Debian's chromium.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

from playwright.async_api import Page, async_playwright


async def sign_in(page: Page, url: str, token: str) -> None:
    await page.goto(f"{url}/console/signin")
    await page.get_by_label("Token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{url}/console/")


async def main(url: str, tokens: dict[str, str], out: Path) -> None:
    executable = shutil.which("chromium")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=executable)
        viewport = {"width": 1280, "height": 900}
        page = await (await browser.new_context(viewport=viewport)).new_page()  # type: ignore[arg-type]
        await sign_in(page, url, tokens["demo-operator"])
        await page.wait_for_selector("#live[data-updated]")
        await page.wait_for_selector("#map .flow .arrow")
        # The map alone (flows with their arrows and widths, the placed labels): the page
        # refreshes it every second, so it is taken from a copy that stays put (the page's
        # script keeps refreshing the original, now out of the document).
        await page.evaluate(
            "document.getElementById('live').replaceWith(document.getElementById('live')"
            ".cloneNode(true))"
        )
        await page.locator("figure.map").screenshot(path=str(out / "console-fleet.png"))

        page = await (await browser.new_context(viewport=viewport)).new_page()  # type: ignore[arg-type]
        await sign_in(page, url, tokens["demo-approver"])
        await page.goto(f"{url}/console/policies")
        await page.locator("#proposals a").first.click()
        await page.get_by_role("button", name="Show impact").click()
        await page.wait_for_selector("#impact")
        await page.screenshot(path=str(out / "console-approval.png"), full_page=True)
        # Approve it, then activate: the console names the leak and asks for an acknowledgement.
        await page.get_by_role("button", name="Approve version").click()
        await page.get_by_role("button", name="Activate", exact=True).click()
        confirm = page.locator("#confirm-leak")
        await confirm.wait_for()
        await confirm.screenshot(path=str(out / "console-leak-acknowledgement.png"))

        page = await (await browser.new_context(viewport=viewport)).new_page()  # type: ignore[arg-type]
        await sign_in(page, url, tokens["demo-auditor"])
        await page.goto(f"{url}/console/reports/compliance")
        table = page.locator("#class-jurisdiction")
        await table.wait_for()
        await table.screenshot(path=str(out / "console-compliance-table.png"))
        await browser.close()


if __name__ == "__main__":
    lines = Path(sys.argv[2]).read_text().splitlines()
    target = Path(sys.argv[3])
    target.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(sys.argv[1], dict(line.split() for line in lines if line.strip()), target))
