"""Feedback while waiting (SPEC §16 K4): a streamed request that waits for a cold start or
in a queue gets its response headers early and an SSE comment line every so often, so
chat UIs show why they wait and idle-timeout proxies keep the stream open.

The pipeline says *when* and *what* (`Waiting.comment`); `StreamFeedback` is how a
streaming surface says it: it opens the stream (200, its `StreamForm`'s content type) with
the first note, then relays the admitted backend's answer through `send` as if it had
opened it itself. If the answer turns out not to be a stream (an upstream error), or the
wait fails, the stream ends with the surface's error event (OpenAI's: the error as one
`data:` event and `data: [DONE]`).

An SSE stream's note is a comment line (`SSE_FEEDBACK`); a surface whose stream has no comments
(Ollama's NDJSON, SPEC §23 E1) writes its own kind of line (`StreamForm.note`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import orjson

from corrallm.config.schema import Config, Feedback
from corrallm.http.asgi import Message, Send
from corrallm.http.errors import ApiError
from corrallm.routing.router import Route

if TYPE_CHECKING:
    from corrallm.proxy.runtime import Queues

T = TypeVar("T")

SSE_TYPE = b"text/event-stream"
# Besides the content type: what every stream opened early carries.
_STREAM_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer what is meant to trickle
]
WAITED = (b"x-corrallm-queue-ms", b"x-corrallm-load-ms")


@dataclass(slots=True)
class Waited:
    """How long a request waited, in ms: for a slot, and for its backend to be ready."""

    queue_ms: float = 0.0
    load_ms: float = 0.0

    def raw(self) -> list[tuple[bytes, bytes]]:
        """`X-Corrallm-Queue-Ms` and `X-Corrallm-Load-Ms`, on every answer (K4), as its
        head carries them."""
        if not self.queue_ms and not self.load_ms:  # most answers: no wait to format
            return [(WAITED[0], b"0"), (WAITED[1], b"0")]
        return [(WAITED[0], b"%d" % round(self.queue_ms)), (WAITED[1], b"%d" % round(self.load_ms))]

    def headers(self) -> dict[str, str]:
        """`raw()` as an `ApiError`'s headers."""
        return {name.decode(): value.decode() for name, value in self.raw()}


class Waiting(Protocol):
    """Where the pipeline tells a waiting client why it waits, and how long it has so far."""

    async def comment(self, text: str, waited: Waited) -> None: ...


class Narrator:
    """Comments for one waiting request, `after` seconds from its arrival, then every
    `every` seconds, across the phases it waits in (queued, then loading)."""

    def __init__(self, waiting: Waiting, settings: Feedback, arrived: float) -> None:
        self.waiting, self.settings = waiting, settings
        self._next = arrived + settings.after

    async def over(
        self, waited: Awaitable[T], describe: Callable[[], str], so_far: Callable[[], Waited]
    ) -> T:
        """`await waited`, saying `describe()` when it is time; stopped before the caller
        goes on, so that no comment is ever sent beside the answer. The comments' task is
        made only once the first is due: most requests never wait that long, and a task
        per stream (made, cancelled, waited for) was most of what a wait cost."""
        loop = asyncio.get_running_loop()
        ticker: asyncio.Task[None] | None = None

        def start() -> None:
            nonlocal ticker
            ticker = loop.create_task(self._tick(describe, so_far))

        timer = loop.call_later(max(0.0, self._next - time.monotonic()), start)
        try:
            return await waited
        finally:
            timer.cancel()
            if ticker is not None:
                ticker.cancel()
                await asyncio.wait({ticker})

    async def _tick(self, describe: Callable[[], str], waited: Callable[[], Waited]) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._next - time.monotonic()))
            self._next = time.monotonic() + self.settings.every
            await self.waiting.comment(describe(), waited())


def sse_comment(text: str) -> bytes:
    """A note to a waiting SSE client: a comment line, which every SSE parser skips."""
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class StreamForm:
    """How a surface's streams are framed, for what is written before its backend answers:
    their content type, and how a note to a waiting client is written (K4)."""

    content_type: bytes
    note: Callable[[str], bytes]


SSE_FEEDBACK = StreamForm(SSE_TYPE, sse_comment)


def openai_error_event(error: ApiError) -> bytes:
    """How an OpenAI stream ends in an error: the error object as data, then [DONE]."""
    return b"data: " + orjson.dumps(error.body()) + b"\n\ndata: [DONE]\n\n"


class QueueNote:
    """What a queued client is told (K4): its place by arrival among those waiting for
    the backend, and when a slot is expected (the measured average dwell). `since`: when
    the request joined a queue (None while it has not: admitted at once, it waited 0 ms
    for a slot, however long the admission's own work took on a busy machine)."""

    since: float | None = None

    def __init__(self, core: Queues, backend: str, request_id: int | None = None) -> None:
        self.core, self.backend, self.request_id = core, backend, request_id
        if request_id is not None:  # a note for a request queued already (requeued, S4)
            self.since = time.monotonic()

    def queued(self, request_id: int) -> None:
        self.request_id = request_id
        self.since = time.monotonic()

    def __call__(self) -> str:
        place = None if self.request_id is None else self.core.position(self.request_id)
        backend, position, waiting = place or (self.backend, None, self.core.load(self.backend)[2])
        eta = self.core.retry_after(backend)
        where = f"position {position} of {waiting}" if position else f"{waiting} waiting"
        return f"corrallm queued: {where} for {backend}, ~{eta:.0f}s"


def load_note(route: Route, config: Config) -> Callable[[], str]:
    """What a client waiting on a cold start is told (K4): how long so far, of how long
    expected (the backend's last measured load, else `swap.loadSeconds`)."""
    began = time.monotonic()

    def note() -> str:  # worked out only when said: most requests never wait this long
        server = route.config.server or next(iter(config.servers), None)
        where = f" on {server}" if server else ""
        measured = getattr(route.endpoint, "last_load_seconds", None)
        expected = measured if measured is not None else route.config.swap.load_seconds
        of = f"~{expected:.0f}s expected" if expected else "unknown time expected"
        return f"corrallm loading {route.model}{where}: {time.monotonic() - began:.0f}s of {of}"

    return note


class StreamFeedback:
    """A streamed answer whose headers may go out before the backend is reached; `error_event`
    is how the surface's streams end in an error (OpenAI's by default), `form` how they are
    framed (SSE by default)."""

    def __init__(
        self,
        send: Send,
        error_event: Callable[[ApiError], bytes] = openai_error_event,
        form: StreamForm = SSE_FEEDBACK,
    ) -> None:
        self._send = send
        self._error_event = error_event
        self._form = form
        self.opened = False  # our headers went out: the backend's must not
        self._status = 200
        self._streamed = True
        self._held: list[bytes] = []

    async def comment(self, text: str, waited: Waited) -> None:
        if not self.opened:
            self.opened = True
            # The wait so far; its total follows as a note once it is over.
            so_far = waited.raw()
            headers = [(b"content-type", self._form.content_type), *_STREAM_HEADERS, *so_far]
            await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        line = self._form.note(text)
        await self._send({"type": "http.response.body", "body": line, "more_body": True})

    async def send(self, message: Message) -> None:
        """The backend's answer, through a stream this may have opened already."""
        if not self.opened:
            await self._send(message)
        elif message["type"] == "http.response.start":
            self._status = message["status"]
            self._streamed = _is_stream(message["headers"], self._form.content_type)
            waited = {k: v for k, v in message["headers"] if k in WAITED}
            if waited:  # the headers went out before the wait was over: say it here
                queue = waited.get(b"x-corrallm-queue-ms", b"0").decode()
                load = waited.get(b"x-corrallm-load-ms", b"0").decode()
                note = f"corrallm waited queue={queue}ms load={load}ms"
                body = self._form.note(note)
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
        elif self._status == 200 and self._streamed:
            await self._send(message)
        else:  # not a stream after all: the backend's answer becomes one error event
            self._held.append(message.get("body", b""))
            if not message.get("more_body", False):
                await self.fail(_as_error(self._status, b"".join(self._held)))

    async def fail(self, error: ApiError) -> None:
        """The wait failed after the stream was opened: it ends with the error event."""
        await self._send({"type": "http.response.body", "body": self._error_event(error)})


def _is_stream(headers: list[tuple[bytes, bytes]], kind: bytes) -> bool:
    return any(k == b"content-type" and v.startswith(kind) for k, v in headers)


def _as_error(status: int, body: bytes) -> ApiError:
    """The backend's non-stream answer as an error (its own words if it sent an error)."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        answer = None
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        code = error.get("code")
        return ApiError(
            status, error["message"], code if isinstance(code, str) else "backend_error"
        )
    text = body[:500].decode("utf-8", "replace")
    return ApiError(
        502 if status < 400 else status,
        f"the backend answered {status} instead of a stream: {text}",
        "backend_error",
    )
