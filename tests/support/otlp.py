"""An OTLP/HTTP trace receiver on loopback (SPEC §23 E2): what a collector would get.

A standard-library HTTP server in a thread of the test process takes `POST /v1/traces`,
decodes each body with the OpenTelemetry protocol's own `ExportTraceServiceRequest`, and
keeps its spans (flattened, ids as hex) and each export's headers.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from tests.support.processes import free_port, wait_for

KINDS = {
    ProtoSpan.SPAN_KIND_SERVER: "server",
    ProtoSpan.SPAN_KIND_CLIENT: "client",
    ProtoSpan.SPAN_KIND_INTERNAL: "internal",
}


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool  # its status is ERROR
    service: str  # the resource's service.name
    scope: str  # the instrumentation scope's name


@dataclass
class Receiver:
    url: str = ""
    spans: list[Span] = field(default_factory=list)
    exports: list[dict[str, str]] = field(default_factory=list)  # each POST's headers
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes, headers: dict[str, str]) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        got = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    got.append(
                        Span(
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            KINDS.get(span.kind, str(span.kind)),
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            _attributes(span.attributes),
                            span.status.code == Status.STATUS_CODE_ERROR,
                            str(resource.get("service.name", "")),
                            scope_spans.scope.name,
                        )
                    )
        with self._lock:
            self.exports.append(headers)
            self.spans.extend(got)

    def trace(self, trace_id: str, count: int, timeout: float = 15) -> list[Span]:
        """The spans of `trace_id` once `count` of them arrived."""

        def arrived() -> list[Span] | None:
            with self._lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            return found if len(found) >= count else None

        return wait_for(arrived, timeout, what=f"{count} spans of trace {trace_id}")


def _attributes(values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in values}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            receiver.take(body, {k.lower(): v for k, v in self.headers.items()})
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
