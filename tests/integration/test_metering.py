"""SPEC §9 through a real gateway: cost per key (local and paid), streaming usage, load
rows, spend limits, activity durability, /metrics. Rows are read from the store file."""

from __future__ import annotations

import signal
import sqlite3

import httpx
import pytest

from corrallm.config.schema import short_key_name
from tests.support.processes import fake_cmd, wait_for

CONFIG = """
costPerKwh: 0.25
commandCosts:
  chat: {{ generateWattsPerToken: 0.002, processWattsPerToken: 0.0001 }}
  paid-api: {{ paid: true }}
priorityGroups:
  coders: {{ weight: 4 }}
  thrifty: {{ weight: 1, spendLimit: {{ usd: 0.08, window: 1h }} }}
keys: {{ coder-key: coders, cheap-key: thrifty }}
models:
  local:
    backends:
      - cmd: "{local}"
        proxy: ${{PORT}}
        type: chat
        swap: {{ loadWatts: 3600 }}
  paid:
    backends:
      - proxy: {paid_port}
        type: paid-api
        model: gpt-upstream
        pricing: {{ inputPerMillion: 1000, outputPerMillion: 1000 }}
        costFactor: 1.0
"""


@pytest.fixture
def gw(gateway_factory, fake_backend):
    text = CONFIG.format(local=fake_cmd("--tokens", "10"), paid_port=fake_backend.port)
    return gateway_factory(text)


def chat(gw, model: str, key: str | None, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "three words here"}]}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        gw.v1 + "/chat/completions", json={**body, **extra}, headers=headers, timeout=60
    )


def rows(gw, where: str = "1=1") -> list[sqlite3.Row]:
    db = sqlite3.connect(f"file:{gw.home / 'corrallm.db'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return db.execute(f"SELECT * FROM activity WHERE {where} ORDER BY id").fetchall()
    finally:
        db.close()


def test_C1_C3_cost_per_key_for_a_local_and_a_paid_backend(gw):
    local = chat(gw, "local", "coder-key").json()["usage"]
    paid = chat(gw, "paid", "coder-key", max_tokens=4).json()["usage"]
    got = wait_for(
        lambda: rows(gw, "kind = 'request'") if len(rows(gw, "kind = 'request'")) == 2 else None, 10
    )
    by_model = {r["model"]: r for r in got}
    wh = local["prompt_tokens"] * 0.0001 + local["completion_tokens"] * 0.002
    assert by_model["local"]["energy_wh"] == pytest.approx(wh)
    assert by_model["local"]["cost_usd"] == pytest.approx(wh * 0.25 / 1000)
    paid_usd = (paid["prompt_tokens"] + paid["completion_tokens"]) * 1000 / 1e6
    assert by_model["paid"]["cost_usd"] == pytest.approx(paid_usd)
    assert by_model["paid"]["energy_wh"] == 0
    for row in got:
        assert (row["key"], row["grp"], row["status"], row["estimated"]) == (
            short_key_name("coder-key"),  # T1: a key is shown by its name
            "coders",
            200,
            0,
        )
        assert row["duration_ms"] > 0 and row["ttfb_ms"] is not None
    assert by_model["paid"]["backend"] == "paid#0" and by_model["local"]["completion_tokens"] == 10


def test_C1_a_load_row_charges_the_caller_that_caused_the_start(gw):
    assert chat(gw, "local", "coder-key").status_code == 200
    load = wait_for(lambda: rows(gw, "kind = 'load'"), 10)[0]
    seconds = load["duration_ms"] / 1000
    assert (load["key"], load["grp"], load["model"], load["backend"]) == (
        short_key_name("coder-key"),
        "coders",
        "local",
        "local#0",
    )
    assert load["energy_wh"] == pytest.approx(seconds * 3600 / 3600)
    assert load["cost_usd"] == pytest.approx(load["energy_wh"] * 0.25 / 1000)


def test_C2_stream_usage_is_metered_and_hidden_from_a_client_that_did_not_ask(gw):
    with httpx.stream(
        "POST",
        gw.v1 + "/chat/completions",
        json={"model": "local", "messages": [{"role": "user", "content": "x"}], "stream": True},
        timeout=60,
    ) as r:
        text = "".join(r.iter_text())
    assert '"usage"' not in text and text.rstrip().endswith("data: [DONE]")
    row = wait_for(lambda: rows(gw, "kind = 'request'"), 10)[0]
    assert row["completion_tokens"] == 10 and row["estimated"] == 0 and row["key"] is None
    assert row["grp"] == "default"


def test_S6_a_lane_over_its_spend_limit_gets_429_and_others_are_unaffected(gw):
    # A paid request is estimated at ~(25 + 40) tokens x $1000/M = $0.065 before it is sent
    # and really costs (3 + 16) tokens = $0.019: the second estimate would pass $0.08.
    first = chat(gw, "paid", "cheap-key", max_tokens=40)
    assert first.status_code == 200
    refused = chat(gw, "paid", "cheap-key", max_tokens=40)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "spend_limit" and "spendLimit" in error["message"]
    assert 3000 < int(refused.headers["retry-after"]) <= 3600  # when the first spend leaves
    assert chat(gw, "paid", "coder-key", max_tokens=40).status_code == 200  # other lanes
    lanes = {x["name"]: x for x in gw.api("GET", "lanes").json()["lanes"]}
    assert lanes["thrifty"]["spend_usd_window"] == pytest.approx(0.019)
    assert lanes["coders"]["spend_usd_window"] == 0  # no spendLimit: no window


@pytest.mark.serve_process
def test_S6_C5_spend_in_the_window_survives_a_restart(gateway_factory, fake_backend):
    text = CONFIG.format(local=fake_cmd(), paid_port=fake_backend.port)
    first = gateway_factory(text)
    assert chat(first, "paid", "cheap-key", max_tokens=40).status_code == 200
    first.signal(signal.SIGTERM)
    first.wait_exit()
    second = gateway_factory(text, home=first.home)
    refused = chat(second, "paid", "cheap-key", max_tokens=40)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "spend_limit"


@pytest.mark.serve_process
def test_C3_activity_survives_a_restart_and_a_kill_9(gateway_factory, fake_backend):
    text = CONFIG.format(local=fake_cmd("--tokens", "3"), paid_port=fake_backend.port)
    first = gateway_factory(text)
    for _ in range(5):
        assert chat(first, "paid", "coder-key").status_code == 200
    first.signal(signal.SIGTERM)  # a clean stop flushes what is pending
    first.wait_exit()
    assert len(rows(first, "kind = 'request'")) == 5

    second = gateway_factory(text, home=first.home)
    for _ in range(3):
        assert chat(second, "paid", "coder-key").status_code == 200
    # Written within a second or so by the batched writer, then corrallm is killed -9.
    wait_for(lambda: len(rows(second, "kind = 'request'")) == 8, 5, what="flushed within ~1s")
    second.signal(signal.SIGKILL)
    second.wait_exit()
    db = sqlite3.connect(second.home / "corrallm.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("SELECT COUNT(*) FROM activity WHERE kind = 'request'").fetchone()[0] == 8
    finally:
        db.close()


def test_C6_metrics_in_prometheus_format(gw):
    assert chat(gw, "local", "coder-key").status_code == 200
    assert chat(gw, "nope", None).status_code == 404
    r = httpx.get(gw.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert (
        'corrallm_requests_total{backend="local#0",group="coders",model="local",status="200"} 1.0'
        in text
    )
    assert 'status="404"' in text
    assert 'corrallm_tokens_total{group="coders",kind="completion",model="local"} 10.0' in text
    assert "corrallm_cost_usd_total" in text and "corrallm_energy_wh_total" in text
    assert 'corrallm_queue_depth{backend="local#0"} 0.0' in text
    assert 'corrallm_in_flight{backend="paid#0"} 0.0' in text
    assert (
        'corrallm_lifecycle_transitions_total{backend="local#0",from_state="starting",'
        'to_state="ready"} 1.0'
    ) in text
    assert 'corrallm_backend_state{backend="local#0",state="ready"} 1.0' in text
    assert "corrallm_backend_load_seconds_total" in text
