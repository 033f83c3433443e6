"""SPEC §23 E2, the pure side of traces (corrallm/observe/traces.py): the W3C
`traceparent`, sampling, the header sent upstream, and the spans a settled visit makes;
the SDK's side (observe/otlp.py) and a missing `otel` extra; E3's fleet gauges from
scripted loads."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from corrallm.config import load_config_text
from corrallm.config.schema import TelemetryConfig
from corrallm.cost.ledger import UNKNOWN_MODEL, Visit
from corrallm.cost.model import Metered
from corrallm.extras import MissingExtra
from corrallm.lifecycle.description import Description
from corrallm.lifecycle.state import State
from corrallm.observe.fleet import model_load
from corrallm.observe.spans import SpanRecord
from corrallm.observe.traces import Trace, Tracer, parse_traceparent, spans, tracer_for

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Sink:
    def __init__(self, fail: bool = False) -> None:
        self.got: list[tuple[int, list[SpanRecord]]] = []
        self.fail = fail

    def export(self, trace_id: int, records: Sequence[SpanRecord]) -> None:
        if self.fail:
            raise RuntimeError("the collector's queue is gone")
        self.got.append((trace_id, list(records)))

    def close(self) -> None:
        pass


def visit(**changes: object) -> Visit:
    v = Visit("alice", "coders", "llama", "/v1/chat/completions", 100)
    v.arrived, v.arrived_mono, v.request_id = 1_000.0, 50.0, "r1"
    for name, value in changes.items():
        setattr(v, name, value)
    return v


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (f"00-{TRACE}-{PARENT}-01", (int(TRACE, 16), int(PARENT, 16), True)),
        (f"00-{TRACE}-{PARENT}-00", (int(TRACE, 16), int(PARENT, 16), False)),
        (f"01-{TRACE}-{PARENT}-03-later-fields", (int(TRACE, 16), int(PARENT, 16), True)),
        (f"00-{TRACE}-{PARENT}-01-x", None),  # version 00 has no more fields
        (f"ff-{TRACE}-{PARENT}-01", None),
        (f"00-{'0' * 32}-{PARENT}-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        (f"00-{TRACE.upper()}-{PARENT}-01", None),
        (b"garbage", None),
    ],
)
def test_E2_traceparent_is_read_as_w3c_trace_context_says(value, parsed):
    raw = value if isinstance(value, bytes) else value.encode()
    assert parse_traceparent(raw) == parsed


def test_E2_a_sampled_client_trace_is_continued_and_upstream_names_the_upstream_span():
    tracer = Tracer(Sink(), sample_ratio=0.0)  # a sampled parent decides, whatever the ratio
    headers = [(b"host", b"x"), (b"traceparent", f"00-{TRACE}-{PARENT}-01".encode())]
    trace = tracer.begin(visit(), "llama-alias", 5, headers)
    assert trace is not None
    assert (trace.trace_id, trace.parent_id, trace.model) == (
        int(TRACE, 16),
        int(PARENT, 16),
        "llama-alias",
    )
    assert headers == [
        (b"host", b"x"),
        (b"traceparent", f"00-{TRACE}-{trace.upstream_id:016x}-01".encode()),
    ]


def test_E2_an_unsampled_client_is_left_alone_and_the_ratio_decides_for_new_traces():
    header = (b"traceparent", f"00-{TRACE}-{PARENT}-00".encode())
    headers = [header]
    assert Tracer(Sink()).begin(visit(), "llama", None, headers) is None
    assert headers == [header]  # passed on as it came
    assert Tracer(Sink(), 0.0).begin(visit(), "llama", None, []) is None
    headers = [(b"traceparent", b"not-a-traceparent")]
    trace = Tracer(Sink(), 1.0).begin(visit(), "llama", None, headers)
    assert trace is not None and trace.parent_id is None  # an invalid one: a new trace
    assert headers == [
        (b"traceparent", f"00-{trace.trace_id:032x}-{trace.upstream_id:016x}-01".encode())
    ]
    kept = sum(
        Tracer(Sink(), 0.25).begin(visit(), "m", None, None) is not None for _ in range(4000)
    )
    assert 800 < kept < 1200


def test_E2_T5_a_model_nobody_serves_is_named_as_the_visit_names_it():
    trace = Tracer(Sink()).begin(visit(model=UNKNOWN_MODEL), "made-up-name", None, None)
    assert trace is not None and trace.model == UNKNOWN_MODEL


def trace(sink: Sink | None = None, parent: int | None = 7) -> Trace:
    return Trace(sink or Sink(), 1, 2, 3, parent, "llama", 16)


def test_E2_a_served_request_has_queue_load_and_upstream_spans_from_its_waits():
    backend = (
        load_config_text(
            "models: {llama: {backends: [{proxy: 'http://127.0.0.1:9', model: up-llama}]}}"
        )
        .models["llama"]
        .backends[0]
    )
    v = visit(
        status=200,
        queue_ms=500.0,
        load_ms=2_000.0,
        admitted_mono=51.0,
        backend=backend,
        backend_id="llama",
        metered=Metered(10, 4),
    )
    request, queue, load, upstream = spans(trace(), v, True, 60.0)
    assert request == SpanRecord(
        "chat llama",
        2,
        7,
        True,
        "server",
        1_000 * 10**9,
        1_010 * 10**9,
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "llama",
            "corrallm.group": "coders",
            "http.response.status_code": 200,
            "corrallm.request_id": "r1",
            "corrallm.key": "alice",
            "gen_ai.request.max_tokens": 16,
            "corrallm.backend": "llama",
            "gen_ai.response.model": "up-llama",
            "gen_ai.usage.input_tokens": 10,
            "gen_ai.usage.output_tokens": 4,
        },
        None,
    )
    ns = 10**9
    assert [
        (s.name, s.parent_id, s.kind, s.start_ns, s.end_ns) for s in (queue, load, upstream)
    ] == [
        ("queue", 2, "internal", int(1_000.5 * ns), 1_001 * ns),
        ("load", 2, "internal", 1_001 * ns, 1_003 * ns),
        ("upstream", 2, "client", 1_003 * ns, 1_010 * ns),
    ]
    assert upstream.span_id == 3  # the id its traceparent named


def test_E2_refused_failed_and_estimated_requests():
    refused = spans(
        trace(parent=None), visit(status=429, error="rate_limited: too many"), False, 51.0
    )
    (request,) = refused  # no queue reached, nothing upstream
    assert (request.parent_id, request.remote_parent, request.error) == (None, False, None)
    assert request.attributes["error.type"] == "rate_limited"
    # A backend that failed to start: queued and loading, never upstream; a failure.
    failed = visit(status=503, error="backend_failed: it exited", admitted_mono=50.0, load_ms=100.0)
    names = [(s.name, s.error) for s in spans(trace(), failed, False, 50.2)]
    assert names == [("chat llama", "backend_failed: it exited"), ("queue", None), ("load", None)]
    # C2: counts the backend did not report are estimates, not usage.
    guessed = spans(trace(), visit(status=200, metered=Metered(10, 4, estimated=True)), False, 51)
    assert "gen_ai.usage.input_tokens" not in guessed[0].attributes
    # S4: queued again after its first admission: one queue span, within the request.
    (_, queue) = spans(trace(), visit(status=499, queue_ms=5_000.0, admitted_mono=51.0), False, 57)
    assert queue.start_ns == 1_000 * 10**9 and queue.end_ns == 1_001 * 10**9


def test_E2_a_trace_that_cannot_be_exported_never_fails_its_request(caplog):
    trace(Sink(fail=True)).end(visit(status=200), True)
    assert "could not be exported" in caplog.text


def test_E2_unset_there_is_no_tracer():
    assert tracer_for(TelemetryConfig()) is None


def test_E2_set_without_the_extra_is_one_line_naming_it(monkeypatch):
    # The SDK hidden: its modules unimportable, corrallm's module of it imported afresh.
    for name in list(sys.modules):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    monkeypatch.delitem(sys.modules, "corrallm.observe.otlp", raising=False)
    config = TelemetryConfig.model_validate({"otlp": {"endpoint": "http://127.0.0.1:4318"}})
    with pytest.raises(MissingExtra) as raised:
        tracer_for(config)
    (line,) = str(raised.value).splitlines()
    assert "telemetry.otlp" in line and "pip install 'corrallm[otel]'" in line


def test_E2_the_sdk_gets_the_spans_with_their_ids_parents_and_status():
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanKind, StatusCode

    from corrallm.observe.otlp import OtlpSink

    class Keep:
        def __init__(self) -> None:
            self.spans: list[ReadableSpan] = []

        def on_end(self, span: ReadableSpan) -> None:
            self.spans.append(span)

        def shutdown(self) -> None:
            pass

    keep = Keep()
    config = TelemetryConfig.model_validate({"otlp": {"endpoint": "http://127.0.0.1:4318"}})
    assert config.otlp is not None
    sink = OtlpSink(config.otlp, keep)  # type: ignore[arg-type]
    failed = visit(status=502, error="backend_error: it broke", admitted_mono=50.0)
    trace(sink).end(failed, True, 51.0)
    request, _, upstream = keep.spans
    assert request.context is not None and request.parent is not None
    assert (request.context.trace_id, request.context.span_id) == (1, 2)
    assert (request.parent.span_id, request.parent.is_remote) == (7, True)
    assert (request.kind, request.status.status_code) == (SpanKind.SERVER, StatusCode.ERROR)
    assert upstream.parent is not None and not upstream.parent.is_remote
    assert (upstream.kind, upstream.resource.attributes["service.name"]) == (
        SpanKind.CLIENT,
        "corrallm",
    )


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("collector:4318", "not an http(s) URL"),
        ("http://collector:4318/v1/traces", "corrallm adds /v1/traces itself"),
    ],
)
def test_E2_the_endpoint_is_the_collectors_base_url(endpoint, problem):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape(problem)):
        TelemetryConfig.model_validate({"otlp": {"endpoint": endpoint}})


# -- E3: fleet gauges from the owners' state ----------------------------------------------


@dataclass
class Endpoint:
    kind: str
    state: State

    def describe(self) -> Description:
        return Description(self.kind, self.state, "http://127.0.0.1:9")  # type: ignore[arg-type]


@dataclass
class Route:
    id: str
    endpoint: Endpoint


@dataclass
class Served:
    routes: list[Route]


def test_E3_queue_depth_counts_every_backend_and_the_ratio_the_loaded_local_ones():
    loads = {"a": (2, 2, 3), "b": (4, 1, 1), "asleep": (8, 0, 2), "peer": (4, 4, 5)}
    served = Served(
        [
            Route("a", Endpoint("process", State.READY)),
            Route("b", Endpoint("proxy", State.READY)),
            Route("asleep", Endpoint("process", State.ASLEEP)),
            Route("peer", Endpoint("peer", State.READY)),
        ]
    )
    assert model_load(served, loads.__getitem__) == (11, 3 / 6)  # type: ignore[arg-type]
    idle = Served([Route("asleep", Endpoint("process", State.STOPPED))])
    assert model_load(idle, lambda _: (4, 0, 0)) == (0, 0.0)  # type: ignore[arg-type]
