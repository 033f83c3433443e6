"""`GET /v1/realtime` (SPEC §12 U2, U3): the OpenAI Realtime transcription WebSocket, relayed.

The model comes from the `model` query parameter (the upgrade is then held until the
backend is healthy) or from the first `session.update` / `transcription_session.update`.
A session goes through the one request pipeline like any request (keys, pause, spend,
admission): it holds one fairshare slot and counts in flight on its backend for its whole
life, frames are relayed both ways and close codes passed through; it is reaped after
`realtime.idleTimeout` without a frame and after `realtime.maxDuration`. A saturated
backend closes the socket with 1013 (try again later) and a reason saying when.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from urllib.parse import parse_qs

import aiohttp
import orjson

from corrallm.config.schema import Realtime
from corrallm.cost.model import Metered
from corrallm.lifecycle.addresses import upstream_url
from corrallm.proxy.asgi import Receive, Scope, Send
from corrallm.proxy.errors import ApiError
from corrallm.proxy.pipeline import Admitted, Inbound, Pipeline, caller_key

SESSION_EVENTS = ("session.update", "transcription_session.update")
TRY_AGAIN_LATER = 1013
POLICY_VIOLATION = 1008


class Refused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason[:120]  # close reasons are short


async def relay(pipeline: Pipeline, scope: Scope, receive: Receive, send: Send) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    model = (query.get("model") or [None])[0]
    accepted = False
    first: dict[str, Any] | None = None
    try:
        if model is None:  # the model comes with the first session event
            await send({"type": "websocket.accept"})
            accepted = True
            first = await _first_event(receive)
            model = _model_of(first)
        await _session(pipeline, scope, receive, send, model, first, accepted)
    except ApiError as exc:  # refused by a gate: a close code, the words as its reason
        retry = exc.headers.get("retry-after")
        reason = f"{exc.code}: retry after {retry}s" if retry else exc.message
        await _close(send, accepted, Refused(_close_code(exc), reason))
    except Refused as refused:
        await _close(send, accepted, refused)


async def _close(send: Send, accepted: bool, refused: Refused) -> None:
    if accepted:
        await send({"type": "websocket.close", "code": refused.code, "reason": refused.reason})
    else:  # before the upgrade: an HTTP 403, the reason in corrallm's log
        await send({"type": "websocket.close", "code": refused.code})


def _close_code(exc: ApiError) -> int:
    """Congestion and failed starts are worth retrying (1013); anything else, a pause
    included (F3: a decision, not congestion), is a refusal (1008)."""
    if exc.code == "paused":
        return POLICY_VIOLATION
    return TRY_AGAIN_LATER if exc.status in (429, 502, 503, 504) else POLICY_VIOLATION


async def _session(
    pipeline: Pipeline,
    scope: Scope,
    receive: Receive,
    send: Send,
    model: str,
    first: dict[str, Any] | None,
    accepted: bool,
) -> None:
    """One session through the pipeline: it holds a slot and counts in flight on its
    backend for its whole life, so no ttl reaper, eviction or unload takes the backend
    from under it (an unload drains it)."""
    limits = pipeline.gw.config.realtime

    async def work(admitted: Admitted) -> int:
        admitted.ticket.started = admitted.ticket.shielded = True  # never cut by preemption
        route = admitted.route
        url = upstream_url(route.endpoint.base_url, "/v1/realtime").replace("http", "ws", 1)
        params = {"model": route.config.model or admitted.served.name}
        bytes_in = [0]
        try:
            async with pipeline.websockets.ws_connect(url, params=params, autoping=True) as up:
                if not accepted:
                    await send({"type": "websocket.accept"})
                if first is not None:
                    await up.send_str(orjson.dumps(first).decode())
                return await _pump(limits, receive, send, up, bytes_in)
        except aiohttp.ClientError as exc:
            raise ApiError(
                502, f"backend '{route.id}' refused the realtime session: {exc}", "backend_error"
            ) from exc
        finally:
            admitted.visit.metered = Metered(bytes_in=bytes_in[0])

    key = caller_key(scope)
    user = pipeline.user_of(scope, pipeline.gw.caller(key))  # T4 (no exchange: judged here)
    inbound = Inbound(model, "/v1/realtime", key, 0, "realtime", user=user)
    await pipeline.run(inbound, work)


async def _pump(
    limits: Realtime,
    receive: Receive,
    send: Send,
    upstream: aiohttp.ClientWebSocketResponse,
    bytes_in: list[int],
) -> int:
    """Relay both ways until either side closes, the session idles or runs out of time."""
    last = [time.monotonic()]

    async def client_to_upstream() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(code=message.get("code", 1000))
                return
            last[0] = time.monotonic()
            if message.get("text") is not None:
                bytes_in[0] += len(message["text"])
                await upstream.send_str(message["text"])
            elif message.get("bytes") is not None:
                bytes_in[0] += len(message["bytes"])
                await upstream.send_bytes(message["bytes"])

    async def upstream_to_client() -> None:
        async for message in upstream:
            last[0] = time.monotonic()
            if message.type == aiohttp.WSMsgType.TEXT:
                await send({"type": "websocket.send", "text": message.data})
            elif message.type == aiohttp.WSMsgType.BINARY:
                await send({"type": "websocket.send", "bytes": message.data})
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code})

    began = time.monotonic()
    tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
    try:
        while True:
            done, _ = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if done:
                return 200
            now = time.monotonic()
            if now - last[0] > limits.idle_timeout or now - began > limits.max_duration:
                why = "idle" if now - last[0] > limits.idle_timeout else "maxDuration reached"
                await send({"type": "websocket.close", "code": 1000, "reason": f"session {why}"})
                return 200
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first_event(receive: Receive) -> dict[str, Any]:
    message = await receive()
    if message["type"] == "websocket.disconnect":
        raise Refused(1000, "closed")
    try:
        event = orjson.loads(message.get("text") or message.get("bytes") or b"")
    except orjson.JSONDecodeError:
        raise Refused(POLICY_VIOLATION, "the first message must be a JSON session event") from None
    if not isinstance(event, dict) or event.get("type") not in SESSION_EVENTS:
        raise Refused(POLICY_VIOLATION, "name the model: ?model=M or a first session.update")
    return event


def _model_of(event: dict[str, Any]) -> str:
    session = event.get("session") or {}
    model = session.get("model") or (session.get("input_audio_transcription") or {}).get("model")
    if not isinstance(model, str) or not model:
        raise Refused(POLICY_VIOLATION, "session.update names no model")
    return model
