"""SPEC §10 P1/P3, §14, §4 L4 through the management API of a real gateway."""

from __future__ import annotations

import http.client
import signal
import stat
import threading

import httpx
import psutil
import pytest

from tests.support.processes import fake_cmd, wait_for

SLOW = fake_cmd("--load-seconds", "2", "--n-ctx", "1024", "--n-slots", "2")
CONFIG = f"""
extensions:
  shared: {{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}
models:
  m:
    aliases: [alias-m]
    backends: [{{cmd: "{SLOW}", proxy: "${{PORT}}"}}]
  pinned:
    persistent: true
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
  one: {{backends: [{{extension: shared}}]}}
  two: {{backends: [{{extension: shared, type: embed}}]}}
"""

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def chat(gw, model: str) -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", json={"model": model, **CHAT}, timeout=60)


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(CONFIG)


def test_P3_admin_token_is_generated_with_mode_0600(gw):
    mode = stat.S_IMODE((gw.home / "admin.token").stat().st_mode)
    assert mode == 0o600 and len(gw.token) >= 32


def test_P3_api_needs_the_token_as_bearer_or_cookie_and_inference_stays_open(gw):
    url = gw.url + "/api/v1/overview"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    assert httpx.get(url, headers={"Authorization": f"Bearer {gw.token}"}).status_code == 200
    assert httpx.get(url, headers={"Cookie": f"corrallm_token={gw.token}"}).status_code == 200
    assert httpx.get(gw.url + "/health").status_code == 200
    assert httpx.get(gw.v1 + "/models").status_code == 200
    assert httpx.get(gw.url + "/api/v1/openapi.json").status_code == 401


TRICKS = [
    "/api/../api/v1/overview",
    "/api/v1/../v1/overview",
    "/v1/../api/v1/overview",
    "/./api/v1/overview",
    "/API/v1/overview",
    "/Api/v1/overview",
    "//api/v1/overview",
    "/api//v1/overview",
    "/api/v1//overview",
    "/api/v1/%6Fverview",
    "/api%2Fv1%2Foverview",
    "/%61pi/v1/overview",
    "/api/v1/overview/",
    "/api\\v1\\overview",
]


def test_P3_no_path_trick_gets_round_the_admin_check(gw):
    port = int(gw.url.rsplit(":", 1)[1])
    for path in TRICKS:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", path)  # sent exactly as written: no client-side normalisation
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        assert response.status in (401, 404), (path, response.status, body)
        assert b'"models"' not in body


def test_P1_F3_pause_unloads_and_answers_503_paused_without_retry_after(gw):
    assert chat(gw, "m").status_code == 200
    pid = gw.pid_of("m#0")
    paused = gw.api("POST", "models/pause", {"model": "alias-m"})
    assert paused.status_code == 200 and paused.json()["paused"] is True
    assert not psutil.pid_exists(pid)
    response = chat(gw, "m")
    assert response.status_code == 503 and response.json()["error"]["code"] == "paused"
    assert "retry-after" not in response.headers
    load = gw.api("POST", "models/load", {"model": "m"})
    assert load.status_code == 423
    model = next(x for x in gw.api("GET", "overview").json()["models"] if x["name"] == "m")
    assert model["paused"] is True and model["state"] == "paused"
    assert gw.api("POST", "models/unpause", {"model": "m"}).status_code == 200
    assert chat(gw, "m").status_code == 200


@pytest.mark.serve_process
def test_P1_C5_pauses_survive_a_restart_and_keep_a_pinned_model_from_preloading(gateway_factory):
    first = gateway_factory(CONFIG)
    wait_for(lambda: first.state("pinned#0") == "ready", 20, what="preload")
    assert first.api("POST", "models/pause", {"model": "pinned"}).status_code == 200
    assert first.api("POST", "models/pause", {"model": "m"}).status_code == 200
    first.signal(signal.SIGTERM)
    first.wait_exit()

    second = gateway_factory(CONFIG, home=first.home)
    assert chat(second, "m").json()["error"]["code"] == "paused"
    assert second.state("pinned#0") == "paused"  # not preloaded at boot
    # Resuming a pinned model loads it again by itself.
    assert second.api("POST", "models/unpause", {"model": "pinned"}).status_code == 200
    wait_for(lambda: second.state("pinned#0") == "ready", 20, what="reload after unpause")


def test_F3_a_pause_with_until_answers_retry_after_the_seconds_until_it_ends(gw):
    """Issue 30: a paused model's 503 carried no Retry-After even when the pause had an
    `until`."""
    assert gw.api("POST", "models/pause", {"model": "m", "until": "1h"}).status_code == 200
    response = chat(gw, "m")
    assert response.status_code == 503 and response.json()["error"]["code"] == "paused"
    assert 3500 <= int(response.headers["retry-after"]) <= 3600, response.headers


def test_P1_a_pause_until_a_time_expires_by_itself(gw):
    response = gw.api("POST", "models/pause", {"model": "m", "until": "2s"})
    assert response.status_code == 200 and response.json()["paused_until"].endswith("Z")
    assert chat(gw, "m").status_code == 503
    wait_for(lambda: chat(gw, "m").status_code == 200, 20, interval=0.3, what="pause expiry")


def test_P1_L8_an_extension_pause_covers_every_model_it_hosts(gw):
    assert chat(gw, "one").status_code == 200
    pid = gw.pid_of("extension:shared")
    assert gw.api("POST", "extensions/pause", {"extension": "shared"}).status_code == 200
    assert not psutil.pid_exists(pid)
    for model in ("one", "two"):
        r = httpx.post(gw.v1 + "/embeddings", json={"model": model, "input": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "paused"
    assert gw.api("POST", "extensions/load", {"extension": "shared"}).status_code == 423
    assert gw.api("POST", "extensions/unpause", {"extension": "shared"}).status_code == 200
    assert gw.api("POST", "extensions/load", {"extension": "shared"}).status_code == 200
    assert chat(gw, "two").status_code == 200


def test_L4_explicit_load_waits_for_ready_and_a_second_one_while_loading_is_409(gw):
    results: dict[str, httpx.Response] = {}
    loader = threading.Thread(
        target=lambda: results.update(first=gw.api("POST", "models/load", {"model": "m"}))
    )
    loader.start()
    wait_for(lambda: gw.state("m#0") == "starting", 10, what="starting")
    second = gw.api("POST", "models/load", {"model": "m"})
    assert second.status_code == 409 and second.json()["error"]["code"] == "lifecycle_busy"
    loader.join(30)
    assert results["first"].status_code == 200 and results["first"].json()["state"] == "ready"
    unloaded = gw.api("POST", "models/unload", {"model": "m"})
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "stopped"


def test_models_logs_shows_the_tail_and_parsed_n_ctx_n_slots(gw):
    assert gw.api("POST", "models/load", {"model": "m"}).status_code == 200
    logs = gw.api("GET", "models/logs?model=m&lines=500").json()
    assert logs["model"] == "m" and (logs["n_ctx"], logs["n_slots"]) == (1024, 2)
    assert any("server is listening" in line for line in logs["lines"])
    backend = gw.overview_backend("m#0")
    assert (backend["n_ctx"], backend["n_slots"]) == (1024, 2) and backend["pid"]


def test_bad_management_input_is_a_clear_4xx(gw):
    missing = gw.api("POST", "models/load", {})
    assert missing.status_code == 400 and "model" in missing.json()["error"]["message"]
    unknown = gw.api("POST", "models/pause", {"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    past = gw.api("POST", "models/pause", {"model": "m", "until": "2001-01-01T00:00:00Z"})
    assert past.status_code == 400 and "past" in past.json()["error"]["message"]
    nonsense = gw.api("POST", "models/pause", {"model": "m", "until": "soonish"})
    assert nonsense.status_code == 400
    extra = gw.api("POST", "models/unload", {"model": "m", "forse": True})
    assert extra.status_code == 400
    hosted = gw.api("POST", "models/unload", {"model": "one"})
    assert hosted.status_code == 409 and "extension" in hosted.json()["error"]["message"]
    assert gw.api("GET", "nothing").status_code == 404
    assert gw.api("GET", "models/logs").status_code == 400


def test_openapi_document_lists_the_management_endpoints(gw):
    paths = gw.api("GET", "openapi.json").json()["paths"]
    for name in (
        "overview",
        "residency",
        "models/load",
        "models/unload",
        "models/pause",
        "models/unpause",
        "models/logs",
        "extensions/load",
        "extensions/unload",
        "extensions/pause",
        "extensions/unpause",
    ):
        assert f"/api/v1/{name}" in paths


def test_fault9_P6_a_reload_of_a_vanished_config_names_the_file_and_keeps_the_old(gw):
    """Before: the refusal said only '(file): cannot read the config: No such file or
    directory', naming no file."""

    assert chat(gw, "m").status_code == 200
    config = gw.config_path
    config.unlink()
    refused = gw.api("POST", "config/reload")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "invalid_config"
    assert str(config) in error["message"] and "No such file" in error["message"]
    assert "old one stays in force" in error["message"]
    assert "back at" in error["message"]  # the fix
    assert chat(gw, "m").status_code == 200  # the old config is still in force
    assert [m["name"] for m in gw.api("GET", "overview").json()["models"]] == [
        "m",
        "pinned",
        "one",
        "two",
    ]


def _post_raw(gw, path: str, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {gw.token}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    return httpx.post(f"{gw.url}/api/v1/{path}", content=body, headers=headers, timeout=60)


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_P1_a_json_body_sent_as_a_form_as_curl_d_does_is_read_as_json(gw, content_type):
    """`curl -d '{"model": "m"}'` says application/x-www-form-urlencoded: before, the pause
    was refused with 'body: Input should be a valid dictionary', not saying why."""
    paused = _post_raw(gw, "models/pause", b'{"model": "m", "until": "2h"}', content_type)
    assert paused.status_code == 200, paused.text
    assert paused.json()["paused"] is True and paused.json()["paused_until"]


@pytest.mark.parametrize(
    ("body", "content_type", "said"),
    [
        (b"model=m", "application/x-www-form-urlencoded", "not valid JSON"),
        (b"model=m", "application/json", "not valid JSON"),
        (b"--x\r\n", "multipart/form-data; boundary=x", "came as multipart/form-data, not JSON"),
    ],
)
def test_P1_a_body_that_is_not_json_is_refused_saying_what_to_send(gw, body, content_type, said):
    refused = _post_raw(gw, "models/pause", body, content_type)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "invalid_request"
    assert said in error["message"]
    assert "send it with 'Content-Type: application/json'" in error["message"]
    assert gw.api("GET", "overview").json()["models"][0]["paused"] is False
