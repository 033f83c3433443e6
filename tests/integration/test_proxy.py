"""SPEC §3 (inference part): the /v1 surface through a real `corrallm serve` process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import httpx
import orjson

from tests.support.processes import fake_cmd, wait_for

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello there"}]}


def config(*flags: str, max_concurrent: int = 4, extra: str = "") -> str:
    return f"""
maxBodySize: 2kB
models:
  chat-model:
    aliases: [chat]
    backends:
      - name: primary
        cmd: "{fake_cmd(*flags)}"
        proxy: ${{PORT}}
        maxConcurrent: {max_concurrent}
        model: upstream-name
        headers: {{Authorization: "Bearer backend-secret", X-Extra: "yes"}}
  hidden:
    unlisted: true
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: embed}}]
{extra}"""


def recorded(gw, model: str = "chat") -> list[dict]:
    r = gw.upstream("GET", f"{model}/debug/requests", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["requests"] if isinstance(r.json(), dict) else r.json()


def stats(gw, model: str = "chat") -> dict:
    return gw.upstream("GET", f"{model}/debug/stats", timeout=10).json()


def test_models_lists_served_models_with_aliases_and_hides_unlisted(gateway_factory):
    gw = gateway_factory(config())
    body = httpx.get(gw.v1 + "/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["chat-model"]
    assert body["data"][0]["aliases"] == ["chat"]
    # unlisted is hidden, not unreachable
    r = httpx.post(gw.v1 + "/embeddings", json={"model": "hidden", "input": "x"}, timeout=30)
    assert r.status_code == 200


def test_alias_resolves_and_upstream_gets_its_model_name_and_headers_not_the_callers_key(
    gateway_factory,
):
    gw = gateway_factory(config())
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json=CHAT,
        headers={"Authorization": "Bearer caller-secret", "X-Corrallm-Key": "caller-2"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-corrallm-backend"] == "primary"
    seen = [q for q in recorded(gw) if q["path"] == "/v1/chat/completions"][-1]
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert seen["body"]["model"] == "upstream-name"
    assert headers["authorization"] == "Bearer backend-secret"
    assert headers["x-extra"] == "yes"
    assert "x-corrallm-key" not in headers
    assert "caller-secret" not in str(seen)


def test_unknown_model_is_404_model_not_found(gateway_factory):
    gw = gateway_factory(config())
    r = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "model": "nope"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found"
    assert "chat-model" in error["message"] and "nope" in error["message"]


def test_malformed_json_and_missing_model_are_400(gateway_factory):
    gw = gateway_factory(config())
    bad = httpx.post(gw.v1 + "/chat/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = httpx.post(gw.v1 + "/chat/completions", json={"messages": []}, timeout=10)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    listy = httpx.post(gw.v1 + "/completions", json=[1, 2], timeout=10)
    assert listy.status_code == 400


def test_body_over_max_body_size_is_413(gateway_factory):
    gw = gateway_factory(config())
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(gw.v1 + "/chat/completions", json=big, timeout=10)
    assert r.status_code == 413
    assert "maxBodySize" in r.json()["error"]["message"]

    def chunked():
        yield orjson.dumps(big)

    r = httpx.post(gw.v1 + "/chat/completions", content=chunked(), timeout=10)
    assert r.status_code == 413


def test_unknown_endpoint_404_and_wrong_method_405_are_openai_shaped(gateway_factory):
    gw = gateway_factory(config())
    r = httpx.get(gw.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(gw.v1 + "/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_health_and_healthz_answer(gateway_factory):
    gw = gateway_factory(config())
    assert httpx.get(gw.url + "/health").json() == {"status": "ok"}
    assert httpx.get(gw.url + "/healthz").status_code == 200


def test_upstream_passthrough_loads_the_backend_and_keeps_the_query_string(gateway_factory):
    gw = gateway_factory(config())
    r = gw.upstream("GET", "chat/props?x=1&y=two", timeout=30)
    assert r.status_code == 200 and r.json()["total_slots"] == 1
    seen = recorded(gw)
    assert any(q["path"] == "/props" and q["query"] == "x=1&y=two" for q in seen)
    page = gw.upstream("GET", "chat-model/", timeout=10)
    assert page.status_code == 200 and "html" in page.headers["content-type"]


def test_streaming_is_passed_through_chunk_by_chunk(gateway_factory):
    gw = gateway_factory(config("--tokens", "8", "--token-delay", "0.15"))
    arrivals = []
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=30
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic(), line))
    assert arrivals[-1][1] == "data: [DONE]"
    # Not buffered: the first token reached us long before the last one was generated.
    assert arrivals[-1][0] - arrivals[0][0] > 0.6


def test_max_concurrent_is_never_exceeded_and_excess_waits(gateway_factory):
    gw = gateway_factory(config("--latency", "0.3", max_concurrent=2))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(
            pool.map(
                lambda _: httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30),
                range(6),
            )
        )
    assert [r.status_code for r in results] == [200] * 6
    s = stats(gw)
    assert s["max_in_flight"] == 2 and s["completed"] >= 6


def test_S7_client_disconnect_leaves_the_queue_and_cancels_its_upstream_request(
    gateway_factory,
):
    gw = gateway_factory(config("--tokens", "40", "--token-delay", "0.1", max_concurrent=1))
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    before = len(recorded(gw))

    # A holds the only slot with a long stream; B queues behind it, then its client leaves.
    first_chunk = threading.Event()

    def stream_a() -> None:
        with httpx.stream(
            "POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=30
        ) as r:
            for _ in r.iter_lines():
                first_chunk.set()
                break  # the client goes away mid-stream

    a = threading.Thread(target=stream_a)
    a.start()
    assert first_chunk.wait(10)
    a.join(10)
    wait_for(lambda: stats(gw)["cancelled"] >= 1, 10, what="upstream cancel of A")
    wait_for(lambda: stats(gw)["in_flight"] == 0, 10, what="A's upstream ended")

    # The slot is free again at once, not after A's 4 s stream.
    default = next(x for x in gw.api("GET", "lanes").json()["lanes"] if x["name"] == "default")
    assert default["in_flight"] == 0
    assert httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 1}).is_success
    # A queued client that leaves never reaches the backend.
    holder = threading.Thread(
        target=lambda: httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    )
    holder.start()
    wait_for(lambda: stats(gw)["in_flight"] == 1, 10, what="the holder in flight")
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "queued": True}, timeout=0.5)
    holder.join(30)
    wait_for(lambda: stats(gw)["in_flight"] == 0, 10, what="holder done")
    seen = recorded(gw)[before:]
    assert not any(q["body"] and q["body"].get("queued") for q in seen)


def test_backend_crash_mid_stream_ends_with_an_error_event_and_done(gateway_factory):
    gw = gateway_factory(config("--crash-after-tokens", "3"))
    events = []
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=30
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "backend_error" and "primary" in error["message"]
    for event in events[:-2]:
        orjson.loads(event)  # no torn event before the error


def test_F2_backend_max_tokens_clamps_requests(gateway_factory):
    extra = f"""
  small:
    backends:
      - cmd: "{fake_cmd("--tokens", "50")}"
        proxy: ${{PORT}}
        maxTokens: 5
"""
    gw = gateway_factory(config(extra=extra))
    r = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "model": "small", "max_tokens": 100})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    r = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "model": "small"})
    assert r.json()["usage"]["completion_tokens"] == 5


def test_L1_port_placeholder_in_a_url_with_a_v1_path_llama_swap_style(gateway_factory):
    # llama-swap's `proxy: http://127.0.0.1:${PORT}`, here with an OpenAI base-URL path:
    # health is polled at the origin, and requests are not sent to /v1/v1/...
    gw = gateway_factory(
        f"""
models:
  chat:
    backends: [{{cmd: "{fake_cmd("--load-seconds", "0.3")}", proxy: "http://127.0.0.1:${{PORT}}/v1"}}]
"""
    )
    r = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200, r.text
    assert [q["path"] for q in recorded(gw)] == ["/v1/chat/completions"]
    assert gw.state("chat#0") == "ready"
