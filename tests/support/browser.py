"""A real browser for the console's tests: Debian's chromium, driven by Playwright (no browser
download). Missing chromium skips the tests, or fails them when CI requires the tools."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser, async_playwright


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("GTM_TEST_REQUIRE_TOOLS"):
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    executable = chromium()
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=executable, headless=True)
        try:
            yield launched
        finally:
            await launched.close()
