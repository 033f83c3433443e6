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

from typing import Any

import orjson

from corrallm.lifecycle.addresses import upstream_url
from corrallm.proxy.asgi import Headers, Receive, Scope, Send
from corrallm.proxy.client import Response
from corrallm.proxy.errors import ApiError, bad_gateway, bad_request
from corrallm.proxy.feedback import SSEFeedback
from corrallm.proxy.forward import (
    DisconnectWatch,
    forward,
    open_upstream,
    upstream_failure,
)
from corrallm.proxy.inference import filtered, parse_request, upstream_body
from corrallm.proxy.metering import Meter, split_events
from corrallm.proxy.pipeline import Admitted, Inbound, Pipeline, caller_key
from corrallm.proxy.responses_stream import StreamTranslator, encode
from corrallm.proxy.responses_translate import (
    Echo,
    Refused,
    check_request,
    to_chat,
    to_response,
)
from corrallm.routing.affinity import session_key
from corrallm.routing.router import Route

NATIVE = "responses"
CHAT_PATH = "/v1/chat/completions"
MAX_ANSWER = 16 * 1024 * 1024  # a Chat answer read whole to translate it
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_ENDS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')


def native(route: Route) -> bool:
    return NATIVE in route.config.apis


async def serve(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> None:
    payload, model = parse_request(body)
    try:
        limit = check_request(payload)
    except Refused as exc:
        raise bad_request(exc.message, exc.param) from None
    chat: dict[str, Any] | None = None
    refusal: Refused | None = None
    try:
        chat = to_chat(payload)
    except Refused as exc:
        refusal = exc
        served = pipeline.gw.models.get(model)
        if served is not None and not any(native(r) for r in served.routes):
            # No backend of it could serve this: say so before a slot is taken or a
            # backend started. (An unknown model is the pipeline's 404.)
            raise bad_request(exc.message, exc.param) from None
    stream = payload.get("stream") is True
    echo = Echo.of(payload)
    path: str = scope["path"]
    session = session_key(scope["headers"], chat or payload)
    inbound = Inbound(model, path, caller_key(scope), len(body), None, limit, session, stream)
    # K4: a streamed request that waits is told why, on a stream opened early.
    feedback = SSEFeedback(send, error_event) if stream else None
    out = send if feedback is None else feedback.send
    under_way: list[_Relay] = []  # the stream begun, for `interrupted`

    async def work(admitted: Admitted) -> int:
        route, visit = admitted.route, admitted.visit
        extra = [(b"x-corrallm-backend", route.id.encode())]
        extra.extend(admitted.waited.raw())
        if visit.degraded:
            extra.append((b"x-corrallm-degraded", b"true"))
        idle = pipeline.gw.config.upstream_idle(route.config)
        meter = admitted.live.meter = Meter()
        try:
            if native(route):
                data = native_body(body, dict(payload), route)
                url = upstream_url(route.endpoint.base_url, path)
                headers = admitted.upstream_headers(scope["headers"], url)
                if not stream:
                    return await forward(
                        pipeline.upstream,
                        scope,
                        out,
                        url,
                        data,
                        headers,
                        extra,
                        watch,
                        route.id,
                        admitted.ticket,
                        meter,
                        idle_timeout=idle,
                    )
                relay = _Relay(pipeline, admitted, out, watch, meter, None)
                under_way[:] = [relay]
                return await relay.stream(url, data, headers, extra, idle)
            if chat is None:
                assert refusal is not None
                raise bad_request(refusal.message, refusal.param)
            request = dict(chat)  # renamed and clamped per backend, afresh on each try
            data = upstream_body(b"", request, route, force=True)
            url = upstream_url(route.endpoint.base_url, CHAT_PATH)
            headers = admitted.upstream_headers(scope["headers"], url)
            translator = StreamTranslator(echo) if stream else None
            relay = _Relay(pipeline, admitted, out, watch, meter, translator)
            under_way[:] = [relay]
            if translator is not None:
                return await relay.stream(url, data, headers, extra, idle)
            return await relay.whole(url, data, headers, extra, idle, echo)
        finally:
            visit.status = meter.status
            visit.error = meter.error or visit.error
            visit.metered = meter.metered(len(body))
            visit.ttfb_ms = meter.ttfb_ms()

    async def interrupted(admitted: Admitted, error: ApiError) -> None:
        # S4, O1: the events so far are whole; say why the stream ends, in the Responses shape.
        if under_way:
            await under_way[0].end(error.code or "error", error.message)

    watch = DisconnectWatch(receive, scope)
    await pipeline.run_http(inbound, work, watch, interrupted, feedback)


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


class _Relay:
    """One upstream exchange for a Responses request: a Chat answer translated back, or a
    native stream passed through in whole events with its usage read on the way."""

    def __init__(
        self,
        pipeline: Pipeline,
        admitted: Admitted,
        send: Send,
        watch: DisconnectWatch,
        meter: Meter,
        translator: StreamTranslator | None,
    ) -> None:
        self.pipeline = pipeline
        self.admitted = admitted
        self.send = send
        self.watch = watch
        self.meter = meter
        self.translator = translator
        self.sent = 0

    async def _request(self, url: str, data: bytes, headers: Headers, idle: float) -> Response:
        backend = self.admitted.route.id
        return await open_upstream(
            self.pipeline.upstream, "POST", url, data, headers, idle, backend, self.meter
        )

    def _failed(self, exc: BaseException) -> ApiError:
        return upstream_failure(self.meter, self.admitted.route.id, exc)

    async def _body(self, data: bytes, more: bool = True) -> None:
        self.sent += len(data)
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def _relay_as_is(self, response: Response, extra: list[tuple[bytes, bytes]]) -> int:
        """An answer that is not what was asked for (an error): its status and body as sent."""
        chunks = bytearray()
        try:
            async for chunk in response.iter_any():
                if len(chunks) < MAX_ANSWER:
                    chunks += chunk
        except OSError as exc:
            raise self._failed(exc) from None
        body = bytes(chunks)
        self.meter.chunk(body)
        self.meter.finish()
        kind = response.content_type.encode("latin-1")
        start = [(b"content-type", kind), (b"content-length", str(len(body)).encode()), *extra]
        self.watch.finishing = True
        await self.send(
            {"type": "http.response.start", "status": response.status, "headers": start}
        )
        await self._body(body, more=False)
        return int(response.status)

    async def whole(
        self,
        url: str,
        data: bytes,
        headers: Headers,
        extra: list[tuple[bytes, bytes]],
        idle: float,
        echo: Echo,
    ) -> int:
        """A non-streamed request: the Chat answer read whole, sent back as a Response."""
        ticket = self.admitted.ticket
        response = await self._request(url, data, headers, idle)
        async with response:
            json = response.content_type == "application/json"
            self.meter.start(response.status, False, json)
            ticket.started = ticket.shielded = True  # finished, then any preemption
            if response.status != 200 or not json:
                return await self._relay_as_is(response, extra)
            chunks = bytearray()
            try:
                async for chunk in response.iter_any():
                    self.meter.chunk(chunk)
                    chunks += chunk
                    if len(chunks) > MAX_ANSWER:
                        raise bad_gateway(
                            f"backend '{self.admitted.route.id}' answered with over "
                            f"{MAX_ANSWER} bytes of JSON; corrallm translates answers up to that."
                        )
            except OSError as exc:
                raise self._failed(exc) from None
            self.meter.finish()
            try:
                answer = orjson.loads(chunks)
            except orjson.JSONDecodeError:
                raise bad_gateway(
                    f"backend '{self.admitted.route.id}' answered with JSON that does not "
                    "parse; its log (GET /api/v1/models/logs) may say why."
                ) from None
            body = orjson.dumps(to_response(answer, echo))
        start = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        self.watch.finishing = True
        await self.send({"type": "http.response.start", "status": 200, "headers": start + extra})
        await self._body(body, more=False)
        self.meter.bytes_out = self.sent
        return 200

    async def stream(
        self,
        url: str,
        data: bytes,
        headers: Headers,
        extra: list[tuple[bytes, bytes]],
        idle: float,
    ) -> int:
        """A streamed request: whole events relayed (native) or translated, as they come."""
        ticket, meter, translator = self.admitted.ticket, self.meter, self.translator
        response = await self._request(url, data, headers, idle)
        async with response:
            sse = response.content_type == "text/event-stream"
            meter.start(response.status, sse, response.content_type == "application/json")
            if response.status != 200 or not sse:
                ticket.started = ticket.shielded = True
                return await self._relay_as_is(response, extra)
            await self.send(
                {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + extra}
            )
            ticket.started, ticket.shielded = True, False
            if translator is not None:
                await self._body(encode(translator.start()))
            pending = b""
            try:
                async for chunk in response.iter_any():
                    events, pending = split_events(pending + chunk)
                    if events:
                        await self._events(meter.chunk(events))
                if pending:
                    await self._events(meter.chunk(pending))
            except OSError as exc:
                error = self._failed(exc)
                await self._body(self._failure(error.code or "backend_error", error.message))
            else:
                if translator is not None:
                    self.watch.finishing = True
                    await self._body(encode(translator.finish()))
            meter.finish()
            if translator is not None and isinstance(translator.usage, dict):
                meter.usage = translator.usage
        self.watch.finishing = True
        await self._body(b"", more=False)
        meter.bytes_out = self.sent
        return meter.status

    def _failure(self, code: str, message: str) -> bytes:
        """The events that end a stream which cannot go on, in the Responses shape."""
        if self.translator is not None:
            return encode(self.translator.fail(code, message))
        error = {"type": "error", "sequence_number": self.meter.events, "code": code}
        return encode([{**error, "message": message, "param": None}])

    async def end(self, code: str, message: str) -> None:
        """End a stream under way (S4: preempted; O1: cancelled) at an event boundary."""
        self.watch.finishing = True
        await self._body(self._failure(code, message), more=False)

    async def _events(self, data: bytes) -> None:
        translator = self.translator
        if translator is None:  # native: as sent, its usage read from the last event
            if any(end in data for end in _ENDS):
                usage = final_usage(data)
                if usage is not None:
                    self.meter.usage = usage
                self.watch.finishing = True
            await self._body(data)
            return
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
        if out:
            await self._body(encode(out))


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
