"""`GET /v1/realtime` (SPEC §12 U2, U3): the OpenAI Realtime transcription WebSocket, relayed.

The model comes from the `model` query parameter (the upgrade is then held until the
backend is healthy) or from the first `session.update` / `transcription_session.update`.
A session goes through the one request pipeline like any request (keys, pause, spend,
admission): it holds one fairshare slot and counts in flight on its backend for its whole
life, frames are relayed both ways and close codes passed through; it is reaped after
`realtime.idleTimeout` without a frame and after `realtime.maxDuration`. A saturated
backend closes the socket with 1013 (try again later) and a reason saying when.

No side doors (SPEC §22 T5): the key, and the model named in the query, are judged before
the upgrade is accepted: a refusal then is an HTTP answer (401, 403, 404, 429, 503…) in
the OpenAI error shape, not a socket. An upgraded session whose client sends nothing
within FIRST_EVENT_SECONDS is closed with 1008.
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
from corrallm.http.asgi import JSON, Receive, Scope, Send
from corrallm.http.errors import ApiError
from corrallm.lifecycle.addresses import upstream_url
from corrallm.proxy.pipeline import Admitted, Inbound, Pipeline, caller_key

SESSION_EVENTS = ("session.update", "transcription_session.update")
TRY_AGAIN_LATER = 1013
POLICY_VIOLATION = 1008
# T5: an upgraded socket whose client says nothing holds a connection (and, with a model,
# a slot) for nothing: its first event must come within this many seconds.
FIRST_EVENT_SECONDS = 10.0
DENIAL = "websocket.http.response"  # the ASGI extension for an HTTP answer to an upgrade


class RealtimeRefused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason[:120]  # close reasons are short


class Socket:
    """The client's side: `send`, and whether the upgrade was accepted (after which a
    refusal is a close code, before it an HTTP answer)."""

    def __init__(self, scope: Scope, send: Send) -> None:
        self.scope, self.send = scope, send
        self.accepted = False

    async def accept(self) -> None:
        if not self.accepted:
            self.accepted = True
            await self.send({"type": "websocket.accept"})

    async def refuse(self, exc: ApiError) -> None:
        """A gate's refusal: before the upgrade, its HTTP status and OpenAI-shaped body
        (where the server speaks the denial extension; else a plain 403); after it, a
        close code with the words as its reason."""
        if self.accepted:
            retry = exc.headers.get("retry-after")
            reason = f"{exc.code}: retry after {retry}s" if retry else exc.message
            await self.close(RealtimeRefused(_close_code(exc), reason))
        elif DENIAL in self.scope.get("extensions", {}):
            headers = [(b"content-type", JSON)]
            headers.extend((k.lower().encode(), v.encode()) for k, v in exc.headers.items())
            start = {"type": "websocket.http.response.start", "status": exc.status}
            await self.send({**start, "headers": headers})
            body = orjson.dumps(exc.body())
            await self.send({"type": "websocket.http.response.body", "body": body})
        else:
            await self.send({"type": "websocket.close", "code": _close_code(exc)})

    async def close(self, refused: RealtimeRefused) -> None:
        if self.accepted:
            message = {"type": "websocket.close", "code": refused.code, "reason": refused.reason}
            await self.send(message)
        else:  # before the upgrade: an HTTP 403, the reason in corrallm's log
            await self.send({"type": "websocket.close", "code": refused.code})


async def relay(pipeline: Pipeline, scope: Scope, receive: Receive, send: Send) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    model = (query.get("model") or [None])[0]
    socket = Socket(scope, send)
    first: dict[str, Any] | None = None
    try:
        pipeline.identify(scope)  # T5: the key first, from the head alone
        if model is None:  # the model comes with the first session event
            await socket.accept()
            first = await _first_event(receive)
            model = _model_of(first)
        await _session(pipeline, scope, receive, socket, model, first)
    except ApiError as exc:  # refused by a gate
        await socket.refuse(exc)
    except RealtimeRefused as refused:
        await socket.close(refused)


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
    socket: Socket,
    model: str,
    first: dict[str, Any] | None,
) -> None:
    """One session through the pipeline: it holds a slot and counts in flight on its
    backend for its whole life, so no ttl reaper, eviction or unload takes the backend
    from under it (an unload drains it)."""
    limits = pipeline.runtime.config.realtime

    async def work(admitted: Admitted) -> int:
        admitted.progress.begin()  # a session is never cut by preemption
        route = admitted.route
        url = upstream_url(route.endpoint.base_url, "/v1/realtime").replace("http", "ws", 1)
        params = {"model": route.config.model or admitted.served.name}
        bytes_in = [0]
        try:
            async with pipeline.websockets.ws_connect(url, params=params, autoping=True) as up:
                await socket.accept()
                if first is not None:
                    await up.send_str(orjson.dumps(first).decode())
                heard = first is not None  # the client's first event came already
                return await _pump(limits, receive, socket.send, up, bytes_in, heard)
        except aiohttp.ClientError as exc:
            raise ApiError(
                502, f"backend '{route.id}' refused the realtime session: {exc}", "backend_error"
            ) from exc
        finally:
            admitted.visit.metered = Metered(bytes_in=bytes_in[0])

    key = caller_key(scope)
    user = pipeline.user_of(scope, pipeline.runtime.caller(key))  # T4 (no exchange: judged here)
    inbound = Inbound(model, "/v1/realtime", key, 0, "realtime", user=user)
    await pipeline.run(inbound, work)


async def _pump(
    limits: Realtime,
    receive: Receive,
    send: Send,
    upstream: aiohttp.ClientWebSocketResponse,
    bytes_in: list[int],
    heard: bool,
) -> int:
    """Relay both ways until either side closes, the session idles or runs out of time,
    or (T5) its client sends nothing within FIRST_EVENT_SECONDS."""
    last = [time.monotonic()]
    spoke = [heard]

    async def client_to_upstream() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(code=message.get("code", 1000))
                return
            last[0] = time.monotonic()
            spoke[0] = True
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
            if not spoke[0] and now - began > FIRST_EVENT_SECONDS:
                await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": SILENT})
                return 408
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


SILENT = f"no event within {FIRST_EVENT_SECONDS:g}s of the upgrade"


async def _first_event(receive: Receive) -> dict[str, Any]:
    try:
        async with asyncio.timeout(FIRST_EVENT_SECONDS):
            message = await receive()
    except TimeoutError:
        raise RealtimeRefused(POLICY_VIOLATION, SILENT) from None
    if message["type"] == "websocket.disconnect":
        raise RealtimeRefused(1000, "closed")
    try:
        event = orjson.loads(message.get("text") or message.get("bytes") or b"")
    except orjson.JSONDecodeError:
        raise RealtimeRefused(
            POLICY_VIOLATION, "the first message must be a JSON session event"
        ) from None
    if not isinstance(event, dict) or event.get("type") not in SESSION_EVENTS:
        raise RealtimeRefused(
            POLICY_VIOLATION, "name the model: ?model=M or a first session.update"
        )
    return event


def _model_of(event: dict[str, Any]) -> str:
    session = event.get("session") or {}
    model = session.get("model") or (session.get("input_audio_transcription") or {}).get("model")
    if not isinstance(model, str) or not model:
        raise RealtimeRefused(POLICY_VIOLATION, "session.update names no model")
    return model
