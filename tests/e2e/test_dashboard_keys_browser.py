"""SPEC §22 T2 on the dashboard, in Debian's chromium driven by Playwright (never a
downloaded browser): a key created in the Keys section, its secret shown once (copied with
the copy button) and used by the official `openai` SDK; rotated and revoked from the page,
each confirmed, and the SDK refused with the old secret (without `requireKeys`: a revoked
secret must not fall into the default lane). A screenshot goes to /tmp/dash-keys.png."""

from __future__ import annotations

import re

import openai
import pytest
from playwright.sync_api import Page, expect

from tests.support.browser import BROWSER_TIER, sign_in
from tests.support.processes import FakeBackend

pytestmark = BROWSER_TIER

CONFIG = """
priorityGroups: {batch: {weight: 1}, interactive: {weight: 4}}
keys: {alice: {secret: alice-secret-0001, group: interactive}}
models:
  m: {backends: [{proxy: PORT}]}
"""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def ask(gw, secret: str) -> str:
    with openai.OpenAI(base_url=gw.v1, api_key=secret, max_retries=0, timeout=30) as client:
        return client.chat.completions.create(**CHAT).id


def refused(gw, secret: str) -> str:
    with pytest.raises(openai.AuthenticationError) as caught:
        ask(gw, secret)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    return caught.value.message


def test_T2_keys_created_rotated_and_revoked_in_the_dashboard(
    gateway_factory, fake_backend: FakeBackend, page: Page
):
    gw = gateway_factory(CONFIG.replace("PORT", str(fake_backend.port)))
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    sign_in(page, gw)
    asked: list[str] = []

    def accept(dialog) -> None:
        asked.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    keys = page.locator("#keys")
    expect(keys.locator('tr[data-key="alice"]')).to_contain_text("config")

    # Create: the secret is shown once, and the copy button puts it on the clipboard.
    keys.get_by_label("Name").fill("web-key")
    keys.get_by_label("Lane").select_option("batch")
    keys.get_by_label("Models").fill("m")
    keys.get_by_role("button", name="Create key").click()
    shown = keys.get_by_label("Secret, shown once")
    expect(shown).to_have_value(re.compile(r"^ck-[A-Za-z0-9_-]{43}$"))
    secret = shown.input_value()
    row = keys.locator('tr[data-key="web-key"]')
    expect(row.locator('[data-field="prefix"]')).to_have_text(f"{secret[:7]}…")
    expect(row).to_contain_text("batch")
    keys.get_by_role("button", name="Copy").click()
    expect(keys.locator("#key-copied")).to_have_text("Copied.")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    page.screenshot(path="/tmp/dash-keys.png", full_page=True)
    print("\nscreenshot: /tmp/dash-keys.png")
    assert ask(gw, secret)

    # Dismissed, or the page loaded again: the secret is nowhere in it.
    keys.get_by_role("button", name="Done").click()
    expect(shown).to_be_hidden()
    page.reload()
    expect(page.locator("#live")).to_have_text("live")
    assert secret not in page.content() and secret[7:] not in page.content()

    # Rotate (confirmed): a new secret shown once; the old one refused at once.
    keys.get_by_role("button", name="Rotate key web-key").click()
    expect(shown).to_have_value(re.compile(r"^ck-"))
    expect(shown).not_to_have_value(secret)
    new = shown.input_value()
    assert asked[-1].startswith("Rotate key web-key?")
    assert "'web-key' was rotated" in refused(gw, secret)
    assert ask(gw, new)
    expect(row.locator('[data-field="prefix"]')).to_have_text(f"{new[:7]}…")

    # Revoke (confirmed): the row goes and the SDK is refused.
    keys.get_by_role("button", name="Revoke key web-key").click()
    expect(row).to_have_count(0)
    assert asked[-1].startswith("Revoke key web-key?") and len(asked) == 2
    expect(keys.locator("#key-status")).to_have_text("web-key revoked.")
    expect(shown).to_be_hidden()  # the revoked key's secret is not left on show
    assert "'web-key' was revoked" in refused(gw, new)
    expect(keys.locator('tr[data-key="alice"] button')).to_have_count(0)  # config: no actions
