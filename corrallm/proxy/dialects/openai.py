"""The OpenAI dialect: chat, completions, embeddings, rerank, speech and audio uploads
(SPEC §3, §8, §12).

A codec on the one pipeline and the one relay (proxy/pipeline.py, proxy/relay.py): it
reads the request (parsed once, the model looked up in a prebuilt table by the
pipeline), has it forwarded to the admitted backend with the model renamed and the token
limit clamped, and the answer relayed as it came (`relay.AsSent`); errors are
OpenAI-shaped. No blocking I/O, no config parsing.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson

from corrallm.http.asgi import Receive, Scope, Send
from corrallm.http.errors import ApiError, bad_request, quoted
from corrallm.proxy import jsonbody, relay
from corrallm.proxy.feedback import openai_error_event
from corrallm.proxy.metering import Meter, ask_for_usage
from corrallm.proxy.pipeline import SURFACE_MODE, Inbound, Pipeline, caller_key
from corrallm.proxy.relay import AsSent, Codec
from corrallm.routing.affinity import session_key
from corrallm.routing.router import Route

_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")
MAX_TOKENS_ASKED = 2**31 - 1

# Uploads (multipart): forwarded byte for byte, boundary and all.
UPLOAD_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})


def parse_request(body: bytes, listing: str = "GET /v1/models") -> tuple[dict[str, Any], str]:
    """The JSON object of a body (a key repeated is refused: jsonbody.py) and its model;
    `listing`: where the dialect's clients find the model names."""
    payload = jsonbody.parse(body)
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object with a 'model' field.")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            f"Missing 'model': name the model to use ({listing} lists them).", param="model"
        )
    return payload, model


def token_limit(payload: dict[str, Any]) -> tuple[int | None, bool]:
    """The completion tokens asked for, as a whole number (`1000.0` counts as 1000: some
    clients send floats), and whether the payload was rewritten to say so. Anything else
    is refused, so that no number passes a backend's `maxTokens` clamp or the spend
    estimate unseen."""
    limit: int | None = None
    rewritten = False
    for name in _TOKEN_LIMITS:
        asked = payload.get(name)
        if asked is None:
            continue
        if isinstance(asked, bool) or not isinstance(asked, int | float):
            raise bad_request(f"'{name}' must be a whole number of tokens.", param=name)
        if isinstance(asked, float):
            if not asked.is_integer():
                raise bad_request(
                    f"'{name}' must be a whole number of tokens, not {quoted(asked)}.", param=name
                )
            # orjson writes 64-bit integers only; past any context length anyway.
            asked = payload[name] = min(int(asked), MAX_TOKENS_ASKED)
            rewritten = True
        if asked < 1:
            raise bad_request(f"'{name}' must be at least 1, not {asked}.", param=name)
        limit = asked if limit is None else min(limit, asked)
    return limit, rewritten


def upstream_body(body: bytes, payload: dict[str, Any], route: Route, force: bool = False) -> bytes:
    """The body for the backend: the model's request filters applied (K5), the model
    renamed and the token limit clamped; else the body as sent (`force`: the payload was
    changed already, e.g. to ask a stream for its usage). `payload` itself is left as it
    is, so a request routed again (P6, S4) starts over from what the caller sent."""
    config = route.config
    changed = force
    if route.filters or config.model or config.max_tokens is not None:
        payload = dict(payload)
        changed = filtered(payload, route) or changed
    if config.model and payload.get("model") != config.model:
        payload["model"] = config.model
        changed = True
    if config.max_tokens is not None:
        for name in _TOKEN_LIMITS:
            asked = payload.get(name)
            if isinstance(asked, int) and asked > config.max_tokens:
                payload[name] = config.max_tokens
                changed = True
        if not any(name in payload for name in _TOKEN_LIMITS):
            payload["max_tokens"] = config.max_tokens
            changed = True
    return orjson.dumps(payload) if changed else body


def filtered(payload: dict[str, Any], route: Route) -> bool:
    """K5: strip, fill in and force the route's model's parameters, then those of the
    alias the caller named (`payload['model']`, before any rename); True if changed."""
    return bool(route.filters) and route.filters.apply(payload, payload.get("model"))


def serve(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> Awaitable[None]:
    """A JSON request: chat, completions, embeddings, rerank, speech. (Plain functions
    down to the pipeline's coroutine, as app.py explains: no `await` level of their own.)"""
    payload, model = parse_request(body)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # corrallm reads `stream` itself (metering, preemption): it must mean one thing.
        raise bad_request(f"'stream' must be true or false, not {quoted(stream)}.", param="stream")
    limit, rewritten = token_limit(payload)
    if rewritten:
        body = orjson.dumps(payload)
    return serve_parsed(pipeline, scope, receive, send, body, payload, model, limit)


def serve_parsed(
    pipeline: Pipeline,
    scope: Scope,
    receive: Receive,
    send: Send,
    body: bytes,
    payload: dict[str, Any],
    model: str,
    limit: int | None = None,
) -> Awaitable[None]:
    """Admit, forward and meter one request whose model is known (the pipeline's
    coroutine, to await). A non-JSON body (an audio upload) has only `model` in `payload`
    and is forwarded byte for byte."""
    return relay.serve(
        pipeline, OpenAI(pipeline, scope, body, payload, model, limit), scope, receive, send
    )


class OpenAI:
    """The OpenAI dialect (relay.Dialect): the request goes on with its model renamed and
    its token limit clamped, the answer comes back as the backend sent it."""

    __slots__ = ("body", "inbound", "path", "payload", "strip_usage")

    direct = True  # a stream passes on unchanged: written from the upstream's callback
    error_event = staticmethod(openai_error_event)

    def __init__(
        self,
        pipeline: Pipeline,
        scope: Scope,
        body: bytes,
        payload: dict[str, Any],
        model: str,
        limit: int | None,
    ) -> None:
        path: str = scope["path"]
        self.path, self.body, self.payload = path, body, payload
        self.inbound = Inbound(
            model,
            path,
            caller_key(scope),
            len(body),
            SURFACE_MODE.get(path),
            limit,
            # K6: a conversation's backend matters only where there is more than one.
            session=session_key(scope["headers"], payload) if pipeline.has_choice(model) else None,
            stream=payload.get("stream") is True,
        )
        self.strip_usage = ask_for_usage(path, payload)

    def upstream(self, route: Route) -> tuple[str, bytes]:
        if self.path in UPLOAD_PATHS:
            return self.path, self.body  # no model rename or token clamp in a multipart upload
        return self.path, upstream_body(self.body, self.payload, route, force=self.strip_usage)

    def answer(self, route: Route) -> Codec:
        return AsSent(Meter(self.strip_usage))


__all__ = ["ApiError", "serve"]
