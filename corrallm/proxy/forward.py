"""Forwarding one request upstream and streaming the answer back, chunk by chunk.

Nothing is buffered: each chunk the backend sends goes to the client as it comes. The
caller's identity headers are corrallm's business only and never leave it (SPEC §3).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import aiohttp
import orjson

from corrallm.observe.context import CURRENT
from corrallm.proxy.asgi import (
    CONNECTION,
    BodyWriter,
    Connection,
    Headers,
    Message,
    Receive,
    Scope,
    Send,
)
from corrallm.proxy.client import Client, Response, UpstreamTimeout
from corrallm.proxy.errors import ApiError, bad_gateway, unavailable
from corrallm.proxy.metering import Meter, split_events

log = logging.getLogger("corrallm.proxy")

# Hop-by-hop headers (RFC 9110 §7.6.1) and those the client sets itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        # Bodies stay plain so that they can be metered; LLM servers seldom compress anyway.
        b"accept-encoding",
    }
)
# The caller's identity is corrallm's business only (SPEC §3); a lane is signed anew for
# each hop (X3), never passed on as a client sent it.
_CALLER_IDENTITY = frozenset(
    {
        b"authorization",
        b"x-corrallm-key",
        b"x-api-key",
        b"cookie",
        b"x-corrallm-lane",
        b"x-corrallm-lane-signature",
    }
)
_DROP_REQUEST = _HOP_BY_HOP | _CALLER_IDENTITY
# A peer's request id is its own (SPEC §21 O1): the client is told this gateway's. So are
# its backend and its waits (issue 30): the answer carries this gateway's one value of each.
_DROP_RESPONSE = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"server",
        b"date",
        b"x-corrallm-request-id",
        b"x-corrallm-backend",
        b"x-corrallm-queue-ms",
        b"x-corrallm-load-ms",
    }
)


class Relay(Protocol):
    """How far an answer has got, for safe preemption (S4); the admission `Ticket` is one.

    A preemptible SSE stream is relayed in whole events only, so a preemption (a cancel
    of the request's task) always leaves its client at an event boundary. A non-streaming
    answer, once begun, is shielded: it finishes and the preemption waits for it.
    """

    preemptible: bool
    started: bool
    shielded: bool


def new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


def request_headers(raw: Iterable[tuple[bytes, bytes]], extra: dict[str, str]) -> Headers:
    """The client's headers for the backend (as they came, lowercased by the server), the
    hop-by-hop ones and the caller's identity left out, `extra` set over them."""
    out = [(k, v) for k, v in raw if k not in _DROP_REQUEST]
    if extra:
        names = {k.lower().encode("latin-1") for k in extra}
        out = [(k, v) for k, v in out if k not in names]
        out.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())
    return out


class DisconnectWatch:
    """Cancels the request's task when its client goes away (SPEC §6 S7).

    Cancelling drops the upstream connection, which is how the backend learns to stop.
    corrallm's own server tells it from the connection (`connection.Connection.watch`,
    no task per request); any other ASGI server, by a task parked in `receive()`.
    """

    def __init__(self, receive: Receive, scope: Scope | None = None) -> None:
        self.client_gone = False
        self.finishing = False
        self._task = asyncio.current_task()
        self._watcher: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] | None = None
        connection: Connection | None = scope.get(CONNECTION) if scope is not None else None
        if connection is not None:
            self._unwatch = connection.watch(self._gone)
        else:
            self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        self._gone()

    def _gone(self) -> None:
        if not self.finishing and self._task is not None:
            self.client_gone = True
            self._task.cancel()

    def close(self) -> None:
        # Both are dropped, not only stopped: each holds this object (the hook through
        # `_gone`; the task through its traceback's frames), a cycle that only the
        # cyclic collector would free.
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        elif self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def absorb(self) -> bool:
        """In an `except CancelledError`: True if the cancel was ours and is now spent."""
        task = asyncio.current_task()
        return self.client_gone and task is not None and task.uncancel() == 0


class Direct(NamedTuple):
    """The client's connection, written to from the upstream connection's callback, and
    what else sees each piece: the request's capture (SPEC §21 O2), as the app's send
    wrapper would feed it."""

    out: BodyWriter
    tee: Callable[[bytes], None] | None


def direct_writer(scope: Scope) -> Direct | None:
    """The request's `Direct`, where its server offers one (corrallm's own does)."""
    out: BodyWriter | None = scope.get(CONNECTION)
    if out is None:
        return None
    exchange = CURRENT.get()
    capture = exchange.capture if exchange is not None else None
    return Direct(out, capture.body if capture is not None else None)


async def forward(
    client: Client,
    scope: Scope,
    send: Send,
    url: str,
    body: bytes,
    headers: Headers,
    extra_response_headers: list[tuple[bytes, bytes]],
    watch: DisconnectWatch,
    backend_id: str,
    stream: Relay | None = None,
    meter: Meter | None = None,
    *,
    idle_timeout: float | None = None,
    direct: Direct | None = None,
) -> int:
    """Send the request upstream and relay the response; returns the status to record.

    That is the upstream's status, unless the answer broke off after it began: then 502
    (the backend closed or crashed) or 504 (silent for `idle_timeout` seconds), with
    `meter.error` saying why. A failure before anything reached the client raises an
    `ApiError` (502 `backend_error` / 504 `upstream_timeout`) instead. `direct`: the
    client's connection, when `send` passes an SSE body on unchanged (`direct_writer`).
    """
    response = await open_upstream(
        client, scope["method"], url, body, headers, idle_timeout, backend_id, meter
    )
    async with response:
        raw = [(k, v) for k, v in response.headers if k not in _DROP_RESPONSE]
        raw.extend(extra_response_headers)
        content_type = response.content_type
        sse = content_type == "text/event-stream"
        if meter is not None:
            meter.start(response.status, sse, content_type == "application/json")
        if stream is not None:
            stream.started = True
            stream.shielded = not sse
        start = {"type": "http.response.start", "status": response.status, "headers": raw}
        if sse:
            # Only a 200 is relayed as it came; a feedback stream turns others into errors.
            writer = direct if response.status == 200 else None
            return await _relay_events(response, send, start, watch, backend_id, meter, writer)
        hold = HOLD_LIMIT if content_type == "application/json" else 0
        return await _relay_body(response, send, start, watch, backend_id, meter, hold)


# A JSON answer up to this size is held until it is whole, so that a backend dying or
# hanging partway through it becomes a clean 502/504 instead of a cut body. Such answers
# are written in one go after generation: holding them delays nothing, and saves a send.
HOLD_LIMIT = 1 << 20


async def _relay_body(
    response: Response,
    send: Send,
    start: Message,
    watch: DisconnectWatch,
    backend_id: str,
    meter: Meter | None,
    hold: int,
) -> int:
    """A plain body, chunk by chunk; the first `hold` bytes are sent only once whole.

    The headers go out with the first bytes (so a break before any is a clean error).
    A break after the headers went out cannot change the status: the connection is
    closed with the body cut short (never ended as if whole), and the failure recorded.
    """
    held: list[bytes] = []
    size = 0
    sent = False
    try:
        while (chunk := await response.next_chunk()) is not None:
            if meter is not None:
                chunk = meter.chunk(chunk)
            if not sent:
                held.append(chunk)
                size += len(chunk)
                if size <= hold:
                    continue
                await send(start)
                sent = True
                chunk = held[0] if len(held) == 1 else b"".join(held)
                held = []
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except OSError as exc:
        error = upstream_failure(meter, backend_id, exc)
        if not sent:
            raise error from None
        return error.status  # returning unfinished makes the server close the connection
    if meter is not None:
        meter.finish()
    watch.finishing = True
    if not sent:
        await send(start)
        await send({"type": "http.response.body", "body": b"".join(held)})
    else:
        await send({"type": "http.response.body", "body": b""})
    return int(response.status)


async def _relay_events(
    response: Response,
    send: Send,
    start: Message,
    watch: DisconnectWatch,
    backend_id: str,
    meter: Meter | None,
    direct: Direct | None = None,
) -> int:
    """An SSE stream in whole events: a preemption or a break always leaves the client at
    an event boundary, and metering sees each event whole.

    With `direct` (the client's connection, when nothing between here and it changes
    the body), events are written from the upstream connection's callback as they
    arrive: no message, coroutine or task switch per chunk. Whatever the client is not
    ready for goes through `send`, which waits for it, in order.

    A stream that breaks off (backend crash, idle timeout) drops its torn last event and
    ends with one error event and `data: [DONE]`; nothing ever follows `[DONE]`.
    """
    await send(start)
    status = int(response.status)
    events = _Events(meter, watch)
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
    except OSError as exc:
        # The torn event (`pending`) is dropped. A stream whose [DONE] went out is whole.
        if b"[DONE]" not in events.last:
            error = upstream_failure(meter, backend_id, exc)
            status = error.status
            await send(
                {"type": "http.response.body", "body": stream_error(error), "more_body": True}
            )
    else:
        if pending := events.pending:  # the last event, not closed by a blank line
            if meter is not None:
                pending = meter.chunk(pending)
            await send({"type": "http.response.body", "body": pending, "more_body": True})
    finally:
        response.sink = None
    if meter is not None:
        meter.finish()
    watch.finishing = True
    await send({"type": "http.response.body", "body": b""})
    return status


class _Events:
    """An SSE answer on its way out in whole events: the torn last one held back, each
    metered, `[DONE]` noted (after it, the client hanging up is not a cancel, S7)."""

    __slots__ = ("last", "meter", "pending", "watch")

    def __init__(self, meter: Meter | None, watch: DisconnectWatch) -> None:
        self.meter, self.watch = meter, watch
        self.pending = b""
        self.last = b""  # the last events sent

    def take(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes, metered; b"" if none."""
        data, self.pending = split_events(self.pending + chunk)
        if data and self.meter is not None:
            data = self.meter.chunk(data)
        if data:
            self.last = data
            if b"[DONE]" in data:
                self.watch.finishing = True
        return data

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


async def open_upstream(
    client: Client,
    method: str,
    url: str,
    body: bytes,
    headers: Headers,
    idle_timeout: float | None,
    backend_id: str,
    meter: Meter | None,
) -> Response:
    """Send the request and wait for the answer's head; a backend that does not answer
    is the caller's `ApiError` (502 `backend_error`, 504 `upstream_timeout`), every
    surface alike."""
    try:
        return await client.request(method, url, body, headers, idle_timeout)
    except UpstreamTimeout as exc:
        raise upstream_failure(meter, backend_id, exc) from None
    except OSError as exc:
        raise bad_gateway(
            f"backend '{backend_id}' did not answer at {url}: {exc or type(exc).__name__}. "
            "Check that it is running and listening on its proxy address."
        ) from exc


def upstream_failure(meter: Meter | None, backend_id: str, exc: BaseException) -> ApiError:
    """What a broken or silent backend means for the caller, logged once as its fault."""
    if isinstance(exc, UpstreamTimeout):
        where = "sending its answer" if exc.headers_seen else "answering"
        error = ApiError(
            504,
            f"backend '{backend_id}' sent nothing for {exc.idle:g}s while {where} "
            "(timeouts.upstreamIdle); it may be hung or overloaded. If it needs longer, "
            "raise timeouts.upstreamIdle at the top level or on this backend.",
            type="api_error",
            code="upstream_timeout",
        )
    elif "@" in backend_id:  # a peer's backend (<model>@<peer>): only peers have an '@'
        error = unavailable(
            f"the peer serving '{backend_id}' broke off its answer: "
            f"{exc or type(exc).__name__}. That node's own log (its GET "
            "/api/v1/models/logs) may say why; retry: other backends serve the model.",
            code="peer_down",
        )
    else:
        error = bad_gateway(
            f"backend '{backend_id}' broke off its answer: {exc or type(exc).__name__}. "
            "Its log (GET /api/v1/models/logs) may say why."
        )
    if meter is not None:
        meter.fail(error.status, f"{error.code}: {error.message}")
    log.warning("backend %s failed mid-request (%s): %s", backend_id, error.code, exc)
    return error


def stream_error(error: ApiError) -> bytes:
    """End a broken stream the way clients understand: one error event, then [DONE]."""
    return b"data: " + orjson.dumps(error.body()) + b"\n\ndata: [DONE]\n\n"
