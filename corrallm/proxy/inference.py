"""The OpenAI HTTP surfaces: chat, completions, embeddings, rerank, speech and audio uploads
(SPEC §3, §8, §12).

This module is a codec on the one pipeline (proxy/pipeline.py): it reads the request
(parsed once, the model looked up in a prebuilt table by the pipeline), forwards it to
the admitted backend with the model renamed and the token limit clamped, relays the
answer chunk by chunk, and writes errors in the OpenAI shape. No blocking I/O, no config
parsing.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson

from corrallm.lifecycle.addresses import upstream_url
from corrallm.proxy import jsonbody
from corrallm.proxy.asgi import Receive, Scope, Send
from corrallm.proxy.errors import ApiError, bad_request, quoted
from corrallm.proxy.feedback import SSEFeedback
from corrallm.proxy.forward import (
    DisconnectWatch,
    direct_writer,
    forward,
    stream_error,
)
from corrallm.proxy.metering import Meter, ask_for_usage
from corrallm.proxy.pipeline import SURFACE_MODE, Admitted, Inbound, Pipeline, caller_key
from corrallm.routing.affinity import session_key
from corrallm.routing.router import Route

_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")
MAX_TOKENS_ASKED = 2**31 - 1

# Uploads (multipart): forwarded byte for byte, boundary and all.
UPLOAD_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})


def parse_request(body: bytes) -> tuple[dict[str, Any], str]:
    """The JSON object of a /v1 body (a key repeated is refused: jsonbody.py) and its
    model."""
    payload = jsonbody.parse(body)
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object with a 'model' field.")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "Missing 'model': name the model to use (GET /v1/models lists them).", param="model"
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
    path: str = scope["path"]
    inbound = Inbound(
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
    strip_usage = ask_for_usage(path, payload)
    # K4: a streamed request that waits is told why, on a stream opened early.
    feedback = SSEFeedback(send) if payload.get("stream") is True else None
    out = send if feedback is None else feedback.send

    async def work(admitted: Admitted) -> int:
        route, ticket, visit = admitted.route, admitted.ticket, admitted.visit
        extra = [(b"x-corrallm-backend", route.id.encode())]
        extra.extend(admitted.waited.raw())
        if visit.degraded:
            extra.append((b"x-corrallm-degraded", b"true"))
        if path in UPLOAD_PATHS:
            data = body  # no model rename or token clamp inside a multipart upload
        else:
            data = upstream_body(body, payload, route, force=strip_usage)
        meter = admitted.live.meter = Meter(strip_usage)
        url = upstream_url(route.endpoint.base_url, path)
        try:
            return await forward(
                pipeline.upstream,
                scope,
                out,
                url,
                data,
                admitted.upstream_headers(scope["headers"], url, scope["method"]),
                extra,
                watch,
                route.id,
                ticket,
                meter,
                idle_timeout=pipeline.gw.config.upstream_idle(route.config),
                direct=direct,  # the feedback stream passes an SSE body on unchanged
            )
        finally:
            visit.status = meter.status
            visit.error = meter.error or visit.error  # the answer broke off: 502/504
            visit.metered = meter.metered(len(body))
            visit.ttfb_ms = meter.ttfb_ms()

    async def interrupted(admitted: Admitted, error: ApiError) -> None:
        # S4, O1: the stream so far is complete up to an event boundary; say why it ends.
        await send({"type": "http.response.body", "body": stream_error(error)})

    watch = DisconnectWatch(receive, scope)
    direct = direct_writer(scope) if inbound.stream else None
    return pipeline.run_http(inbound, work, watch, interrupted, feedback)


__all__ = ["ApiError", "serve"]
