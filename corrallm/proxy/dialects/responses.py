"""The OpenAI Responses surface, `POST /v1/responses` (SPEC §16 K2): a codec on the one
pipeline (proxy/pipeline.py), so the same admission, routing, cost, activity and
preemption hold as for chat.

To a backend whose `apis` include `responses` the request goes through as sent (the
model renamed, `max_output_tokens` clamped to the backend's `maxTokens`), and its usage
is metered from the answer or, streamed, from the `response.completed` event. To any
other backend a stateless request is translated to Chat Completions
(proxy/responses_translate.py) and the answer translated back: a Response object, or
the Responses event sequence. Errors are OpenAI-shaped; a stream that breaks off ends
with an `error` event (and `response.failed` where corrallm built the stream).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson

from corrallm.http.asgi import Receive, Scope, Send
from corrallm.http.errors import ApiError, bad_request
from corrallm.proxy import relay
from corrallm.proxy.dialects.openai import filtered, parse_request, upstream_body
from corrallm.proxy.dialects.responses_stream import ResponsesStream, encode
from corrallm.proxy.dialects.responses_translate import (
    Echo,
    Refused,
    check_request,
    from_chat,
    to_chat,
)
from corrallm.proxy.dialects.stream import Translated
from corrallm.proxy.metering import Meter
from corrallm.proxy.pipeline import Inbound, Pipeline, caller_key
from corrallm.proxy.relay import SSE, AsSent, Codec, Mode
from corrallm.routing.affinity import session_key
from corrallm.routing.router import Route

NATIVE = "responses"
CHAT_PATH = "/v1/chat/completions"
_ENDS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')


def native(route: Route) -> bool:
    return NATIVE in route.config.apis


def serve(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> Awaitable[None]:
    """`POST /v1/responses`."""
    return relay.serve(pipeline, Responses(pipeline, scope, body), scope, receive, send)


class Responses:
    """The Responses dialect (relay.Dialect): native where the backend speaks it, else
    a Chat Completions request and its answer translated back."""

    direct = False

    def __init__(self, pipeline: Pipeline, scope: Scope, body: bytes) -> None:
        payload, model = parse_request(body)
        try:
            limit = check_request(payload)
        except Refused as exc:
            raise bad_request(exc.message, exc.param) from None
        self.chat: dict[str, Any] | None = None
        self.refusal: Refused | None = None
        try:
            self.chat = to_chat(payload)
        except Refused as exc:
            self.refusal = exc
            served = pipeline.runtime.models.get(model)
            if served is not None and not any(native(r) for r in served.routes):
                # No backend of it could serve this: say so before a slot is taken or a
                # backend started. (An unknown model is the pipeline's 404.)
                raise bad_request(exc.message, exc.param) from None
        self.stream = payload.get("stream") is True
        self.echo = Echo.of(payload)
        self.path: str = scope["path"]
        self.body, self.payload = body, payload
        session = session_key(scope["headers"], self.chat or payload)
        self.inbound = Inbound(
            model, self.path, caller_key(scope), len(body), None, limit, session, self.stream
        )

    def upstream(self, route: Route) -> tuple[str, bytes]:
        if native(route):
            return self.path, native_body(self.body, dict(self.payload), route)
        if self.chat is None:
            assert self.refusal is not None
            raise bad_request(self.refusal.message, self.refusal.param)
        # Renamed and clamped per backend, afresh on each try.
        return CHAT_PATH, upstream_body(b"", dict(self.chat), route, force=True)

    def answer(self, route: Route) -> Codec:
        if native(route):
            # Passed on as it came; a stream in whole events, its usage read at its end.
            return ResponsesNative() if self.stream else AsSent(Meter())
        modes = streamed if self.stream else whole
        return Translated(ResponsesStream(self.echo), from_chat, self.echo, modes)

    def error_event(self, error: ApiError) -> bytes:
        return error_event(error)


def native_body(body: bytes, payload: dict[str, Any], route: Route) -> bytes:
    """A Responses request for a backend that speaks it: the model's request filters
    applied (K5), the model renamed, its token limit clamped."""
    config = route.config
    changed = filtered(payload, route)
    if config.model and payload.get("model") != config.model:
        payload["model"] = config.model
        changed = True
    asked = payload.get("max_output_tokens")
    if config.max_tokens is not None and (
        not isinstance(asked, int | float) or asked > config.max_tokens
    ):
        payload["max_output_tokens"] = config.max_tokens
        changed = True
    return orjson.dumps(payload) if changed else body


def streamed(status: int, kind: str) -> Mode:
    """A streamed request's answer: a 200 stream is the Responses stream (native, or
    translated); anything else (an error) is passed on as it came, whole."""
    return Mode.EVENTS if status == 200 and kind == "text/event-stream" else Mode.AS_IS


def whole(status: int, kind: str) -> Mode:
    """A request not streamed: a 200 Chat answer is translated into a Response; anything
    else (an error) is passed on as it came, whole."""
    return Mode.WHOLE if status == 200 and kind == "application/json" else Mode.AS_IS


class ResponsesNative:
    """A native Responses stream: passed on in whole events, its usage read from its
    closing event (`response.completed` and kin)."""

    __slots__ = ("meter",)

    cuttable = True
    stream_type = SSE
    mode = staticmethod(streamed)

    def __init__(self) -> None:
        self.meter = Meter()

    def whole(self, body: bytes, backend: str) -> bytes:
        return body

    def begin(self) -> bytes:
        return b""

    def events(self, data: bytes) -> bytes:
        if any(end in data for end in _ENDS):
            usage = final_usage(data)
            if usage is not None:
                self.meter.usage = usage
        return data

    def done(self, sent: bytes) -> bool:
        return any(end in sent for end in _ENDS)

    def close(self, tail: bytes) -> bytes:
        return self.events(tail) if tail else b""

    def fail(self, error: ApiError) -> bytes:
        """The error event that ends a stream which cannot go on."""
        code = error.code or "error"
        event = {"type": "error", "sequence_number": self.meter.events, "code": code}
        return encode([{**event, "message": error.message, "param": None}])


def final_usage(data: bytes) -> dict[str, Any] | None:
    """The usage in a native stream's closing event (`response.completed` and kin)."""
    for line in data.splitlines():
        if not line.startswith(b"data:") or not any(end in line for end in _ENDS):
            continue
        try:
            event = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        response = event.get("response") if isinstance(event, dict) else None
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict):
            return usage
    return None


def error_event(error: ApiError) -> bytes:
    """How a Responses stream opened early ends when its wait fails: an `error` event."""
    event = {
        "type": "error",
        "code": error.code,
        "message": error.message,
        "param": error.param,
        "sequence_number": 0,
    }
    return encode([event])
