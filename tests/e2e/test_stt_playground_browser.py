"""SPEC §11 D1 and §12 U4 in a real browser: the dashboard's STT playground, driven in
Debian's chromium by Playwright. Upload a generated WAV to a diarizing model (the fake
backend's three fixed segments) and see them per speaker with a summary; a wrong API key
shows the gateway's error in the section; live updates leave the form and the answer alone.
A screenshot of the section is saved under the test's tmp_path (its path is printed)."""

from __future__ import annotations

import re
import wave
from pathlib import Path

from playwright.sync_api import Page, expect

from tests.support.browser import BROWSER_TIER, sign_in
from tests.support.processes import fake_cmd

pytestmark = BROWSER_TIER

CONFIG = f"""
commandCosts:
  stt: {{modality: audio, processWattsPerByte: 0.001}}
priorityGroups:
  gold: {{weight: 3}}
  bronze: {{weight: 1}}
scheduler: {{defaultGroup: bronze, requireKeys: true}}
keys: {{sk-gold: gold}}
models:
  diarist:
    backends:
      - {{cmd: "{fake_cmd("--load-seconds", "0.3")}", proxy: "${{PORT}}", type: stt,
         modes: [batch], diarization: true}}
  ears:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, modes: [batch]}}]
"""
KEY_STORE = "corrallm.playground.key"


def write_wav(path: Path) -> Path:
    """One second of 16 kHz mono silence: a real WAV file, as a user would pick one."""
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(b"\x00\x00" * 16_000)
    return path


def submit(page: Page, key: str) -> None:
    playground = page.locator("#playground")
    playground.get_by_label("API key").fill(key)
    playground.get_by_role("button", name="Transcribe").click()


def test_D1_U4_playground_renders_diarized_segments_per_speaker(gateway_factory, page, tmp_path):
    gw = gateway_factory(CONFIG)
    sign_in(page, gw)
    pg = page.locator("#playground")
    expect(pg.get_by_role("heading", name="STT playground")).to_be_visible()
    model, fmt = pg.get_by_label("Model"), pg.get_by_label("Response format")
    expect(model.locator("option")).to_have_text(["diarist · diarizes", "ears"])
    expect(fmt).to_have_value("diarized_json")  # the chosen model diarizes
    model.select_option("ears")
    expect(fmt).to_have_value("json")
    model.select_option("diarist")
    expect(fmt).to_have_value("diarized_json")
    pg.get_by_label("Audio file").set_input_files(str(write_wav(tmp_path / "two-voices.wav")))

    # /v1 serves only configured keys here: a wrong one is refused, in the section.
    page.evaluate("window.__noReload = true")
    submit(page, "sk-wrong")
    error = pg.locator("[data-pg-error]")
    expect(error).to_contain_text("Refused (401)")
    expect(error).to_contain_text("serves only configured API keys")

    # Live updates while the model cold-starts re-fetch the playground's fragment, but
    # only its model list is taken: the form keeps its file, format and key.
    page.evaluate(
        "window.__fragments = 0; document.getElementById('playground')"
        ".addEventListener('fragment', () => window.__fragments++)"
    )
    submit(page, "sk-gold")
    rows = pg.locator("tr.pg-seg")
    expect(rows).to_have_count(3, timeout=15_000)
    expected = [
        ("SPEAKER_00", "spk-0", "0:00.0\N{EN DASH}0:01.2", "Hello from the first speaker."),
        ("SPEAKER_01", "spk-1", "0:01.2\N{EN DASH}0:03.4", "And this is the second one."),
        ("SPEAKER_00", "spk-0", "0:03.4\N{EN DASH}0:05.0", "Back to the first speaker."),
    ]
    for row, (speaker, colour, span, text) in zip(rows.all(), expected, strict=True):
        expect(row).to_have_attribute("data-speaker", speaker)
        expect(row).to_have_class(re.compile(rf"\b{colour}\b"))
        expect(row.locator("th")).to_have_text(speaker)
        expect(row.locator(".pg-time")).to_have_text(span)
        expect(row.locator(".pg-text")).to_have_text(text)
    bars = [
        r.locator("th").evaluate("e => getComputedStyle(e).borderLeftColor") for r in rows.all()
    ]
    assert bars[0] == bars[2] != bars[1], "each speaker has its own colour"
    expect(pg.locator('[data-field="num_speakers"]')).to_have_text("2")
    summary = {
        "SPEAKER_00": ("2", "2.8 s"),  # 1.2 s + 1.6 s
        "SPEAKER_01": ("1", "2.2 s"),
    }
    expect(pg.locator(".pg-speakers tbody tr")).to_have_count(2)
    for speaker, (segments, seconds) in summary.items():
        line = pg.locator(f'.pg-speakers tr[data-speaker="{speaker}"]')
        expect(line.locator('[data-field="segments"]')).to_have_text(segments)
        expect(line.locator('[data-field="seconds"]')).to_have_text(seconds)
    expect(error).to_have_count(0)

    # The cold start's lifecycle events have come and gone; nothing the user did was lost.
    page.wait_for_function("window.__fragments > 0", timeout=15_000)
    expect(rows).to_have_count(3)
    assert page.evaluate("document.getElementById('pg-file').files.length") == 1
    expect(fmt).to_have_value("diarized_json")
    assert page.evaluate("window.__noReload") is True
    # The key lives in this tab's sessionStorage, never in a cookie.
    assert page.evaluate(f"sessionStorage.getItem('{KEY_STORE}')") == "sk-gold"
    assert [c["name"] for c in page.context.cookies()] == ["corrallm_token"]

    shot = tmp_path / "stt-playground-diarized.png"
    pg.screenshot(path=str(shot))
    print(f"screenshot: {shot}")

    # A plain answer replaces the segments with the text.
    fmt.select_option("text")
    pg.get_by_role("button", name="Transcribe").click()
    expect(pg.locator("[data-pg-text]")).to_contain_text("fake transcript")
    expect(rows).to_have_count(0)
