"""The one relay (SPEC §3, §6 S4/S7, §21 O2): an admitted request sent upstream and its
answer relayed back, for every dialect.

    open upstream -> the answer's head -> the dialect's `Codec` picks a `Mode` ->
      PASS    the upstream's head and body as they came: SSE in whole events (written
              straight to the client's connection where it can be), JSON held up to
              HELD_MAX so a break becomes a clean 502/504, anything else chunk by chunk
      EVENTS  the dialect's own SSE head, each whole upstream event translated
      WHOLE   held whole (at most HELD_MAX), translated, sent as one JSON answer
      AS_IS   held whole, sent with its status and content type (an error, say)
      REFUSE  held whole and raised as the dialect's error (nothing was sent)
    -> metered -> the end (the dialect's error event on a break; nothing after the end)

A stream goes through one loop (`_relay_events`), whichever the mode: whole events cut at
blank lines and metered, then passed on (`_Events`) or translated by the codec
(`_Translating`); a break ends it with the codec's error events. A dialect translated
from Chat Completions (Anthropic, Responses, Ollama) uses `dialects/stream.Translated`.

The relay owns the request's `Progress` (scheduler/ticket.py): it says when the head went
out and, for a stream that ends cleanly at event boundaries, how to end it with an
interruption in the dialect's shape (`Progress.render`), which the pipeline calls when a
preemption, a cancel or a peer going down stops the request part-way.

A dialect (proxy/dialects/) supplies the codec; `serve()` is the work every dialect's
request does once admitted. Nothing is buffered beyond what a mode says.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from corrallm.http.asgi import Headers, Message, Receive, Scope, Send
from corrallm.http.client import Client, Response
from corrallm.http.errors import ApiError, bad_gateway
from corrallm.lifecycle.addresses import upstream_url
from corrallm.proxy.feedback import SSE_FEEDBACK, SSE_TYPE, StreamFeedback, StreamForm
from corrallm.proxy.forward import (
    DROP_RESPONSE,
    Direct,
    DisconnectWatch,
    direct_writer,
    kept,
    open_upstream,
    stream_error,
    upstream_failure,
)
from corrallm.proxy.metering import Meter, split_events
from corrallm.scheduler.ticket import Progress, Stage

if TYPE_CHECKING:
    from corrallm.cost.ledger import Visit
    from corrallm.proxy.pipeline import Admitted, Inbound, Pipeline
    from corrallm.routing.router import Route

# The one cap on an answer held in memory before it is sent (non-streamed answers): a
# JSON answer passed on is held up to this size, so that a backend dying or hanging
# partway through it becomes a clean 502/504 instead of a cut body, then streams on; an
# answer read whole (to translate it, or an error to pass on) may not be larger (502).
# Requests are capped by `maxBodySize` (http/bodies.py).
HELD_MAX = 16 * 1024 * 1024

SSE = SSE_TYPE


class Mode(enum.Enum):
    PASS = 1
    EVENTS = 2
    WHOLE = 3
    AS_IS = 4
    REFUSE = 5


class Codec(Protocol):
    """A dialect's side of one upstream answer. `cuttable`: a stream of it may be ended
    at an event boundary by an interruption (else a preemption waits for its end).
    `stream_type`: the content type of an EVENTS stream (SSE, or NDJSON lines). A
    refused answer (REFUSE) is `upstream_error`, rendered by the dialect's error writer.
    The meter meters the upstream's answer as it came, whatever the client gets."""

    meter: Meter
    cuttable: bool
    stream_type: bytes

    def mode(self, status: int, kind: str) -> Mode:
        """What to do with an answer of this status and content type."""

    def whole(self, body: bytes, backend: str) -> bytes:
        """WHOLE: the answer (held whole) in the dialect's shape."""

    def begin(self) -> bytes:
        """EVENTS: what opens the stream, before any upstream event."""

    def events(self, data: bytes) -> bytes:
        """EVENTS: whole upstream events (metered) in the dialect's shape."""

    def done(self, sent: bytes) -> bool:
        """EVENTS: whether the answer is whole once `sent` went out (a client leaving
        after that was served, S7; a break after it is not an error)."""

    def close(self, tail: bytes) -> bytes:
        """EVENTS: the upstream ended before the answer was whole (`done`); its
        unterminated last event (metered) and what closes the stream."""

    def fail(self, error: ApiError) -> bytes:
        """The events that end a stream with `error` (a break, an interruption)."""


class AsSent:
    """The upstream's answer as it came: OpenAI's own dialect (and any raw body). A
    stream of it breaks off with OpenAI's error event and `[DONE]`; `cuttable`: whether a
    stream may be ended at an event boundary by an interruption."""

    __slots__ = ("cuttable", "meter")

    stream_type = SSE

    def __init__(self, meter: Meter, cuttable: bool = True) -> None:
        self.meter = meter
        self.cuttable = cuttable

    def mode(self, status: int, kind: str) -> Mode:
        return Mode.PASS

    def whole(self, body: bytes, backend: str) -> bytes:
        return body

    def begin(self) -> bytes:
        return b""

    def events(self, data: bytes) -> bytes:
        return data

    def done(self, sent: bytes) -> bool:
        return b"[DONE]" in sent

    def close(self, tail: bytes) -> bytes:
        return tail

    def fail(self, error: ApiError) -> bytes:
        return stream_error(error)


# -- the relay --------------------------------------------------------------------------


async def relay(
    client: Client,
    method: str,
    url: str,
    body: bytes,
    headers: Headers,
    extra: list[tuple[bytes, bytes]],
    send: Send,
    watch: DisconnectWatch,
    backend_id: str,
    codec: Codec,
    progress: Progress | None = None,
    idle_timeout: float | None = None,
    direct: Direct | None = None,
    visit: Visit | None = None,
) -> int:
    """Send the request upstream and relay the answer as `codec` says; returns the
    status to record, and records what the meter read on `visit`.

    That is the upstream's status, unless the answer broke off after it began: then 502
    (the backend closed or crashed) or 504 (silent for `idle_timeout` seconds), with
    the meter's `error` saying why. A failure before anything reached the client raises
    an `ApiError` (502 `backend_error` / 504 `upstream_timeout`) instead. `direct`: the
    client's connection, when `send` passes an SSE body on unchanged (`direct_writer`).
    """
    meter = codec.meter
    try:
        response = await open_upstream(
            client, method, url, body, headers, idle_timeout, backend_id, meter
        )
        async with response:
            kind = response.content_type
            sse = kind == "text/event-stream"
            meter.start(response.status, sse, kind == "application/json")
            mode = codec.mode(response.status, kind)
            if mode is Mode.PASS:
                raw = kept(response.headers, DROP_RESPONSE)
                raw.extend(extra)
                start = {"type": "http.response.start", "status": response.status, "headers": raw}
                if sse:
                    if progress is not None:
                        progress.begin(_renderer(send, codec) if codec.cuttable else None)
                    # Only a 200 is relayed as it came; a feedback stream turns others into errors.
                    writer = direct if response.status == 200 else None
                    events = _Events(meter, watch)
                    return await _relay_events(
                        response, send, start, backend_id, codec, events, writer
                    )
                if progress is not None:
                    progress.begin()
                hold = HELD_MAX if kind == "application/json" else 0
                return await _relay_body(response, send, start, watch, backend_id, meter, hold)
            if mode is Mode.REFUSE:
                raise upstream_error(
                    response.status, await held(response, meter, backend_id), backend_id
                )
            if mode is Mode.EVENTS:
                if progress is not None:
                    progress.begin(_renderer(send, codec))
                head = [
                    (b"content-type", codec.stream_type),
                    (b"cache-control", b"no-cache"),
                    *extra,
                ]
                start = {"type": "http.response.start", "status": 200, "headers": head}
                events = _Translating(codec, watch)
                return await _relay_events(
                    response, send, start, backend_id, codec, events, None, codec.begin()
                )
            if progress is not None:
                progress.begin()  # held: it finishes, then any preemption
            answer = await held(response, meter, backend_id)
            meter.finish()
            if mode is Mode.WHOLE:
                answer, kind = codec.whole(answer, backend_id), "application/json"
            head = [
                (b"content-type", kind.encode("latin-1")),
                (b"content-length", b"%d" % len(answer)),
                *extra,
            ]
            watch.finishing = True
            await send({"type": "http.response.start", "status": response.status, "headers": head})
            await send({"type": "http.response.body", "body": answer})
            if progress is not None:
                progress.stage = Stage.EVENTS
            return int(response.status)
    finally:
        if visit is not None:  # what the meter says, on the request's record
            visit.status = meter.status or visit.status
            visit.error = meter.error or visit.error  # the answer broke off: 502/504
            visit.metered = meter.metered(visit.bytes_in)
            visit.ttfb_ms = meter.ttfb_ms()


def _renderer(send: Send, codec: Codec) -> Callable[[ApiError], Awaitable[None]]:
    """How an interruption ends this stream (S4, O1, X4): the dialect's error events,
    at the event boundary where the relay stopped, and nothing after them."""

    def render(error: ApiError) -> Awaitable[None]:
        return send({"type": "http.response.body", "body": codec.fail(error)})

    return render


async def held(response: Response, meter: Meter | None, backend: str) -> bytes:
    """An answer read whole (nothing of it sent: a break is a clean 502/504), at most
    HELD_MAX bytes."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in response.iter_any():
            if meter is not None:
                chunk = meter.chunk(chunk)
            size += len(chunk)
            if size > HELD_MAX:
                raise bad_gateway(
                    f"backend '{backend}' sent an answer over {HELD_MAX >> 20} MB, the most "
                    "corrallm holds to translate or pass on whole."
                )
            chunks.append(chunk)
    except OSError as exc:
        raise upstream_failure(meter, backend, exc) from None
    return b"".join(chunks)


async def _relay_body(
    response: Response,
    send: Send,
    start: Message,
    watch: DisconnectWatch,
    backend_id: str,
    meter: Meter,
    hold: int,
) -> int:
    """A plain body, chunk by chunk; the first `hold` bytes are sent only once whole.

    The headers go out with the first bytes (so a break before any is a clean error).
    A break after the headers went out cannot change the status: the connection is
    closed with the body cut short (never ended as if whole), and the failure recorded.
    """
    held_: list[bytes] = []
    size = 0
    sent = False
    try:
        while (chunk := await response.next_chunk()) is not None:
            chunk = meter.chunk(chunk)
            if not sent:
                held_.append(chunk)
                size += len(chunk)
                if size <= hold:
                    continue
                await send(start)
                sent = True
                chunk = held_[0] if len(held_) == 1 else b"".join(held_)
                held_ = []
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except OSError as exc:
        error = upstream_failure(meter, backend_id, exc)
        if not sent:
            raise error from None
        return error.status  # returning unfinished makes the server close the connection
    meter.finish()
    watch.finishing = True
    if not sent:
        await send(start)
        await send({"type": "http.response.body", "body": b"".join(held_)})
    else:
        await send({"type": "http.response.body", "body": b""})
    return int(response.status)


async def _relay_events(
    response: Response,
    send: Send,
    start: Message,
    backend_id: str,
    codec: Codec,
    events: _Events,
    direct: Direct | None = None,
    opening: bytes = b"",
) -> int:
    """An SSE answer relayed in whole events, passed on or translated (`events`): a
    preemption or a break always leaves the client at an event boundary, and metering
    sees each event whole. `opening`: what opens a translated stream.

    With `direct` (the client's connection, when nothing between here and it changes
    the body), events are written from the upstream connection's callback as they
    arrive: no message, coroutine or task switch per chunk. Whatever the client is not
    ready for goes through `send`, which waits for it, in order.

    A stream that breaks off (backend crash, idle timeout) before its end drops its torn
    last event and ends with the codec's error events (OpenAI's: one error event and
    `data: [DONE]`); nothing ever follows the end.
    """
    await send(start)
    if opening:
        await send({"type": "http.response.body", "body": opening, "more_body": True})
    meter = codec.meter
    status: int = start["status"]
    sink = None if direct is None else events.sink(direct)
    response.sink = sink
    try:
        # With a sink: only what it declined comes here, and what arrived before it was
        # set (a stream's first events come with its head), which it takes now if the
        # client is ready for it.
        while (chunk := await response.next_chunk()) is not None:
            response.sink = None
            if (sink is None or not sink(chunk)) and (data := events.take(chunk)):
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if not response.chunks:
                response.sink = sink
        if tail := events.close():
            await send({"type": "http.response.body", "body": tail, "more_body": True})
    except OSError as exc:
        # The torn event (`pending`) is dropped. A stream whose end went out is whole.
        if not events.done:
            error = upstream_failure(meter, backend_id, exc)
            status = error.status
            body = codec.fail(error)
            await send({"type": "http.response.body", "body": body, "more_body": True})
    finally:
        response.sink = None
    meter.finish()
    events.watch.finishing = True
    await send({"type": "http.response.body", "body": b""})
    return status


class _Events:
    """An SSE answer on its way out as it came, in whole events: the torn last one held
    back, each metered, `[DONE]` noted (`done`: after it, the client hanging up is not a
    cancel, S7, and a break is not an error)."""

    __slots__ = ("done", "meter", "pending", "watch")

    def __init__(self, meter: Meter, watch: DisconnectWatch) -> None:
        self.meter, self.watch = meter, watch
        self.pending = b""
        self.done = False

    def take(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes, metered; b"" if none."""
        data, self.pending = split_events(self.pending + chunk)
        if data:
            data = self.meter.chunk(data)
            if b"[DONE]" in data:
                self.done = self.watch.finishing = True
        return data

    def close(self) -> bytes:
        """The upstream ended: its last event, not closed by a blank line, metered."""
        pending = self.pending
        return self.meter.chunk(pending) if pending else b""

    def sink(self, direct: Direct) -> Callable[[bytes], bool]:
        """What takes the upstream's pieces in its callback: whole events written at once
        while the client keeps up (False, the piece queued for `send`, when it does not).
        Per chunk this is the hot path of every stream: its calls are bound once here."""
        writable, write, take, tee = (
            direct.out.writable,
            direct.out.write_more,
            self.take,
            direct.tee,
        )

        def sink(chunk: bytes) -> bool:
            if not writable():
                return False
            if data := take(chunk):
                if tee is not None:
                    tee(data)
                write(data)
            return True

        return sink


class _Translating(_Events):
    """A stream in the dialect's own shape: each whole upstream event metered, then
    translated by the codec; `done` once the codec says the answer is whole."""

    __slots__ = ("codec",)

    def __init__(self, codec: Codec, watch: DisconnectWatch) -> None:
        super().__init__(codec.meter, watch)
        self.codec = codec

    def take(self, chunk: bytes) -> bytes:
        data, self.pending = split_events(self.pending + chunk)
        if not data:
            return b""
        out = self.codec.events(self.meter.chunk(data))
        if not self.done and self.codec.done(out):
            self.done = self.watch.finishing = True  # whole: a client leaving now was served
        return out

    def close(self) -> bytes:
        if self.done:
            return b""
        pending = self.pending
        return self.codec.close(self.meter.chunk(pending) if pending else b"")


def upstream_error(status: int, answer: bytes, backend: str) -> ApiError:
    """The backend refused: its status and message (OpenAI or Anthropic shaped) carried on."""
    import orjson

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


# -- a dialect's request, once admitted ---------------------------------------------------


class Dialect(Protocol):
    """One client dialect's codec for one request (proxy/dialects/*.py): it read the
    inbound request (`inbound`), translates it for each backend tried (`upstream`), and
    gives the codec that translates the answer and renders errors and interruptions in
    its shape (`answer`). `error_event` ends a feedback stream opened early whose wait
    failed; `direct`: its streams pass on unchanged (the client's connection may be
    written to from the upstream's callback)."""

    inbound: Inbound
    direct: bool

    def upstream(self, route: Route) -> tuple[str, bytes]:
        """The path on the backend and the body to send it (afresh on each try)."""

    def answer(self, route: Route) -> Codec: ...

    def error_event(self, error: ApiError) -> bytes: ...


def answer_headers(admitted: Admitted) -> list[tuple[bytes, bytes]]:
    """What corrallm adds to every answer: the backend, the wait, a degraded route."""
    extra = [(b"x-corrallm-backend", admitted.route.id.encode())]
    extra.extend(admitted.waited.raw())
    if admitted.visit.degraded:
        extra.append((b"x-corrallm-degraded", b"true"))
    return extra


def serve(
    pipeline: Pipeline,
    dialect: Dialect,
    scope: Scope,
    receive: Receive,
    send: Send,
    form: StreamForm = SSE_FEEDBACK,
) -> Awaitable[None]:
    """A dialect's request through the pipeline and the relay: the work every dialect's
    request does once admitted, written once. `form`: how the dialect's streams are framed
    (SSE, or Ollama's NDJSON). (A plain function down to the pipeline's coroutine, as
    app.py explains: no `await` level of its own.)"""
    inbound = dialect.inbound
    # K4: a streamed request that waits is told why, on a stream opened early.
    feedback = StreamFeedback(send, dialect.error_event, form) if inbound.stream else None
    method: str = scope["method"]

    def work(admitted: Admitted) -> Awaitable[int]:
        # The relay's coroutine itself (no `await` level here): it records the meter.
        # Notes go out only while the request waits, which is over now: the answer goes
        # through the feedback stream only if a note opened it (most never wait), else
        # straight out, without a coroutine more per chunk.
        out = feedback.send if feedback is not None and feedback.opened else send
        route = admitted.route
        path, data = dialect.upstream(route)
        codec = dialect.answer(route)
        admitted.live.meter = codec.meter
        url = upstream_url(route.endpoint.base_url, path)
        return relay(
            pipeline.upstream,
            method,
            url,
            data,
            admitted.upstream_headers(scope["headers"], url, method),
            answer_headers(admitted),
            out,
            watch,
            route.id,
            codec,
            admitted.progress,
            pipeline.runtime.upstream_idle(route),
            direct,  # the feedback stream passes an SSE body on unchanged
            admitted.visit,
        )

    watch = DisconnectWatch(receive, scope)
    direct = direct_writer(scope) if inbound.stream and dialect.direct else None
    return pipeline.run_http(inbound, work, watch, feedback)


def forward(
    client: Client,
    scope: Scope,
    send: Send,
    url: str,
    body: bytes,
    headers: Headers,
    extra: list[tuple[bytes, bytes]],
    watch: DisconnectWatch,
    backend_id: str,
    progress: Progress | None = None,
    meter: Meter | None = None,
    *,
    idle_timeout: float | None = None,
    direct: Direct | None = None,
) -> Awaitable[int]:
    """`relay()` of an answer passed on as it came (`/upstream`'s side door)."""
    codec = AsSent(meter if meter is not None else Meter())
    return relay(
        client,
        scope["method"],
        url,
        body,
        headers,
        extra,
        send,
        watch,
        backend_id,
        codec,
        progress,
        idle_timeout,
        direct,
    )
