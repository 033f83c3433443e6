"""The OpenTelemetry SDK's side of traces (SPEC §23 E2): finished spans (observe/traces.py)
to the SDK's `BatchSpanProcessor` and its OTLP/HTTP exporter, which POSTs them to
`<endpoint>/v1/traces` from a thread of its own (never from the request's path).

Imported only when `telemetry.otlp` is set: the SDK is the `otel` extra (pip install
'corrallm[otel]'), and an unset `telemetry` loads none of it.

The spans are handed over as the SDK's `ReadableSpan`, the shape its processors and
exporters take, built once with the ids the request already used (the upstream span's
went out in its `traceparent` before the span existed). Starting and ending SDK spans
for each phase instead costs several times as much (bench/tracing.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from corrallm import __version__
from corrallm.config.schema import Otlp
from corrallm.observe.spans import SpanRecord

KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
UNSET = Status(StatusCode.UNSET)


def resource() -> Resource:
    """`service.name` corrallm unless OTEL_SERVICE_NAME says otherwise; the SDK adds
    OTEL_RESOURCE_ATTRIBUTES (read only now that traces are on)."""
    attributes: dict[str, str] = {"service.version": __version__}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "corrallm"
    return Resource.create(attributes)


class OtlpSink:
    """Spans to a collector: batched, exported off the event loop."""

    def __init__(self, otlp: Otlp, processor: SpanProcessor | None = None) -> None:
        self.resource = resource()
        self.scope = InstrumentationScope("corrallm", __version__)
        self.processor = processor or BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{otlp.endpoint}/v1/traces", headers=dict(otlp.headers))
        )

    def export(self, trace_id: int, spans: Sequence[SpanRecord]) -> None:
        made: dict[int, SpanContext] = {}  # a parent's context is its own span's (one each)
        for span in spans:
            context = made[span.span_id] = SpanContext(trace_id, span.span_id, False, SAMPLED)
            parent = None
            if span.parent_id is not None:
                parent = None if span.remote_parent else made.get(span.parent_id)
                if parent is None:
                    parent = SpanContext(trace_id, span.parent_id, span.remote_parent, SAMPLED)
            self.processor.on_end(
                ReadableSpan(
                    span.name,
                    context,
                    parent,
                    self.resource,
                    span.attributes,
                    kind=KINDS[span.kind],
                    status=UNSET if span.error is None else Status(StatusCode.ERROR, span.error),
                    start_time=span.start_ns,
                    end_time=span.end_ns,
                    instrumentation_scope=self.scope,
                )
            )

    def close(self) -> None:
        self.processor.shutdown()
