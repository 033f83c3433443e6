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
from corrallm.http.errors import ApiError, bad_gateway, bad_request
from corrallm.proxy import relay
from corrallm.proxy.dialects.openai import filtered, parse_request, upstream_body
from corrallm.proxy.dialects.responses_stream import StreamTranslator, encode
from corrallm.proxy.dialects.responses_translate import (
    Echo,
    Refused,
    check_request,
    to_chat,
    to_response,
)
from corrallm.proxy.metering import Meter
from corrallm.proxy.pipeline import Inbound, Pipeline, caller_key
from corrallm.proxy.relay import AsSent, Codec, Mode, upstream_error
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
        if native(route) and not self.stream:
            return AsSent(Meter())  # a native answer, not streamed: passed on as it came
        translator = None if native(route) else StreamTranslator(self.echo)
        return ResponsesAnswer(Meter(), translator, self.stream, self.echo)

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


class ResponsesAnswer:
    """One upstream answer in the Responses shape: a native stream passed on in whole
    events, its usage read from its closing event; a Chat answer or stream translated
    (`translator`). Anything else (an error) is passed on as it came, whole."""

    __slots__ = ("echo", "meter", "streamed", "translator")

    cuttable = True

    def __init__(
        self, meter: Meter, translator: StreamTranslator | None, streamed: bool, echo: Echo
    ) -> None:
        self.meter, self.translator, self.streamed, self.echo = meter, translator, streamed, echo

    def mode(self, status: int, kind: str) -> Mode:
        if status != 200:
            return Mode.AS_IS
        if self.streamed:
            return Mode.EVENTS if kind == "text/event-stream" else Mode.AS_IS
        return Mode.WHOLE if kind == "application/json" else Mode.AS_IS

    def refusal(self, status: int, body: bytes, backend: str) -> ApiError:
        return upstream_error(status, body, backend)

    def whole(self, body: bytes, backend: str) -> bytes:
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise bad_gateway(
                f"backend '{backend}' answered with JSON that does not "
                "parse; its log (GET /api/v1/models/logs) may say why."
            ) from None
        return orjson.dumps(to_response(answer, self.echo))

    def begin(self) -> bytes:
        return b"" if self.translator is None else encode(self.translator.start())

    def events(self, data: bytes) -> bytes:
        translator = self.translator
        if translator is None:  # native: as sent, its usage read from the last event
            if any(end in data for end in _ENDS):
                usage = final_usage(data)
                if usage is not None:
                    self.meter.usage = usage
            return data
        out: list[dict[str, Any]] = []
        for line in data.splitlines():
            if not line.startswith(b"data:"):
                continue
            text = line[5:].strip()
            if not text or text == b"[DONE]":
                continue
            try:
                out.extend(translator.feed(orjson.loads(text)))
            except orjson.JSONDecodeError:
                continue
        return encode(out) if out else b""

    def done(self, sent: bytes) -> bool:
        return self.translator is None and any(end in sent for end in _ENDS)

    def close(self, tail: bytes) -> bytes:
        out = self.events(tail) if tail else b""
        if self.translator is not None:
            out += encode(self.translator.finish())
        return out

    def fail(self, error: ApiError) -> bytes:
        """The events that end a stream which cannot go on, in the Responses shape."""
        code = error.code or "error"
        if self.translator is not None:
            return encode(self.translator.fail(code, error.message))
        event = {"type": "error", "sequence_number": self.meter.events, "code": code}
        return encode([{**event, "message": error.message, "param": None}])

    def settle(self, sent: int) -> None:
        translator = self.translator
        if translator is not None and isinstance(translator.usage, dict):
            self.meter.usage = translator.usage
        self.meter.bytes_out = sent


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
