"""`GET /v1/realtime` (SPEC §12 U2, U3): the OpenAI Realtime transcription WebSocket, relayed.

The model comes from the `model` query parameter (the upgrade is then held until the
backend is healthy) or from the first `session.update` / `transcription_session.update`.
The session holds one fairshare slot for its whole life, frames are relayed both ways and
close codes passed through; it is reaped after `realtime.idleTimeout` without a frame and
after `realtime.maxDuration`. A saturated backend closes the socket with 1013 (try again
later) and a reason saying when.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from urllib.parse import parse_qs

import aiohttp
import orjson

from corrallm.cost.ledger import Visit
from corrallm.cost.model import Metered
from corrallm.gateway import Gateway
from corrallm.lifecycle.addresses import upstream_url
from corrallm.lifecycle.errors import LifecycleError
from corrallm.proxy.asgi import Receive, Scope, Send
from corrallm.proxy.inference import caller_key, offered
from corrallm.scheduler.admission import Rejected

SESSION_EVENTS = ("session.update", "transcription_session.update")
TRY_AGAIN_LATER = 1013
POLICY_VIOLATION = 1008


class Refused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason[:120]  # close reasons are short


async def relay(gateway: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
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
        await _session(gateway, scope, receive, send, model, first, accepted)
    except Refused as refused:
        if accepted:
            await send({"type": "websocket.close", "code": refused.code, "reason": refused.reason})
        else:  # before the upgrade: an HTTP 403, the reason in corrallm's log
            await send({"type": "websocket.close", "code": refused.code})


async def _session(
    gateway: Gateway,
    scope: Scope,
    receive: Receive,
    send: Send,
    model: str,
    first: dict[str, Any] | None,
    accepted: bool,
) -> None:
    served = gateway.models.get(model)
    if served is None or not offered(served, "realtime"):
        raise Refused(POLICY_VIOLATION, f"model {model!r} is not offered on /v1/realtime")
    caller = gateway.caller(caller_key(scope))
    route = served.tiers_for(caller.group, gateway.placeable)
    visit = Visit(
        caller.key if caller.known else None, caller.group_name, served.name, "/v1/realtime", 0
    )
    try:
        ticket = await gateway.admission.acquire(caller.group_name, caller.group, route)
    except Rejected as exc:
        raise Refused(
            TRY_AGAIN_LATER, f"saturated: retry after {int(exc.decision.retry_after)}s"
        ) from None
    visit.admitted_mono = time.monotonic()
    visit.backend, visit.backend_id = ticket.route.config, ticket.route.id
    try:
        try:
            await ticket.route.endpoint.ensure_ready((visit.key, caller.group_name, served.name))
        except LifecycleError as exc:
            raise Refused(TRY_AGAIN_LATER, f"backend did not start: {exc}") from None
        url = upstream_url(ticket.route.endpoint.base_url, "/v1/realtime").replace("http", "ws", 1)
        async with gateway.session.ws_connect(
            url, params={"model": ticket.route.config.model or served.name}, autoping=True
        ) as upstream:
            if not accepted:
                await send({"type": "websocket.accept"})
            if first is not None:
                await upstream.send_str(orjson.dumps(first).decode())
            visit.status = await _pump(gateway, receive, send, upstream, visit)
    finally:
        gateway.admission.release(ticket)
        gateway.settle(visit)


async def _pump(
    gateway: Gateway,
    receive: Receive,
    send: Send,
    upstream: aiohttp.ClientWebSocketResponse,
    visit: Visit,
) -> int:
    """Relay both ways until either side closes, the session idles or runs out of time."""
    limits = gateway.config.realtime
    last = [time.monotonic()]
    bytes_in = [0]

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
        visit.metered = Metered(bytes_in=bytes_in[0])


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
