"""Browser fixtures for the dashboard tests: Debian's chromium driven by Playwright (never a
downloaded browser), one browser per module, a fresh context per test that fails the test
if the page reached anywhere but loopback."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.support.browser import ARGS
from tests.support.tiers import CHROMIUM, without_chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert shutil.which(CHROMIUM), without_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    outside: list[str] = []
    page.on(
        "request",
        lambda r: outside.append(r.url) if not r.url.startswith("http://127.0.0.1") else None,
    )
    try:
        yield page
    finally:
        context.close()
    assert not outside, f"the dashboard made external requests: {outside}"
