"""The gateway's HTTP/1.1 connection: uvicorn's httptools protocol with the request-head
limits (head_guard.py), a disconnect hook and a leaner response writer.

What it adds is for the hot path (SPEC §13, bench/overhead.py):

- **Disconnect hook.** A request being answered must learn at once that its client went
  away (SPEC §6 S7). Through plain ASGI that takes a task per request parked in
  `receive()`: a task created, cancelled and collected for every request, whose
  reference cycle (task, coroutine, traceback) was nearly all of the garbage the cyclic
  collector found on the hot path. The request's cycle, found in its scope under
  `CONNECTION`, offers `watch(callback)` instead: the callback runs in
  `connection_lost`, with no task. Servers without it (tests driving the app in
  process) fall back to the task (proxy/forward.py `DisconnectWatch`).
- **Writes without messages.** `writable()` and `write_more(body)` let the stream relay
  (proxy/forward.py) write a body piece from the upstream connection's callback, with
  no ASGI message, coroutine or task switch per chunk.
- **Lean responses.** uvicorn checks each response header with two regular-expression
  searches and writes the head and the body in separate `write()`s: two syscalls, two
  segments for a small answer. `LeanCycle` checks the names and the values in one
  search each, and holds a head that announces a `content-length` until the body's first
  bytes (or the end of the event-loop turn), so that head and body leave in one write.
  Everything else (HEAD, chunked framing, keep-alive, the length checks, flow control)
  is uvicorn's behaviour, unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from itertools import chain, compress, repeat
from operator import itemgetter, methodcaller
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from corrallm.http.asgi import CONNECTION
from corrallm.http.head_guard import GuardedProtocol, HeadGuard

_NAME, _VALUE, _LOWER = itemgetter(0), itemgetter(1), methodcaller("lower")
_COLON, _CRLF = repeat(b": "), repeat(b"\r\n")
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})
# The bytes uvicorn's HEADER_RE and HEADER_VALUE_RE refuse, for `bytes.translate` to
# delete: a head holds one iff deleting them shortens it. A table lookup a byte, where
# the expressions' character class costs a call a byte (a tenth of the time).
_BAD_NAME = bytes(b for b in range(256) if HEADER_RE.match(bytes([b])))
_BAD_VALUE = bytes(b for b in range(256) if HEADER_VALUE_RE.match(bytes([b])))


class LeanCycle(RequestResponseCycle):
    """uvicorn's request/response cycle with a cheaper response head and one write for
    a head and its body (see the module's docstring)."""

    _head = b""  # a head held for the body's first bytes

    _watchers: list[Callable[[], None]]  # the connection's, shared by its cycles

    async def send(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected 'http.response.start', but got '{kind}'.")
            self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected '{kind}' after the response completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected 'http.response.body', but got '{kind}'.")
        self._body(message.get("body", b""), message.get("more_body", False))

    # -- what the hot path calls without ASGI messages (proxy/forward.py) --------------

    def writable(self) -> bool:
        """Whether `write_more` may be called now: the answer begun and not over, the
        client there and keeping up (else `send`, which waits for it)."""
        return (
            self.response_started
            and not self.response_complete
            and not self.disconnected
            and not self.flow.write_paused
        )

    def write_more(self, body: bytes) -> None:
        """`send` of a body piece with more to come, for a caller that checked
        `writable()`: no message, no coroutine."""
        if self.chunked_encoding and not self._head and self.scope["method"] != "HEAD":
            self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))  # a stream's piece
        else:
            self._body(body, True)

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        """Call `gone` when the client goes away; returns what stops watching. Reading
        resumes, as a request parked in `receive()` would make it (a paused transport
        would never see the client's close)."""
        if self.disconnected:  # gone already, before anyone watched
            gone()
            return lambda: None
        watchers = self._watchers
        watchers.append(gone)
        self.flow.resume_reading()

        def unwatch() -> None:
            if gone in watchers:
                watchers.remove(gone)

        return unwatch

    def body_ready(self) -> bool:
        """Whether `receive()` would answer at once: body bytes or the body's end are
        buffered (uvicorn sets the event for either), or the client is gone."""
        return self.message_event.is_set() or self.disconnected or self.response_complete

    # -- the writing -----------------------------------------------------------------

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
            data = b""
        elif self.chunked_encoding:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            data = body
        if self._head:
            data, self._head = self._head + data, b""
        if data:
            self.transport.write(data)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.scope.pop(CONNECTION, None)  # type: ignore[misc]  # scope and cycle held each other
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    def _start(self, status: int, extra: Any) -> None:
        self.response_started = True
        self.waiting_for_100_continue = False
        headers = [*self.default_headers, *extra]
        # The head written and its framing headers picked out by C iterators: no Python
        # opcode per header (a dozen on most answers; bench/opcodes.py).
        names = [*map(_LOWER, map(_NAME, headers))]
        values = [*map(_VALUE, headers)]
        # uvicorn's checks, once over all names and once over all values: joining adds
        # no byte either looks for, and lowering a name neither adds nor removes one.
        joined = b"".join(names)
        if len(joined.translate(None, _BAD_NAME)) != len(joined):
            raise RuntimeError("Invalid HTTP header name.")
        joined = b"".join(values)
        if len(joined.translate(None, _BAD_VALUE)) != len(joined):
            raise RuntimeError("Invalid HTTP header value.")
        lines = zip(names, _COLON, values, _CRLF, strict=False)  # the separators repeat
        content = [STATUS_LINE[status], *chain.from_iterable(lines)]
        has_connection_close = False
        framing = map(_FRAMING.__contains__, names)
        for name, value in compress(zip(names, values, strict=True), framing):
            if name == b"content-length":
                if self.chunked_encoding is None:
                    self.expected_content_length = int(value.decode())
                    self.chunked_encoding = False
            elif name == b"transfer-encoding":
                if value.lower() == b"chunked":
                    self.expected_content_length = 0
                    self.chunked_encoding = True
            else:  # connection
                tokens = [token.lower().strip() for token in value.split(b",")]
                if b"close" in tokens:
                    self.keep_alive = False
                    has_connection_close = True
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status not in (204, 304)
        ):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        head = b"".join(content)
        if self.chunked_encoding is False and self.expected_content_length:
            # A body of known length follows, nearly always in the same turn of the loop.
            self._head = head
            asyncio.get_running_loop().call_soon(self._flush_head)
        else:
            self.transport.write(head)

    def _flush_head(self) -> None:
        """The turn ended without the body: the head goes alone."""
        if self._head:
            head, self._head = self._head, b""
            if not self.disconnected and not self.transport.is_closing():
                self.transport.write(head)


class ClientConnection(GuardedProtocol):
    """One client connection: the head limits, the lean cycle with its disconnect hook."""

    _watchers: list[Callable[[], None]] | None = None  # per connection, made on first use

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and type(cycle) is RequestResponseCycle and cycle.scope is self.scope:
            # uvicorn builds the cycle itself; the subclass changes only how it writes.
            cycle.__class__ = LeanCycle
            if self._watchers is None:
                self._watchers = []
            cycle._watchers = self._watchers  # type: ignore[attr-defined]
            self.scope[CONNECTION] = cycle  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for cycle in (self.cycle, *(queued for queued, _ in self.pipeline)):
            if cycle is not None:
                cycle.scope.pop(CONNECTION, None)  # type: ignore[misc]
        watchers, self._watchers = self._watchers, None
        for gone in watchers or ():
            gone()


def protocol_class(guard: HeadGuard) -> type[ClientConnection]:
    """A `Connection` subclass bound to `guard`, for `uvicorn.Config(http=...)` (which
    takes a class and makes one per connection)."""

    class CorrallmHttpProtocol(ClientConnection):
        pass

    CorrallmHttpProtocol.guard = guard
    CorrallmHttpProtocol.max_head = guard.limits.max_bytes
    return CorrallmHttpProtocol
