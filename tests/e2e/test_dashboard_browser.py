"""SPEC §11 D1 in a real browser: Debian's chromium driven by Playwright (never a
downloaded browser). Sign in, watch a model change state live after a REST load, pause
and resume it from its buttons, and see a usage bar appear after requests. Screenshots of
each section are saved under the test's tmp_path (their paths are printed)."""

from __future__ import annotations

from pathlib import Path

import httpx
from playwright.sync_api import Page, expect

from tests.support.browser import BROWSER_TIER, sign_in
from tests.support.processes import fake_cmd

pytestmark = BROWSER_TIER

SECTIONS = ("overview", "residency", "lanes", "usage", "logs", "economics", "definitions")

CONFIG = f"""
servers: {{box: {{pools: {{gpu0: 8GB}}}}}}
ledger: {{gpuHourPrice: 2.0}}
priorityGroups:
  gold: {{weight: 3}}
  bronze: {{weight: 1}}
scheduler: {{defaultGroup: bronze}}
keys: {{sk-gold: gold}}
models:
  alpha:
    backends:
      - cmd: "{fake_cmd("--load-seconds", "0.3")}"
        proxy: ${{PORT}}
        ramUsage: {{gpu0: 2GB}}
"""


def screenshots(page: Page, folder: Path, tag: str) -> None:
    for name in SECTIONS:
        path = folder / f"dashboard-{tag}-{name}.png"
        page.locator(f"#{name}").screenshot(path=str(path))
        print(f"screenshot: {path}")
    full = folder / f"dashboard-{tag}-page.png"
    page.screenshot(path=str(full), full_page=True)
    print(f"screenshot: {full}")


def test_D1_browser_live_state_pause_resume_and_usage(gateway_factory, page, tmp_path):
    gw = gateway_factory(CONFIG)
    sign_in(page, gw)
    state = page.locator('#overview tr[data-model="alpha"] [data-testid="model-state"]')
    expect(state).to_have_text("stopped")

    # A load through the REST API shows up live, over the SSE stream, without a reload.
    page.evaluate("window.__noReload = true")
    assert gw.api("POST", "models/load", {"model": "alpha"}).status_code == 200
    expect(state).to_have_text("ready", timeout=10_000)
    assert page.evaluate("window.__noReload") is True
    expect(page.locator('#residency [data-pool="gpu0"] rect[data-resident]')).to_have_count(1)
    expect(page.locator('#economics tr[data-econ^="alpha"] [data-field="wakes"]')).to_have_text("1")

    # Pause (a confirmation, with an optional until) and resume, from the buttons.
    dialogs: list[str] = []

    def accept(dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    page.get_by_label("Pause alpha until (optional)").fill("2h")
    page.locator('button[data-action="pause"][data-model="alpha"]').click()
    expect(state).to_have_text("paused", timeout=10_000)
    assert dialogs and "Pause alpha?" in dialogs[0]
    assert gw.api("GET", "overview").json()["models"][0]["paused_until"]
    expect(page.locator('#overview tr[data-model="alpha"]')).to_contain_text("Z")
    screenshots(page, tmp_path, "paused")
    page.locator('button[data-action="resume"][data-model="alpha"]').click()
    expect(state).to_have_text("stopped", timeout=10_000)
    assert gw.api("GET", "overview").json()["models"][0]["paused"] is False

    # Requests make a usage bar appear for their key's lane, live.
    bar = page.locator('#usage [data-usage-bar="gold"]')
    expect(bar).to_have_count(0)
    for _ in range(2):
        r = httpx.post(
            gw.v1 + "/chat/completions",
            json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer sk-gold"},
            timeout=60,
        )
        assert r.status_code == 200
    expect(bar).to_have_count(1, timeout=15_000)
    expect(page.locator('#usage li[data-lane="gold"]')).to_contain_text("2 req", timeout=15_000)
    expect(state).to_have_text("ready")

    # Usage ranges switch in place; logs follow the backend live.
    page.locator('#usage button[data-range="week"]').click()
    expect(page.locator('#usage button[data-range="week"]')).to_have_attribute(
        "aria-pressed", "true"
    )
    expect(page.locator("#logs pre.log")).to_contain_text("ready in")
    assert page.evaluate("window.__noReload") is True
    screenshots(page, tmp_path, "after-requests")


def test_D1_browser_dark_and_narrow_screens(gateway_factory, browser, tmp_path):
    gw = gateway_factory(CONFIG)
    context = browser.new_context(color_scheme="dark", viewport={"width": 390, "height": 800})
    try:
        page = context.new_page()
        sign_in(page, gw)
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(15, 17, 21)"  # the dark palette
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, "the page must not scroll sideways on a phone"
        screenshots(page, tmp_path, "dark-narrow")
    finally:
        context.close()
