"""What tracing (SPEC §23 E2) costs a request: on against off, measured in the same run.

    .venv/bin/python bench/tracing.py [--requests 2000] [--rounds 3] [--micro 5000]

1. **The tracing work alone, in process**: one request's trace (a client `traceparent`
   continued, four spans: the request, queue, load, upstream, and the `traceparent` for
   the upstream request) made three ways, each handing its spans to the SDK's
   `BatchSpanProcessor` (its exporter discarding them): corrallm's way (ids drawn at the
   start, `ReadableSpan`s built once at settle from the visit's timestamps,
   observe/traces.py + observe/otlp.py); the SDK's public API at settle (`start_span`
   with explicit start times, `end(end_time=)`); and live SDK spans started and ended as
   each phase happens. µs per request (best of 5 runs of `--micro` requests) and Python
   opcodes per request on the calling thread, less a request's `Visit` alone. Then what
   the SDK's OTLP exporter does with those spans in its own thread (encoding them into
   the protobuf it POSTs, in batches of 512), per request.
2. **Through the real server**: nginx's static chat completion as the upstream
   (bench/overhead.py's), two `corrallm serve` on it, one without `telemetry` and one
   exporting to a local OTLP/HTTP sink (a process of this script that decodes and counts
   what it gets), and `--requests` sequential chat completions with a client
   `traceparent` on one kept-alive connection to each in turn, `--rounds` times. Prints
   latency (mean, p50, p99) and the server's CPU µs per request (all its threads: the
   exporter's included) for each, and on minus off.

Opcodes through the real server: `bench/opcodes.py --trace`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from overhead import (  # noqa: E402
    PROMPT,
    PY,
    Procs,
    find_nginx,
    free_port,
    session_usage,
    start_corrallm,
    start_static_upstream,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# --- the sink (runs as `bench/tracing.py --sink PORT COUNTS`) --------------------------------


def sink(port: int, counts: Path) -> None:
    """An OTLP/HTTP receiver that decodes each export and counts its spans by name."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    spans: Counter[str] = Counter()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            got = ExportTraceServiceRequest.FromString(body)
            with lock:
                for resource in got.resource_spans:
                    for scope in resource.scope_spans:
                        spans.update(s.name for s in scope.spans)
                counts.write_text(json.dumps(spans))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # health
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


# --- 1. the tracing work alone -------------------------------------------------------------


def micro(requests: int) -> dict[str, dict[str, float]]:
    import logging

    from opentelemetry.propagate import extract, inject
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanKind, set_span_in_context

    from corrallm.config.schema import Otlp
    from corrallm.cost.ledger import Visit
    from corrallm.cost.model import Metered
    from corrallm.observe.otlp import OtlpSink, resource
    from corrallm.observe.traces import Tracer

    logging.getLogger("opentelemetry").setLevel(logging.ERROR)

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    def processor() -> BatchSpanProcessor:
        # Room for every span of the timed runs: a full queue would drop them, and log.
        return BatchSpanProcessor(Discard(), max_queue_size=25 * requests)

    def visit() -> Visit:
        v = Visit("alice", "coders", "bench", "/v1/chat/completions", 120)
        v.request_id, v.status, v.backend_id = "r1", 200, "bench"
        v.queue_ms, v.load_ms, v.admitted_mono = 0.2, 0.1, v.arrived_mono + 0.0002
        v.metered = Metered(12, 16)
        return v

    def attributes(v: Visit) -> dict[str, Any]:
        return {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "bench",
            "gen_ai.response.model": "bench",
            "gen_ai.request.max_tokens": 16,
            "gen_ai.usage.input_tokens": 12,
            "gen_ai.usage.output_tokens": 16,
            "corrallm.key": "alice",
            "corrallm.group": "coders",
            "corrallm.backend": "bench",
            "corrallm.request_id": "r1",
            "http.response.status_code": 200,
        }

    def traced_by(tracer: Tracer) -> Callable[[], None]:
        def corrallm_at_settle() -> None:
            v = visit()
            headers = [(b"host", b"x"), (b"traceparent", TRACEPARENT.encode())]
            trace = tracer.begin(v, "bench", 16, headers)
            assert trace is not None
            trace.end(v, True)

        return corrallm_at_settle

    ours = Tracer(OtlpSink(Otlp(endpoint="http://127.0.0.1:9"), processor()))
    corrallm_at_settle = traced_by(ours)

    provider = TracerProvider(resource=resource())
    provider.add_span_processor(processor())
    sdk = provider.get_tracer("corrallm")

    def sdk_at_settle() -> None:
        v = visit()
        offset = v.arrived - v.arrived_mono
        t0, t1 = int(v.arrived * 1e9), int((time.monotonic() + offset) * 1e9)
        request = sdk.start_span(
            "chat bench",
            extract({"traceparent": TRACEPARENT}),
            SpanKind.SERVER,
            attributes(v),
            start_time=t0,
        )
        inside = set_span_in_context(request)
        sdk.start_span("queue", inside, start_time=t0).end(end_time=t0 + 200_000)
        sdk.start_span("load", inside, start_time=t0 + 200_000).end(end_time=t0 + 200_000)
        upstream = sdk.start_span("upstream", inside, SpanKind.CLIENT, start_time=t0 + 200_000)
        inject({}, set_span_in_context(upstream))  # too late for the request it names
        upstream.end(end_time=t1)
        request.end(end_time=t1)

    def sdk_live() -> None:
        v = visit()
        request = sdk.start_span(
            "chat bench", extract({"traceparent": TRACEPARENT}), SpanKind.SERVER
        )
        inside = set_span_in_context(request)
        sdk.start_span("queue", inside).end()
        sdk.start_span("load", inside).end()
        upstream = sdk.start_span("upstream", inside, SpanKind.CLIENT)
        inject({}, set_span_in_context(upstream))
        upstream.end()
        request.set_attributes(attributes(v))
        request.end()

    ways: dict[str, Callable[[], None]] = {
        "corrallm: ReadableSpans at settle": corrallm_at_settle,
        "SDK start_span/end at settle": sdk_at_settle,
        "SDK live spans per phase": sdk_live,
        "baseline: the visit alone": visit,  # what every way pays before tracing
    }
    out: dict[str, dict[str, float]] = {}
    for name, way in ways.items():
        for _ in range(200):
            way()  # warm
        best = min(_timed(way, requests) for _ in range(5))
        out[name] = {"us": best * 1e6 / requests, "opcodes": _opcodes(way, 200)}
    provider.shutdown()
    ours.close()
    base = out.pop("baseline: the visit alone")
    for row in out.values():
        row["us"] -= base["us"]
        row["opcodes"] -= base["opcodes"]
    # What the SDK's exporter then does with one request's spans, in its own thread:
    # encode them into the OTLP protobuf and serialize it (in batches of 512, as it does).
    keep = Keep()
    kept = traced_by(Tracer(OtlpSink(Otlp(endpoint="http://127.0.0.1:9"), keep)))  # type: ignore[arg-type]
    for _ in range(128):
        kept()
    out["the exporter's thread: OTLP encoding of them"] = _encoding(
        keep.spans, len(keep.spans) / 128
    )
    return out


class Keep:
    """A span processor that keeps what it is given."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def on_end(self, span: Any) -> None:
        self.spans.append(span)

    def shutdown(self) -> None:
        pass


def _encoding(spans: list[Any], per_request: float) -> dict[str, float]:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    batch = spans[:512]

    def encode() -> None:
        encode_spans(batch).SerializePartialToString()

    best = min(_timed(encode, 20) for _ in range(5)) / 20
    return {
        "us": best * 1e6 / len(batch) * per_request,
        "opcodes": _opcodes(encode, 2) / len(batch) * per_request,
    }


def _timed(way: Callable[[], None], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        way()
    return time.perf_counter() - start


def _opcodes(way: Callable[[], None], n: int) -> float:
    count = [0]

    def opcode(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            count[0] += 1
        return opcode

    def call(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return opcode

    sys.settrace(call)
    try:
        for _ in range(n):
            way()
    finally:
        sys.settrace(None)
    return count[0] / n


# --- 2. through the real server -------------------------------------------------------------


def chat(url: str, n: int) -> list[float]:
    """`n` sequential chat completions with a client traceparent; each one's seconds."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port)
    body = json.dumps({"model": "bench", "messages": PROMPT, "max_tokens": 16})
    headers = {"Content-Type": "application/json", "traceparent": TRACEPARENT}
    took = []
    for _ in range(n):
        start = time.perf_counter()
        conn.request("POST", u.path, body, headers)
        answer = conn.getresponse()
        answer.read()
        took.append(time.perf_counter() - start)
        if answer.status != 200:
            raise RuntimeError(f"chat completion answered {answer.status}")
    conn.close()
    return took


def served(requests: int, rounds: int) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    nginx = find_nginx()
    if nginx is None:
        raise SystemExit("bench/tracing.py needs nginx (apt-get install -y nginx)")
    with tempfile.TemporaryDirectory(prefix="corrallm-tracing-") as tmp:
        root = Path(tmp)
        procs = Procs(root, {})
        paths = {"off": Procs(root / "off", {}), "on": Procs(root / "on", {})}
        for p in paths.values():
            p.tmp.mkdir()
        try:
            fast, _ = start_static_upstream(procs, nginx)
            port, counts = free_port(), root / "spans.json"
            sink_proc = procs.start("sink", [PY, __file__, "--sink", str(port), str(counts)], "")
            procs.wait_healthy("sink", sink_proc, f"http://127.0.0.1:{port}/")
            telemetry = f"telemetry: {{otlp: {{endpoint: 'http://127.0.0.1:{port}'}}}}\n"
            targets = {
                "off": start_corrallm(paths["off"], fast, fast),
                "on": start_corrallm(paths["on"], fast, fast, extra_config=telemetry),
            }
            for target in targets.values():
                chat(target.chat_url, 200)  # warm: connections pooled, first-use paths
            took: dict[str, list[float]] = {name: [] for name in targets}
            cpu: dict[str, float] = dict.fromkeys(targets, 0.0)
            for _ in range(rounds):
                for name, target in targets.items():
                    before = session_usage(target.pid)[0]
                    took[name] += chat(target.chat_url, requests)
                    cpu[name] += session_usage(target.pid)[0] - before
            spans = _received(counts, 200 + rounds * requests)
        finally:
            for p in paths.values():
                p.close()
            procs.close()
    out = {}
    for name, values in took.items():
        values.sort()
        out[name] = {
            "mean_us": statistics.fmean(values) * 1e6,
            "p50_us": values[len(values) // 2] * 1e6,
            "p99_us": values[int(len(values) * 0.99)] * 1e6,
            "cpu_us": cpu[name] * 1e6 / len(values),
        }
    return out, spans


def _received(counts: Path, requests: int, timeout: float = 20.0) -> dict[str, int]:
    """The sink's span counts once every request's span is in (the SDK batches them for
    up to 5 s), or as they are at `timeout`."""
    end = time.monotonic() + timeout
    while True:
        spans: dict[str, int] = json.loads(counts.read_text()) if counts.exists() else {}
        if spans.get("chat bench", 0) >= requests or time.monotonic() > end:
            return spans
        time.sleep(0.1)


def report(
    micro_rows: dict[str, dict[str, float]],
    server: dict[str, dict[str, float]],
    spans: dict[str, int],
    requests: int,
) -> None:
    print("Tracing work alone (4 spans, a client traceparent), per request, less the visit alone\n")
    print("| way | µs | opcodes |")
    print("|---|---:|---:|")
    for name, row in micro_rows.items():
        print(f"| {name} | {row['us']:.1f} | {row['opcodes']:.0f} |")
    print(f"\nThrough `corrallm serve` ({requests} sequential chat completions a round)\n")
    print("| telemetry | mean µs | p50 µs | p99 µs | server CPU µs / request |")
    print("|---|---:|---:|---:|---:|")
    for name, row in server.items():
        print(
            f"| {name} | {row['mean_us']:.0f} | {row['p50_us']:.0f} | {row['p99_us']:.0f} | "
            f"{row['cpu_us']:.0f} |"
        )
    on, off = server["on"], server["off"]
    print(
        f"| on - off | {on['mean_us'] - off['mean_us']:+.0f} | "
        f"{on['p50_us'] - off['p50_us']:+.0f} | {on['p99_us'] - off['p99_us']:+.0f} | "
        f"{on['cpu_us'] - off['cpu_us']:+.0f} |"
    )
    print(f"\nspans the sink received: {dict(sorted(spans.items()))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per server per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", type=int, default=5000, help="requests per in-process run")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()
    micro_rows = micro(args.micro)
    server, spans = served(args.requests, args.rounds)
    report(micro_rows, server, spans, args.requests)
    if args.json:
        print(json.dumps({"micro": micro_rows, "server": server, "spans": spans}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sink"]:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        sink(int(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
