"""The Anthropic Messages surfaces (SPEC §16 K1): `POST /v1/messages` and
`POST /v1/messages/count_tokens`, a dialect on the one pipeline and the one relay
(proxy/pipeline.py, proxy/relay.py).

A request is read and checked once (anthropic_translate.to_chat: a malformed one is a 400
before any gate), admitted by the pipeline like a chat completion (same lanes, slots,
cost, activity, preemption), then, on the admitted backend:

- native, when its `apis` include `anthropic`: the body goes on to `<base>/v1/messages`
  (model renamed, token limit clamped by `openai.upstream_body`), the answer relayed as
  it comes, its usage metered from `usage` / `message_start` + `message_delta`;
- translated otherwise: a Chat Completions request (through `openai.upstream_body`
  too), the answer turned back into a Message, a stream into Anthropic's events.

Errors are Anthropic-shaped (`write_error`, the error writer of these paths in app.py's
`SURFACES`); a stream that breaks or is preempted ends with an `event: error`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson

from corrallm.cost.model import BYTES_PER_TOKEN
from corrallm.http.asgi import Headers, Receive, Scope, Send, send_bytes
from corrallm.http.errors import ApiError, bad_request, quoted
from corrallm.lifecycle.addresses import origin, upstream_url
from corrallm.proxy import relay
from corrallm.proxy.dialects.anthropic_stream import AnthropicStream
from corrallm.proxy.dialects.anthropic_translate import (
    MessageEcho,
    error_body,
    error_event,
    from_chat,
    prompt_text,
    to_chat,
)
from corrallm.proxy.dialects.openai import parse_request, token_limit, upstream_body
from corrallm.proxy.dialects.stream import Translated
from corrallm.proxy.forward import (
    open_upstream,
    request_headers,
)
from corrallm.proxy.metering import Meter
from corrallm.proxy.pipeline import Inbound, Pipeline, caller_key, ready
from corrallm.proxy.relay import AsSent, Codec, Mode, held, upstream_error
from corrallm.routing.affinity import session_key
from corrallm.routing.router import Route

NATIVE = "anthropic"


async def write_error(error: ApiError, send: Send) -> None:
    """Every error on these paths: `{"type": "error", "error": {"type", "message"}}`."""
    status, body = error_body(error)
    await send_bytes(send, status, orjson.dumps(body), headers=error.headers)


def speaks_anthropic(route: Route) -> bool:
    return NATIVE in route.config.apis


def _headers(scope: Scope, route: Route) -> Headers:
    return request_headers(scope["headers"], route.config.headers)


def _read(payload: dict[str, Any]) -> tuple[dict[str, Any], int | None, bool]:
    """The Chat translation (also the check of the whole request), the token limit, and
    whether the payload was rewritten (a float max_tokens made whole)."""
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be true or false, not {quoted(stream)}.", param="stream")
    limit, rewritten = token_limit(payload)
    return to_chat(payload), limit, rewritten


def serve(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> Awaitable[None]:
    """`POST /v1/messages`."""
    return relay.serve(pipeline, Anthropic(scope, body), scope, receive, send)


class Anthropic:
    """The Anthropic dialect (relay.Dialect): read and checked once, then native or
    translated per backend."""

    direct = False
    error_event = staticmethod(error_event)

    def __init__(self, scope: Scope, body: bytes) -> None:
        payload, model = parse_request(body)
        self.chat, limit, rewritten = _read(payload)
        if rewritten:
            body = orjson.dumps(payload)
        self.body, self.payload = body, payload
        self.echo = MessageEcho(model, payload.get("stop_sequences") or ())
        self.inbound = Inbound(
            model,
            scope["path"],
            caller_key(scope),
            len(body),
            None,
            limit,
            session_key(scope["headers"], self.chat),
            stream=payload.get("stream") is True,
        )

    def upstream(self, route: Route) -> tuple[str, bytes]:
        if speaks_anthropic(route):
            return "/v1/messages", upstream_body(self.body, self.payload, route)
        return "/v1/chat/completions", upstream_body(b"", self.chat, route, force=True)

    def answer(self, route: Route) -> Codec:
        if speaks_anthropic(route):
            return AnthropicNative()
        return Translated(AnthropicStream(self.echo), from_chat, self.echo, modes)


def modes(status: int, kind: str) -> Mode:
    """A stream or an answer is Anthropic's (native, or translated); any other answer
    is refused as Anthropic's error."""
    if kind == "text/event-stream" and status < 400:
        return Mode.EVENTS
    if kind == "application/json" and status < 400:
        return Mode.WHOLE
    return Mode.REFUSE


class AnthropicNative(AsSent):
    """An answer from a backend that speaks Anthropic: relayed as it came, in whole
    events (`relay.AsSent`), its usage read by `AnthropicMeter`, whole once
    `message_stop` went out, broken off with Anthropic's error event."""

    __slots__ = ()

    mode = staticmethod(modes)

    def __init__(self) -> None:
        super().__init__(AnthropicMeter())

    def done(self, sent: bytes) -> bool:
        return b"message_stop" in sent

    def fail(self, error: ApiError) -> bytes:
        return error_event(error)


async def _send_json(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body})


class AnthropicMeter(Meter):
    """Usage from a native Anthropic answer: `usage` of a Message, or, streamed, the
    `message_start` event's (input) and the `message_delta` event's (output)."""

    def _keep(self, event: bytes) -> bool:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                obj = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else obj.get("usage")
            if isinstance(usage, dict):
                self.usage = {**(self.usage or {}), **usage}
        return True


# -- count_tokens ------------------------------------------------------------------------


async def count_tokens(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> None:
    """`POST /v1/messages/count_tokens`: the first gates (lookup, pause, keys), then the
    backend's count. It takes no slot and records no activity, as `/upstream` does: a
    count is the tokenizer's work, done beside generation (llama-server answers it on
    its HTTP thread), and a count must never wait behind a long answer in a queue nor be
    charged as if its tokens were processed. A stopped backend is started (its
    tokenizer is the count)."""
    payload, model = parse_request(body)
    chat = _read(payload)[0]
    caller = pipeline.caller_of(scope)
    served = pipeline.gates(Inbound(model, scope["path"], None, len(body)), caller)
    route = served.tiers_for(caller.group, pipeline.runtime.placeable)[0][0]
    await ready(route)
    extra = [(b"x-corrallm-backend", route.id.encode())]
    idle = pipeline.runtime.upstream_idle(route)
    if speaks_anthropic(route):
        if route.config.model:
            payload["model"] = route.config.model
        url = upstream_url(route.endpoint.base_url, "/v1/messages/count_tokens")
        headers = _headers(scope, route)
        response = await open_upstream(
            pipeline.upstream, "POST", url, orjson.dumps(payload), headers, idle, route.id, None
        )
        async with response:
            answer = await held(response, None, route.id)
            if response.status >= 400:
                raise upstream_error(response.status, answer, route.id)
        extra.append((b"x-corrallm-token-count", b"backend"))
        await _send_json(send, 200, answer, extra)
        return
    text = prompt_text(chat)
    count = await _tokenize(pipeline, route, text, idle)
    how = b"tokenizer"
    if count is None:  # no tokenizer endpoint: a rough count, flagged (C2)
        count, how = max(1, len(text.encode()) // BYTES_PER_TOKEN), b"estimate"
    extra.append((b"x-corrallm-token-count", how))
    await _send_json(send, 200, orjson.dumps({"input_tokens": count}), extra)


async def _tokenize(pipeline: Pipeline, route: Route, text: str, idle: float) -> int | None:
    """llama-server's `POST /tokenize` (the text, without the chat template); None if the
    backend has no such endpoint or it fails."""
    url = origin(route.endpoint.base_url) + "/tokenize"
    body = orjson.dumps({"content": text})
    headers = request_headers((), {"content-type": "application/json", **route.config.headers})
    try:
        response = await pipeline.upstream.request("POST", url, body, headers, idle)
        async with response:
            answer = await held(response, None, route.id)
            if response.status != 200:
                return None
    except (OSError, ApiError):
        return None
    try:
        tokens = orjson.loads(answer).get("tokens")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return len(tokens) if isinstance(tokens, list) else None
