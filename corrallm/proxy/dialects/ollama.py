"""Ollama's API (SPEC §23 E1): `POST /api/chat`, `/api/generate`, `/api/embed` and
`/api/embeddings`, a dialect on the one pipeline and the one relay (proxy/pipeline.py,
proxy/relay.py); `/api/tags`, `/api/ps`, `/api/show` and `/api/version` are
ollama_catalog.py's.

A request is read and checked once (ollama_translate.read: a malformed one is a 400 before
any gate), its body as JSON whatever its Content-Type (as Ollama reads it), `<name>:latest`
taken for `<name>`; admitted like a chat completion (keys, lanes, queues, spend, slots,
feedback, captures, activity); sent to the admitted backend as a Chat Completion (a
`raw` generate as a Completion, an embed as Embeddings) and its answer turned back into
Ollama's: one JSON object, or NDJSON lines (`application/x-ndjson`), the last with
`done: true`, the counts and durations in nanoseconds.

The answer is translated as every dialect asked in Chat Completions is (dialects/stream.py):
`Translated` with `ollama_translate.from_chat` for a whole answer (embeddings too) and
`ollama_stream.Lines` for a stream; what only Ollama needs, the wall clock of each line
and the request's durations on the last, the echo carries as two callables (`OllamaEcho`).

A streamed request that waits is told why on its stream opened early (K4), in lines an
Ollama client reads as empty text (`ollama_stream.note`). Errors are `{"error": "<message>"}`
with one of Ollama's statuses (`write_error`); a stream that breaks off or is preempted
ends with such a line. `keep_alive: 0` unloads the model once the request is over, when
no one else uses it (ollama_catalog.unload_idle).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable

import orjson

from corrallm.http.asgi import Receive, Scope, Send, send_bytes
from corrallm.http.errors import ApiError
from corrallm.observe.context import CURRENT
from corrallm.proxy import relay
from corrallm.proxy.dialects.ollama_catalog import unload_idle, unload_later
from corrallm.proxy.dialects.ollama_stream import Lines, note
from corrallm.proxy.dialects.ollama_translate import (
    NDJSON,
    OllamaEcho,
    Timings,
    error_line,
    error_status,
    from_chat,
    read,
    served_name,
    settled,
    timings,
)
from corrallm.proxy.dialects.openai import parse_request, upstream_body
from corrallm.proxy.dialects.stream import Translated
from corrallm.proxy.feedback import StreamForm
from corrallm.proxy.metering import Meter
from corrallm.proxy.pipeline import Inbound, Pipeline, caller_key, ready
from corrallm.proxy.relay import Codec, Mode
from corrallm.routing.affinity import session_key
from corrallm.routing.router import Route


async def write_error(error: ApiError, send: Send) -> None:
    """Every error on these paths: `{"error": "<message>"}`, its headers kept (Retry-After,
    the key's x-ratelimit-* counts, Allow)."""
    body = orjson.dumps({"error": error.message})
    await send_bytes(send, error_status(error.status), body, headers=error.headers)


def serve(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> Awaitable[None]:
    """`POST /api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`."""
    dialect = Ollama(pipeline, scope, body)
    request = dialect.request
    if request.empty and request.kind in ("chat", "generate"):
        return _settle(pipeline, dialect, scope, send)
    work = relay.serve(pipeline, dialect, scope, receive, send, dialect.form)
    if not request.unload:
        return work
    return _then_unload(pipeline, dialect.inbound.model, work)


class Ollama:
    """The Ollama dialect (relay.Dialect): read and checked once, sent as an OpenAI request,
    answered in Ollama's shape."""

    direct = False
    error_event = staticmethod(error_line)

    def __init__(self, pipeline: Pipeline, scope: Scope, body: bytes) -> None:
        payload, asked = parse_request(body, "GET /api/tags")
        path: str = scope["path"]
        model = served_name(asked, pipeline.runtime.models)
        request = self.request = read(path, payload, model)
        self.asked = asked  # answers are named as the client named the model
        self.arrived = time.monotonic()
        chat = request.body
        self.inbound = Inbound(
            model,
            path,
            caller_key(scope),
            len(body),
            None,
            request.limit,
            session_key(scope["headers"], chat) if pipeline.has_choice(model) else None,
            stream=request.stream,
        )
        kind = request.kind
        # One echo for every answer tried: its `times` reads the answer being relayed.
        self.echo = OllamaEcho(kind, request.chat, asked, time.time, self._times)
        self.form = StreamForm(NDJSON, lambda text: note(kind, asked, time.time(), text))
        self.modes = streamed if request.stream else whole
        self.meter: Meter | None = None
        self.admitted: float | None = None

    def upstream(self, route: Route) -> tuple[str, bytes]:
        # The model renamed, filters applied, the token limit clamped, afresh on each try.
        return self.request.upstream, upstream_body(b"", self.request.body, route, force=True)

    def answer(self, route: Route) -> Codec:
        exchange = CURRENT.get()
        visit = exchange.visit if exchange is not None else None
        if visit is not None:
            self.arrived, self.admitted = visit.arrived_mono, visit.admitted_mono
        meter = self.meter = Meter()
        echo = self.echo
        return Translated(Lines(echo), from_chat, echo, self.modes, meter)

    def _times(self) -> Timings:
        """The durations of the request so far, as the answer being relayed metered them."""
        meter = self.meter
        assert meter is not None  # asked only of an answer, made by `answer`
        end = time.monotonic()
        return timings(self.arrived, self.admitted, meter.started, meter.first_byte, end)


def streamed(status: int, kind: str) -> Mode:
    """A streamed request's answer: a Chat or Completions stream, translated; anything
    else is refused (Ollama's error)."""
    if status < 400 and kind == "text/event-stream":
        return Mode.EVENTS
    return Mode.REFUSE


def whole(status: int, kind: str) -> Mode:
    """A whole answer's: JSON, translated; anything else is refused."""
    if status < 400 and kind == "application/json":
        return Mode.WHOLE
    return Mode.REFUSE


async def _then_unload(pipeline: Pipeline, model: str, work: Awaitable[None]) -> None:
    """`keep_alive: 0`: once the request is over (its slot given back), its model is
    unloaded in the background, when no one else uses it."""
    try:
        await work
    finally:
        unload_later(pipeline.gw, model)


async def _settle(pipeline: Pipeline, dialect: Ollama, scope: Scope, send: Send) -> None:
    """No prompt, no messages: Ollama's way to load a model (`done_reason: load`) or, with
    `keep_alive: 0`, to unload it (`unload`). The first gates decide who may (model, pause,
    keys); like a token count it takes no slot and writes no activity row."""
    caller = pipeline.caller_of(scope)
    served = pipeline.gates(dialect.inbound, caller)
    if dialect.request.unload:
        await unload_idle(pipeline.gw, served)
        reason = "unload"
    else:
        await ready(served.tiers_for(caller.group, pipeline.runtime.placeable)[0][0])
        reason = "load"
    body = orjson.dumps(settled(dialect.request, dialect.asked, time.time(), reason))
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    await send({"type": "http.response.body", "body": body})
