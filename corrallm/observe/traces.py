"""Traces of requests (SPEC §23 E2): one span per request, named `<operation> <model>`
with the GenAI semantic conventions' attributes and corrallm's own, children `queue`,
`load` (when it waited for a start or wake) and `upstream`; a client's W3C
`traceparent` is continued, and the request sent upstream carries one naming the
`upstream` span. Spans leave through the OpenTelemetry SDK's batch processor and OTLP/HTTP
exporter (observe/otlp.py, the `otel` extra), imported only when `telemetry.otlp` is set.

Off, the gateway has no tracer and a request pays two `is not None` tests for it (the
tracer's at the start, the trace's at the end): nothing is imported, whatever `OTEL_*`
variables say. On, spans are made once, when the request
is settled, from what the pipeline records anyway (its arrival, the queue and load waits
of its `Visit`, its first admission, its end): no span object lives while the request
does, no context variable is set. Only the ids are drawn at the start, for the upstream
`traceparent`. bench/tracing.py measures this against live SDK spans per phase.

This module is pure (ids, sampling, the `traceparent` header, the spans' times and
attributes); the `Sink` (observe/spans.py) does the SDK's part.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import MutableSequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corrallm.cost.ledger import UNKNOWN_MODEL
from corrallm.extras import MissingExtra, missing_extra
from corrallm.observe.spans import Attributes, Sink, SpanRecord

if TYPE_CHECKING:
    from corrallm.config.schema import TelemetryConfig
    from corrallm.cost.ledger import Visit

log = logging.getLogger("corrallm.traces")

TRACEPARENT = b"traceparent"

# `gen_ai.operation.name` by the path a request came in on: the GenAI conventions' own
# names where one fits, else the surface's. A new surface is one line here (Ollama's
# /api/chat: chat, /api/generate: text_completion, /api/embed: embeddings).
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/audio/speech": "speech",
    "/v1/audio/transcriptions": "transcription",
    "/v1/audio/translations": "translation",
    "/v1/realtime": "realtime",
    "/upstream": "upstream",
    "/api/chat": "chat",  # Ollama's (SPEC §23 E1)
    "/api/generate": "text_completion",
    "/api/embed": "embeddings",
    "/api/embeddings": "embeddings",
}

# W3C Trace Context: version-trace_id-parent_id-flags, lowercase hex; a later version may
# add fields after a dash (version 00 may not), and version ff is invalid.
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_LOW64 = (1 << 64) - 1


def tracer_for(telemetry: TelemetryConfig) -> Tracer | None:
    """The gateway's tracer: None unless `telemetry.otlp` is set (then the SDK is loaded,
    or `MissingExtra` names the `otel` extra)."""
    otlp = telemetry.otlp
    if otlp is None:
        return None
    try:
        from corrallm.observe.otlp import OtlpSink  # the SDK: the `otel` extra
    except ImportError as exc:
        missing = missing_extra(
            exc,
            "opentelemetry",
            "telemetry.otlp needs the OpenTelemetry SDK and its OTLP/HTTP exporter",
            "otel",
        )
        if missing is None:
            raise
        raise missing from None
    return Tracer(OtlpSink(otlp), telemetry.sample_ratio)


def retrace(old: Tracer | None, telemetry: TelemetryConfig) -> Tracer | None:
    """A reload's new `telemetry` in force (the gateway's, and each `--workers` worker's):
    its tracer, or None with one error line when the extra is missing; the old tracer
    sends what it queued in a thread, off the event loop (requests under way at the
    switch end on it and lose their spans)."""
    try:
        new = tracer_for(telemetry)
    except MissingExtra as exc:
        log.error("telemetry: %s; requests are not traced", exc)
        new = None
    if old is not None:
        threading.Thread(target=old.close, name="corrallm-traces", daemon=True).start()
    return new


class Tracer:
    """Starts traces (ids, sampling, the upstream `traceparent`); `Trace.end` makes the
    spans. Sampling is the SDK's `ParentBased(TraceIdRatioBased(sample_ratio))` made
    explicit: a client's sampled flag decides for its request, else the trace id's low
    64 bits against `sample_ratio`, so every hop of one trace decides alike."""

    __slots__ = ("_bound", "sink")

    def __init__(self, sink: Sink, sample_ratio: float = 1.0) -> None:
        self.sink = sink
        self._bound = int(sample_ratio * (1 << 64))

    def begin(
        self,
        visit: Visit,
        requested: str,
        max_tokens: int | None,
        headers: MutableSequence[tuple[bytes, bytes]] | None,
    ) -> Trace | None:
        """The request's trace, or None when it is not sampled. `headers` (the request's
        own, as they are forwarded upstream) get the `traceparent` naming the upstream
        span, in place of the client's; a request not sampled keeps the client's."""
        parent_id: int | None = None
        at = -1
        if headers is not None:
            for i, (name, value) in enumerate(headers):
                if name == TRACEPARENT:
                    at = i
                    parent = parse_traceparent(value)
                    if parent is not None:
                        trace_id, parent_id, sampled = parent
                        if not sampled:
                            return None  # the client's choice: its traceparent goes on
                    break
        if parent_id is None:
            trace_id = random.getrandbits(128) or 1
            if trace_id & _LOW64 >= self._bound:
                return None
        span_id, upstream_id = _span_id(), _span_id()
        if headers is not None:
            value = b"00-%032x-%016x-01" % (trace_id, upstream_id)
            if at < 0:
                headers.append((TRACEPARENT, value))
            else:
                headers[at] = (TRACEPARENT, value)
        # T5: a model nobody serves is named as the visit names it, never as asked.
        model = requested if visit.model != UNKNOWN_MODEL else UNKNOWN_MODEL
        return Trace(self.sink, trace_id, span_id, upstream_id, parent_id, model, max_tokens)

    def close(self) -> None:
        self.sink.close()


@dataclass(slots=True, eq=False)
class Trace:
    """One request's trace while it runs: its ids and what only the start knew."""

    sink: Sink
    trace_id: int
    span_id: int  # the request span's
    upstream_id: int  # the upstream span's, named in the upstream request's traceparent
    parent_id: int | None  # the client's span, when it sent a sampled traceparent
    model: str  # the model asked for (an alias stays an alias)
    max_tokens: int | None

    def end(self, visit: Visit, ran: bool, now: float | None = None) -> None:
        """The request is settled: its spans to the sink. `ran`: it was talking to its
        backend when it ended (an upstream span). Never raises: a trace must not fail
        the request it describes."""
        try:
            end = time.monotonic() if now is None else now
            self.sink.export(self.trace_id, spans(self, visit, ran, end))
        except Exception:
            log.exception("request=%s: its trace could not be exported", visit.request_id)


def spans(trace: Trace, visit: Visit, ran: bool, end: float) -> list[SpanRecord]:
    """The request's spans from its visit, `end` its monotonic end. Each phase is drawn
    from the waits the visit adds up: a request queued twice (requeued after a
    preemption, S4) shows one queue span as long as both, ending at its first
    admission, and its upstream span from then to the end."""
    offset = visit.arrived - visit.arrived_mono

    def ns(mono: float) -> int:
        return int((mono + offset) * 1e9)

    operation = OPERATIONS.get(visit.endpoint, visit.endpoint)
    status = visit.status
    attributes: Attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": trace.model,
        "corrallm.group": visit.group,
        "http.response.status_code": status,
    }
    if visit.request_id is not None:
        attributes["corrallm.request_id"] = visit.request_id
    if visit.key is not None:
        attributes["corrallm.key"] = visit.key
    if trace.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = trace.max_tokens
    backend = visit.backend
    if visit.backend_id is not None:
        attributes["corrallm.backend"] = visit.backend_id
    if ran and backend is not None:
        attributes["gen_ai.response.model"] = backend.model or visit.model
    metered = visit.metered
    if metered is not None and not metered.estimated:  # C2: an estimate is no usage
        attributes["gen_ai.usage.input_tokens"] = metered.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = metered.completion_tokens
    error = None
    if status >= 400 or status == 0:
        why = visit.error or ""
        attributes["error.type"] = why.split(":", 1)[0] if ":" in why else str(status)
        if status >= 500 or status == 0:  # a client's own mistake is no failure here
            error = why or f"status {status}"
    start = visit.arrived_mono
    own = trace.span_id
    out = [
        SpanRecord(
            f"{operation} {trace.model}",
            own,
            trace.parent_id,
            trace.parent_id is not None,
            "server",
            ns(start),
            ns(end),
            attributes,
            error,
        )
    ]
    admitted = visit.admitted_mono
    queued = visit.queue_ms / 1000
    if admitted is not None or queued > 0:  # it reached the queue
        left = admitted if admitted is not None else end
        began = max(start, left - queued)
        out.append(_phase("queue", own, ns(began), ns(left)))
    if admitted is not None:
        ready = min(end, admitted + visit.load_ms / 1000)
        if visit.load_ms > 0:
            out.append(_phase("load", own, ns(admitted), ns(ready)))
        if ran:
            upstream: Attributes = {}
            if visit.backend_id is not None:
                upstream["corrallm.backend"] = visit.backend_id
            out.append(
                SpanRecord(
                    "upstream",
                    trace.upstream_id,
                    own,
                    False,
                    "client",
                    ns(ready),
                    ns(end),
                    upstream,
                    error,
                )
            )
    return out


def parse_traceparent(value: bytes) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C `traceparent`; None if it is not a
    valid one (then the request starts a trace of its own, as the spec says)."""
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_hex, parent_hex, flags, rest = match.groups()
    if version == b"ff" or (version == b"00" and rest):
        return None
    trace_id, parent_id = int(trace_hex, 16), int(parent_hex, 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, bool(int(flags, 16) & 1)


def _phase(name: str, parent: int, start_ns: int, end_ns: int) -> SpanRecord:
    return SpanRecord(name, _span_id(), parent, False, "internal", start_ns, end_ns, {}, None)


def _span_id() -> int:
    return random.getrandbits(64) or 1
