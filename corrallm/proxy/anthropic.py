"""The Anthropic Messages surfaces (SPEC §16 K1): `POST /v1/messages` and
`POST /v1/messages/count_tokens`, a codec on the one pipeline (proxy/pipeline.py).

A request is read and checked once (anthropic_translate.to_chat: a malformed one is a 400
before any gate), admitted by the pipeline like a chat completion (same lanes, slots,
cost, activity, preemption), then, on the admitted backend:

- native, when its `apis` include `anthropic`: the body goes on to `<base>/v1/messages`
  (model renamed, token limit clamped by `inference.upstream_body`), the answer relayed as
  it comes, its usage metered from `usage` / `message_start` + `message_delta`;
- translated otherwise: a Chat Completions request (through `inference.upstream_body`
  too), the answer turned back into a Message, a stream into Anthropic's events.

Errors are Anthropic-shaped (`write_error`, the error writer of these paths in app.py's
`SURFACES`); a stream that breaks or is preempted ends with an `event: error`.
"""

from __future__ import annotations

from typing import Any

import orjson

from corrallm.cost.model import BYTES_PER_TOKEN
from corrallm.lifecycle.addresses import origin, upstream_url
from corrallm.proxy.anthropic_stream import EventStream
from corrallm.proxy.anthropic_translate import (
    error_body,
    error_event,
    from_chat,
    prompt_text,
    to_chat,
)
from corrallm.proxy.asgi import Headers, Receive, Scope, Send, send_bytes
from corrallm.proxy.client import Response
from corrallm.proxy.errors import ApiError, bad_gateway, bad_request, quoted
from corrallm.proxy.feedback import SSEFeedback
from corrallm.proxy.forward import (
    DisconnectWatch,
    open_upstream,
    request_headers,
    upstream_failure,
)
from corrallm.proxy.inference import parse_request, token_limit, upstream_body
from corrallm.proxy.metering import MAX_METERED_BODY, Meter, split_events
from corrallm.proxy.pipeline import Admitted, Inbound, Pipeline, caller_key, ready
from corrallm.routing.affinity import session_key
from corrallm.routing.router import Route

NATIVE = "anthropic"
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


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


async def serve(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> None:
    """`POST /v1/messages`."""
    payload, model = parse_request(body)
    chat, limit, rewritten = _read(payload)
    if rewritten:
        body = orjson.dumps(payload)
    stops: list[str] = payload.get("stop_sequences") or []
    session = session_key(scope["headers"], chat)
    inbound = Inbound(
        model,
        scope["path"],
        caller_key(scope),
        len(body),
        None,
        limit,
        session,
        stream=payload.get("stream") is True,
    )
    # K4: a streamed request that waits is told why, on a stream opened early.
    feedback = SSEFeedback(send, error_event) if payload.get("stream") is True else None
    out = send if feedback is None else feedback.send

    async def work(admitted: Admitted) -> int:
        route, visit = admitted.route, admitted.visit
        base = route.endpoint.base_url
        if speaks_anthropic(route):
            url = upstream_url(base, "/v1/messages")
            data = upstream_body(body, payload, route)
            meter: Meter = AnthropicMeter()
            stream = None
        else:
            url = upstream_url(base, "/v1/chat/completions")
            data = upstream_body(b"", chat, route, force=True)
            meter = Meter()
            stream = EventStream(model, stops)
        admitted.live.meter = meter
        try:
            return await _exchange(
                pipeline,
                admitted,
                out,
                url,
                data,
                admitted.upstream_headers(scope["headers"], url),
                meter,
                watch,
                stream,
            )
        finally:
            visit.status = meter.status or visit.status
            visit.error = meter.error or visit.error
            visit.metered = meter.metered(len(body))
            visit.ttfb_ms = meter.ttfb_ms()

    async def interrupted(admitted: Admitted, error: ApiError) -> None:
        # S4, O1: the stream so far ends at an event boundary; say why it stops.
        await send({"type": "http.response.body", "body": error_event(error)})

    watch = DisconnectWatch(receive, scope)
    await pipeline.run_http(inbound, work, watch, interrupted, feedback)


def _response_headers(admitted: Admitted) -> list[tuple[bytes, bytes]]:
    extra = [(b"x-corrallm-backend", admitted.route.id.encode())]
    extra.extend(admitted.waited.raw())
    if admitted.visit.degraded:
        extra.append((b"x-corrallm-degraded", b"true"))
    return extra


async def _exchange(
    pipeline: Pipeline,
    admitted: Admitted,
    send: Send,
    url: str,
    data: bytes,
    headers: Headers,
    meter: Meter,
    watch: DisconnectWatch,
    stream: EventStream | None,
) -> int:
    """One upstream exchange, its answer relayed (native) or translated (`stream` given)."""
    route, ticket = admitted.route, admitted.ticket
    idle = pipeline.gw.config.upstream_idle(route.config)
    response = await open_upstream(
        pipeline.upstream, "POST", url, data, headers, idle, route.id, meter
    )
    async with response:
        kind = response.content_type
        sse = kind == "text/event-stream"
        meter.start(response.status, sse, kind == "application/json")
        if response.status >= 400 or not (sse or kind == "application/json"):
            answer = await _whole(response, meter, route.id)
            raise _upstream_error(response.status, answer, route.id)
        ticket.started = True
        ticket.shielded = not sse
        extra = _response_headers(admitted)
        if not sse:
            answer = await _whole(response, meter, route.id)
            meter.finish()
            if stream is not None:
                answer = orjson.dumps(
                    from_chat(_json(answer, route.id), stream.model, stream.stops)
                )
            watch.finishing = True
            await _send_json(send, response.status, answer, extra)
            return int(response.status)
        start = {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + extra}
        await send(start)
        return await _events(response, send, watch, meter, stream, route.id)


async def _send_json(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body})


async def _whole(response: Response, meter: Meter | None, backend: str) -> bytes:
    """A JSON answer read whole (nothing has been sent: a break is a clean 502/504)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in response.iter_any():
            if meter is not None:
                chunk = meter.chunk(chunk)
            size += len(chunk)
            if size > MAX_METERED_BODY:
                raise bad_gateway(f"backend '{backend}' sent an answer over 8 MB.")
            chunks.append(chunk)
    except OSError as exc:
        raise upstream_failure(meter, backend, exc) from None
    return b"".join(chunks)


def _json(answer: bytes, backend: str) -> Any:
    try:
        return orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise bad_gateway(f"backend '{backend}' answered with invalid JSON.") from None


def _upstream_error(status: int, answer: bytes, backend: str) -> ApiError:
    """The backend refused: its status and message (OpenAI or Anthropic shaped) carried on."""
    message = answer[:500].decode("utf-8", "replace").strip()
    try:
        obj = orjson.loads(answer)
        inner = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            message = inner["message"]
    except orjson.JSONDecodeError:
        pass
    if status < 400:
        status, message = 502, f"an answer that is neither JSON nor SSE ({message[:100]})"
    return ApiError(status, f"backend '{backend}' answered {status}: {message}")


async def _events(
    response: Response,
    send: Send,
    watch: DisconnectWatch,
    meter: Meter,
    stream: EventStream | None,
    backend: str,
) -> int:
    """The SSE answer in whole events: passed on (native) or translated. A break ends it
    with an `event: error`, a torn last event dropped; nothing follows the end."""
    status = 200
    pending = b""
    done = False
    try:
        async for chunk in response.iter_any():
            whole, pending = split_events(pending + chunk)
            if not whole:
                continue
            out = meter.chunk(whole)
            if stream is not None:
                out = _translate(out, stream)
                done = stream.finished
            elif b"message_stop" in out:
                done = True
            if done:
                watch.finishing = True  # the answer is whole: a client leaving now was served
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
    except OSError as exc:
        if not done:
            error = upstream_failure(meter, backend, exc)
            status = error.status
            body = error_event(error)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            done = True
    if not done:
        tail = meter.chunk(pending) if pending else b""
        if stream is not None:
            tail = _translate(tail, stream) + stream.finish()
        if tail:
            await send({"type": "http.response.body", "body": tail, "more_body": True})
    meter.finish()
    watch.finishing = True
    await send({"type": "http.response.body", "body": b""})
    return status


def _translate(events: bytes, stream: EventStream) -> bytes:
    """Chat SSE events (whole) to Anthropic's."""
    if b"\r" in events:
        events = events.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    out = []
    for line in events.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.append(stream.finish())
            continue
        try:
            out.append(stream.feed(orjson.loads(data)))
        except orjson.JSONDecodeError:
            continue
    return b"".join(out)


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
    route = served.tiers_for(caller.group, pipeline.gw.placeable)[0][0]
    await ready(route)
    extra = [(b"x-corrallm-backend", route.id.encode())]
    idle = pipeline.gw.config.upstream_idle(route.config)
    if speaks_anthropic(route):
        if route.config.model:
            payload["model"] = route.config.model
        url = upstream_url(route.endpoint.base_url, "/v1/messages/count_tokens")
        headers = _headers(scope, route)
        response = await open_upstream(
            pipeline.upstream, "POST", url, orjson.dumps(payload), headers, idle, route.id, None
        )
        async with response:
            answer = await _whole(response, None, route.id)
            if response.status >= 400:
                raise _upstream_error(response.status, answer, route.id)
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
            answer = await _whole(response, None, route.id)
            if response.status != 200:
                return None
    except (OSError, ApiError):
        return None
    try:
        tokens = orjson.loads(answer).get("tokens")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return len(tokens) if isinstance(tokens, list) else None
