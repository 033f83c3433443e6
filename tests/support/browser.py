"""Driving the dashboard in Debian's chromium: launch flags and the sign-in."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, expect

from tests.support.tiers import tier, without_chromium

BROWSER_TIER = tier(without_chromium())

# Without the background-networking flags chromium keeps trying to reach Google's hosts,
# which this closed network refuses.
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def sign_in(page: Page, gw: Any) -> None:
    page.goto(gw.url + "/")
    expect(page).to_have_url(gw.url + "/signin")
    page.get_by_label("Admin token").fill("wrong")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("not the admin token")
    page.get_by_label("Admin token").fill(gw.token)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(gw.url + "/")
    expect(page.locator("#live")).to_have_text("live")
