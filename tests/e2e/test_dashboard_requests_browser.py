"""SPEC §21 O1 and O2 on the dashboard, in Debian's chromium driven by Playwright (never a
downloaded browser): the live requests table (a running stream and a queued request,
each ended from its confirmed Cancel button), and the activity section opening the
capture of a failed request without showing the caller's key. Screenshots go to
/tmp/dash-requests.png and /tmp/dash-capture.png (their paths are printed)."""

from __future__ import annotations

import json
import re

import httpx
from playwright.sync_api import Page, expect

from tests.support.browser import BROWSER_TIER, sign_in
from tests.support.calls import CHAT, Call
from tests.support.processes import fake_cmd, wait_for

pytestmark = BROWSER_TIER

CALLER_KEY = "sk-caller-secret-5e7a91"  # not configured: sent, never shown
CONFIG = f"""
capture: {{bodies: errors}}
models:
  slow:
    backends:
      - cmd: "{fake_cmd("--tokens", "400", "--token-delay", "0.02")}"
        proxy: ${{PORT}}
        maxConcurrent: 1
  chat:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
  dying:
    backends: [{{cmd: "{fake_cmd("--die-mid-body")}", proxy: "${{PORT}}"}}]
"""
DASH = "\N{EN DASH}"  # an empty cell


def confirmations(page: Page) -> list[str]:
    """Accept every window.confirm, keeping what it asked."""
    asked: list[str] = []

    def accept(dialog) -> None:
        asked.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    return asked


def test_O1_live_table_shows_running_and_queued_and_cancel_ends_each(gateway_factory, page, calls):
    gw = gateway_factory(CONFIG)
    sign_in(page, gw)
    asked = confirmations(page)
    table = page.locator("#requests tbody")
    expect(table).to_contain_text("No request is held now.")

    calls.append(running := Call(gw, "slow", stream=True))
    row_running = page.locator('#requests tr[data-state="running"]')
    expect(row_running).to_have_count(1, timeout=30_000)
    calls.append(queued := Call(gw, "slow", stream=False))
    row_queued = page.locator('#requests tr[data-state="queued"]')
    expect(row_queued).to_have_count(1, timeout=15_000)

    # What each row says, tokens so far moving live on the running one.
    expect(row_running.locator('[data-field="tokens"]')).to_have_text(
        re.compile(r"^[1-9]\d*$"), timeout=15_000
    )
    expect(row_running).to_contain_text("slow#0")
    expect(row_running).to_contain_text("/v1/chat/completions")
    expect(row_queued.locator('[data-field="backend"]')).to_have_text(DASH)  # none yet
    held = {r["state"]: r["id"] for r in gw.api("GET", "requests").json()["requests"]}
    assert set(held) == {"running", "queued"}
    expect(row_running).to_have_attribute("data-request", held["running"])
    expect(row_queued).to_have_attribute("data-request", held["queued"])
    headers = page.locator("#requests thead th")
    assert all(h.get_attribute("scope") == "col" for h in headers.all())
    page.screenshot(path="/tmp/dash-requests.png", full_page=True)
    print("screenshot: /tmp/dash-requests.png")

    # Cancel the queued one: confirmed, the client gets 503 cancelled, the row goes.
    page.get_by_role("button", name=f"Cancel request {held['queued']} (slow)").click()
    wait_for(queued.finished, 30, what="the queued request answered")
    assert queued.status == 503
    assert json.loads(queued.body)["error"]["code"] == "cancelled"
    assert asked and held["queued"] in asked[0] and "slow" in asked[0]
    expect(page.locator("#notice")).to_contain_text("cancelled while queued")
    expect(row_queued).to_have_count(0, timeout=10_000)
    expect(row_running).to_have_count(1)

    # Cancel the running stream: it ends with an error event and [DONE]; the table empties.
    page.locator(f'button[data-action="cancel"][data-request="{held["running"]}"]').click()
    wait_for(running.finished, 30, what="the stream ended")
    assert running.status == 200
    assert running.events[-1] == "[DONE]"
    assert json.loads(running.events[-2])["error"]["code"] == "cancelled"
    assert len(asked) == 2 and held["running"] in asked[1]
    expect(page.locator("#notice")).to_contain_text("cancelled while running")
    expect(page.locator("#requests tr[data-request]")).to_have_count(0, timeout=10_000)
    expect(table).to_contain_text("No request is held now.")
    assert gw.api("GET", "requests").json()["requests"] == []

    # Both show up in the activity section as 503s with their error.
    for rid in held.values():
        row = page.locator(f'#activity tr[data-activity="{rid}"]')
        expect(row).to_have_attribute("data-status", "503", timeout=15_000)
        expect(row).to_contain_text("cancelled")


def test_O2_activity_opens_the_capture_of_a_failed_request_without_secrets(gateway_factory, page):
    gw = gateway_factory(CONFIG)
    sign_in(page, gw)
    ok = httpx.post(gw.v1 + "/chat/completions", json={"model": "chat", **CHAT}, timeout=60)
    assert ok.status_code == 200
    content = f"half an answer, please <b>bold</b> (my key is {CALLER_KEY})"
    died = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "dying", "messages": [{"role": "user", "content": content}]},
        headers={"Authorization": f"Bearer {CALLER_KEY}"},
        timeout=60,
    )
    assert died.status_code == 502
    ok_id, died_id = (r.headers["x-corrallm-request-id"] for r in (ok, died))

    # Live, over the usage event: both rows; only the failed one has a capture button.
    failed = page.locator(f'#activity tr[data-activity="{died_id}"]')
    expect(failed).to_have_attribute("data-status", "502", timeout=15_000)
    expect(failed).to_contain_text("dying")
    served = page.locator(f'#activity tr[data-activity="{ok_id}"]')
    expect(served).to_have_attribute("data-status", "200")
    expect(served.locator("button")).to_have_count(0)

    failed.get_by_role("button", name=f"Open the capture of request {died_id}").click()
    dialog = page.locator("#capture-dialog")
    expect(dialog).to_be_visible()
    assert page.evaluate("document.getElementById('capture-dialog').matches(':modal')")
    expect(dialog.locator(".capture")).to_have_attribute("data-capture-id", died_id)
    expect(dialog.locator('[data-field="status"]')).to_have_text("502")
    body = dialog.locator('[data-field="request-body"]')
    expect(body).to_contain_text("half an answer, please <b>bold</b>")  # as text, escaped
    expect(body).to_contain_text("[redacted]")
    expect(dialog.locator("b")).to_have_count(0)
    auth = dialog.locator('[data-side="request"] tr', has_text="authorization")
    expect(auth).to_contain_text("[redacted]")
    assert CALLER_KEY not in page.content()
    page.screenshot(path="/tmp/dash-capture.png", full_page=False)
    print("screenshot: /tmp/dash-capture.png")

    dialog.get_by_role("button", name="Close").click()
    expect(dialog).to_be_hidden()
    expect(failed.locator("button")).to_be_focused()  # back where it was opened
    page.locator("#activity").screenshot(path="/tmp/dash-activity.png")
    print("screenshot: /tmp/dash-activity.png")
    assert CALLER_KEY not in page.content()

    # A capture that is not kept answers the gateway's 404 text as the fragment.
    missing = page.request.get(f"{gw.url}/ui/section/capture?id={ok_id}")
    assert missing.status == 404
    assert ok_id in missing.text() and "capture" in missing.text()
