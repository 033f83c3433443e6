"""SPEC §10 P6: SIGHUP or POST /api/v1/config/reload re-reads the config; unchanged backends
keep running, changed ones restart after draining, removed ones stop, new ones serve at
once; a bad config is refused with every problem and the old one stays in force."""

from __future__ import annotations

import concurrent.futures
import signal
from pathlib import Path

import httpx
import pytest

from tests.support.processes import fake_cmd, process_gone, wait_for

BEFORE = f"""
models:
  keep: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
  change: {{backends: [{{cmd: "{fake_cmd("--tokens", "3")}", proxy: "${{PORT}}"}}]}}
  drop: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
"""
AFTER = f"""
models:
  keep: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
  change: {{backends: [{{cmd: "{fake_cmd("--tokens", "5")}", proxy: "${{PORT}}"}}]}}
  new: {{aliases: [fresh], backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
"""


def chat(gw, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)


def config_file(gw) -> Path:
    return gw.config_path


def test_P6_reload_keeps_unchanged_restarts_changed_stops_removed_adds_new(gateway_factory):
    gw = gateway_factory(BEFORE)
    for model in ("keep", "change", "drop"):
        assert chat(gw, model).status_code == 200
    pids = {b: gw.pid_of(f"{b}#0") for b in ("keep", "change", "drop")}
    config_file(gw).write_text(AFTER)
    report = gw.api("POST", "config/reload")
    assert report.status_code == 200, report.text
    assert report.json() == {
        "kept": ["keep#0"],
        "restarted": ["change#0"],
        "removed": ["drop#0"],
        "added": ["new#0"],
    }
    assert gw.pid_of("keep#0") == pids["keep"]  # still the same process, still serving
    assert chat(gw, "keep").status_code == 200
    wait_for(
        lambda: process_gone(pids["drop"]) and process_gone(pids["change"]),
        20,
        what="old ones stopped",
    )
    assert chat(gw, "drop").status_code == 404
    changed = chat(gw, "change")
    assert changed.status_code == 200 and changed.json()["usage"]["completion_tokens"] == 5
    assert gw.pid_of("change#0") != pids["change"]
    assert chat(gw, "fresh").status_code == 200  # new, with its alias, at once
    assert [m["id"] for m in httpx.get(gw.v1 + "/models").json()["data"]] == [
        "keep",
        "change",
        "new",
    ]


def test_P6_a_bad_config_is_refused_with_every_problem_and_the_old_stays(gateway_factory):
    gw = gateway_factory(BEFORE)
    assert chat(gw, "keep").status_code == 200
    config_file(gw).write_text(
        "models:\n  keep: {backends: [{cmd: x, maxConcurrent: 0}]}\n  other: {bakends: []}\n"
    )
    refused = gw.api("POST", "config/reload")
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "old one stays in force" in message
    assert "maxConcurrent" in message and "bakends" in message and "proxy" in message
    assert chat(gw, "keep").status_code == 200 and chat(gw, "drop").status_code == 200


@pytest.mark.serve_process
def test_P6_sighup_reloads(gateway_factory):
    gw = gateway_factory(BEFORE)
    config_file(gw).write_text(AFTER)
    gw.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: chat(gw, "new").status_code == 200, 20, interval=0.2, what="SIGHUP reload")
    config_file(gw).write_text("models: [not, a, mapping]\n")
    gw.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "config refused" in gw.log(), 20, what="the refusal logged")
    assert chat(gw, "new").status_code == 200 and gw.proc.poll() is None


SLOW = fake_cmd("--tokens", "4", "--token-delay", "0.4")
QUEUED_BEFORE = f"""
models:
  change: {{backends: [{{cmd: "{SLOW}", proxy: "${{PORT}}", maxConcurrent: 1}}]}}
  drop: {{backends: [{{cmd: "{SLOW}", proxy: "${{PORT}}", maxConcurrent: 1}}]}}
"""
FIVE = fake_cmd("--tokens", "5")
QUEUED_AFTER = f"""
models:
  change: {{backends: [{{cmd: "{FIVE}", proxy: "${{PORT}}", maxConcurrent: 1}}]}}
"""


def test_P6_requests_queued_on_a_replaced_or_removed_backend_are_routed_again(gateway_factory):
    gw = gateway_factory(QUEUED_BEFORE)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(r.status_code == 200 for r in pool.map(chat, [gw, gw], ["change", "drop"]))
        running = {m: pool.submit(chat, gw, m) for m in ("change", "drop")}  # warm: no wait
        wait_for(
            lambda: all(gw.overview_backend(f"{m}#0")["in_flight"] == 1 for m in running),
            20,
            what="both slots busy",
        )
        queued = {m: pool.submit(chat, gw, m) for m in ("change", "drop")}
        wait_for(
            lambda: all(gw.overview_backend(f"{m}#0")["waiting"] == 1 for m in queued),
            20,
            what="one request queued on each",
        )
        config_file(gw).write_text(QUEUED_AFTER)
        assert gw.api("POST", "config/reload").status_code == 200
        # The requests in flight finish where they are (drained), on the old processes.
        for future in running.values():
            reply = future.result(60)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        # The queued one on the replaced backend is served by its replacement...
        moved = queued["change"].result(60)
        assert moved.status_code == 200, moved.text
        assert moved.json()["usage"]["completion_tokens"] == 5
        # ...and the one whose model is gone is told so, not handed a 502.
        gone = queued["drop"].result(60)
        assert gone.status_code == 404, gone.text
        assert "removed by a config reload" in gone.json()["error"]["message"]


COLD_BEFORE = f"""
models:
  change: {{backends: [{{cmd: "{fake_cmd("--load-seconds", "60")}", proxy: "${{PORT}}"}}]}}
  drop: {{backends: [{{cmd: "{fake_cmd("--load-seconds", "60")}", proxy: "${{PORT}}"}}]}}
"""


def test_P6_requests_waiting_on_a_cold_start_that_a_reload_cancels_are_routed_again(
    gateway_factory,
):
    gw = gateway_factory(COLD_BEFORE)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = {m: pool.submit(chat, gw, m) for m in ("change", "drop")}
        wait_for(
            lambda: all(gw.state(f"{m}#0") == "starting" for m in waiting),
            20,
            what="both backends starting",
        )
        config_file(gw).write_text(QUEUED_AFTER)
        assert gw.api("POST", "config/reload").status_code == 200
        moved = waiting["change"].result(60)
        assert moved.status_code == 200, moved.text
        assert moved.json()["usage"]["completion_tokens"] == 5
        gone = waiting["drop"].result(60)
        assert gone.status_code == 404 and "removed by a config reload" in gone.text
