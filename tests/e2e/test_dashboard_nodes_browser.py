"""SPEC §19 X6 on the dashboard, in Debian's chromium driven by Playwright (never a
downloaded browser): the Nodes section shows a peer up with its model, follows a state
change on the peer, and shows the peer down once it is killed, all without a reload.
A screenshot of the peer down goes to /tmp/dash-nodes.png (its path is printed)."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.support.browser import BROWSER_TIER, sign_in
from tests.support.processes import fake_cmd

pytestmark = BROWSER_TIER

NODE = f"""
models:
  m:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
"""


def test_X6_nodes_section_shows_a_peer_up_then_down_live(gateway_factory, tmp_path, page):
    node = gateway_factory(NODE, home=tmp_path / "node")
    gw = gateway_factory(
        f"peerTimeout: 2s\npeers: {{b: {{url: '{node.url}', token: '{node.token}'}}}}\n",
        home=tmp_path / "gateway",
    )
    sign_in(page, gw)
    page.evaluate("window.notReloaded = true")
    peer = page.locator('#nodes [data-peer="b"]')
    expect(peer).to_have_attribute("data-state", "up", timeout=20_000)
    expect(peer.locator('[data-field="peer-state"]')).to_have_text("up")
    row = peer.locator('tr[data-backend="m@b"]')
    expect(row.locator("th")).to_have_text("m")
    expect(row.locator('[data-field="state"]')).to_have_text("stopped")

    # The node loads m: its lifecycle reaches the table without an event of this gateway's.
    assert node.api("POST", "models/load", {"model": "m"}).status_code == 200
    expect(row.locator('[data-field="state"]')).to_have_text("ready", timeout=15_000)

    node.proc.kill()  # outright; its backend's group goes at the fixture's cleanup
    expect(peer).to_have_attribute("data-state", "down", timeout=15_000)
    expect(peer.locator('[data-field="peer-state"]')).to_have_text("down")
    expect(peer.locator('[data-field="peer-error"]')).not_to_be_empty()
    expect(row).to_have_count(1)  # what it served, as it last reported
    assert page.evaluate("window.notReloaded") is True
    page.locator("#nodes").screenshot(path="/tmp/dash-nodes.png")
    print("screenshot: /tmp/dash-nodes.png")
