"""SPEC §23 E2 through a real gateway, a fake backend and an OTLP/HTTP receiver started by
the test (tests/support/otlp.py): one span per request with the GenAI attributes and
corrallm's own, the child of the client's span, with `queue`, `load` and `upstream`
children; the request sent upstream carries a `traceparent` naming the `upstream` span.
Unset, nothing is exported and no OpenTelemetry module is imported, whatever `OTEL_*`
variables say."""

from __future__ import annotations

import secrets
import signal

import httpx
import pytest

from corrallm.cost.ledger import UNKNOWN_MODEL
from tests.support.otlp import Span, otlp_receiver
from tests.support.processes import fake_cmd

CONFIG = """
priorityGroups:
  coders: {{ weight: 2 }}
keys:
  alice: {{ secret: sk-alice, group: coders }}
models:
  llama:
    backends:
      - cmd: "{cmd}"
        proxy: ${{PORT}}
        model: upstream-llama
{telemetry}
"""
TELEMETRY = """
telemetry:
  otlp:
    endpoint: "{url}/"
    headers: {{ x-collector-key: collector-secret }}
"""


def chat(gw, traceparent: str | None = None, stream: bool = False) -> httpx.Response:
    headers = {"Authorization": "Bearer sk-alice"}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    body = {
        "model": "llama",
        "max_tokens": 5,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def upstream_traceparents(gw) -> list[str | None]:
    r = gw.upstream("GET", "llama/debug/requests", timeout=10)
    return [q["headers"].get("traceparent") for q in r.json() if q["path"].endswith("/completions")]


def by_name(spans: list[Span]) -> dict[str, Span]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), spans  # one of each
    return named


@pytest.fixture
def receiver(monkeypatch):
    # Asked for before gateway_factory, so that it outlives the gateways (their last
    # spans are sent as they stop). The SDK's batch processor exports every 5 s by
    # default; the tests wait for less.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with otlp_receiver() as got:
        yield got


def test_E2_a_request_is_one_span_under_the_clients_with_queue_load_and_upstream(
    receiver, gateway_factory
):
    cmd = fake_cmd("--load-seconds", "0.3")
    gw = gateway_factory(CONFIG.format(cmd=cmd, telemetry=TELEMETRY.format(url=receiver.url)))
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    r = chat(gw, f"00-{trace_id}-{client_span}-01")  # cold: it waits for the load
    spans = by_name(receiver.trace(trace_id, 4))
    assert set(spans) == {"chat llama", "queue", "load", "upstream"}
    request = spans["chat llama"]
    assert request.parent_span_id == client_span and request.kind == "server"
    assert request.service == "corrallm" and request.scope == "corrallm"
    usage = r.json()["usage"]
    assert request.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "llama",
        "gen_ai.response.model": "upstream-llama",
        "gen_ai.request.max_tokens": 5,
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "corrallm.key": "alice",
        "corrallm.group": "coders",
        "corrallm.backend": r.headers["x-corrallm-backend"],
        "corrallm.request_id": r.headers["x-corrallm-request-id"],
        "http.response.status_code": 200,
    }
    assert not request.error
    for name, kind in (("queue", "internal"), ("load", "internal"), ("upstream", "client")):
        child = spans[name]
        assert (child.parent_span_id, child.kind) == (request.span_id, kind), child
        assert request.start_ns <= child.start_ns <= child.end_ns <= request.end_ns, child
    assert spans["queue"].end_ns <= spans["load"].start_ns
    assert spans["load"].end_ns <= spans["upstream"].start_ns
    assert spans["load"].end_ns - spans["load"].start_ns >= 0.3e9  # the backend's start
    # The request went upstream under the upstream span, in the client's trace.
    assert upstream_traceparents(gw) == [f"00-{trace_id}-{spans['upstream'].span_id}-01"]
    assert receiver.exports[0]["x-collector-key"] == "collector-secret"

    # Warm, streamed, no traceparent: a trace of its own, and no load span.
    r = chat(gw, stream=True)
    sent = upstream_traceparents(gw)[-1]
    assert sent is not None
    _, own_trace, upstream_span, flags = sent.split("-")
    assert own_trace != trace_id and flags == "01"
    spans = by_name(receiver.trace(own_trace, 3))
    assert set(spans) == {"chat llama", "queue", "upstream"}
    assert spans["chat llama"].parent_span_id == ""
    assert spans["upstream"].span_id == upstream_span


def test_E2_E1_ollama_paths_are_chat_text_completion_and_embeddings(receiver, gateway_factory):
    gw = gateway_factory(
        CONFIG.format(cmd=fake_cmd(), telemetry=TELEMETRY.format(url=receiver.url))
    )
    asked = {
        "/api/chat": {"messages": [{"role": "user", "content": "hi"}]},
        "/api/generate": {"prompt": "hi"},
        "/api/embed": {"input": "hi"},
    }
    names = {}
    for path, body in asked.items():
        trace_id = secrets.token_hex(16)
        r = httpx.post(
            gw.url + path,
            json={"model": "llama", "stream": False, **body},
            headers={
                "Authorization": "Bearer sk-alice",
                "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        request = next(s for s in receiver.trace(trace_id, 3) if s.name.endswith(" llama"))
        names[path] = (request.name, request.attributes["gen_ai.operation.name"])
    assert names == {
        "/api/chat": ("chat llama", "chat"),
        "/api/generate": ("text_completion llama", "text_completion"),
        "/api/embed": ("embeddings llama", "embeddings"),
    }


def test_E2_a_refused_request_is_traced_and_an_unsampled_client_is_left_alone(
    receiver, gateway_factory
):
    gw = gateway_factory(
        CONFIG.format(cmd=fake_cmd(), telemetry=TELEMETRY.format(url=receiver.url))
    )
    trace_id = secrets.token_hex(16)
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json=body,
        headers={"Authorization": "Bearer sk-alice", "traceparent": traceparent},
        timeout=30,
    )
    assert r.status_code == 404
    (span,) = receiver.trace(trace_id, 1)  # refused at the gates: no queue, no upstream
    # T5: the name asked for is the caller's, never recorded; the span says only that much.
    assert span.name == f"chat {UNKNOWN_MODEL}"
    assert span.attributes["gen_ai.request.model"] == UNKNOWN_MODEL
    assert span.attributes["error.type"] == "model_not_found"
    assert span.attributes["http.response.status_code"] == 404
    assert not span.error  # the caller's mistake, not the gateway's failure

    # The client decided not to sample: no spans, its traceparent goes upstream as it came.
    unsampled = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
    chat(gw, unsampled)
    assert upstream_traceparents(gw) == [unsampled]


def test_E2_unset_it_exports_nothing_and_imports_no_opentelemetry_whatever_OTEL_says(
    receiver, gateway_factory
):
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
        "OTEL_SERVICE_NAME": "corrallm",
        "PYTHONPROFILEIMPORTTIME": "1",  # every module the gateway imports, in its log
    }
    gw = gateway_factory(CONFIG.format(cmd=fake_cmd(), telemetry=""), env=env)
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    chat(gw, traceparent)
    chat(gw, stream=True)
    # The client's traceparent is passed on as it came (no span of corrallm's in between).
    assert upstream_traceparents(gw) == [traceparent, None]
    gw.proc.send_signal(signal.SIGTERM)  # a clean stop: anything queued would be sent
    assert gw.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises it once stopped
    imports = [line for line in gw.log().splitlines() if line.startswith("import time:")]
    assert any("corrallm.proxy.pipeline" in line for line in imports)  # the log has them
    assert [line for line in imports if "opentelemetry" in line or "observe.otlp" in line] == []
    assert receiver.exports == []
