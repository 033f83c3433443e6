"""Request-head limits on uvicorn's httptools protocol: slow and oversized request heads.

uvicorn (0.54, httptools) holds a connection that trickles its request head forever and
buffers a head of any size. `GuardedProtocol` adds three limits, read once at startup
(`HeadLimits.from_env`, documented in docs/config.md "Limits on incoming connections"):

- **header timeout** (`CORRALLM_HEADER_TIMEOUT`, 10 s): a request head must be complete
  this long after the connection opened, or after its first byte on a keep-alive
  connection (the idle time between requests stays uvicorn's keep-alive timeout, 5 s).
  Past it the connection gets 408 (when it sent anything) and is closed.
- **head size** (`CORRALLM_MAX_HEADER_BYTES`, 64 KiB): request line and headers together.
  Past it: 431 with an OpenAI error body, our side shut, and the connection closed once
  the client stops sending (at most `LINGER_SECONDS`/`LINGER_BYTES` later), so the answer
  is read rather than lost to a reset.
- **pending heads** (`CORRALLM_MAX_PENDING_HEADS`, half the free file descriptors, at most
  1024): connections still sending a head. One more closes the oldest of them instead of
  refusing the newcomer, so a flood of slow clients never holds the descriptors a real
  client needs (`raise_fd_limit` first lifts the soft limit to the hard one).

Cost on the hot path: per read an int store and a bool test, per request one comparison
and a flag test, per connection one dict insert and delete. `HeadGuard` owns the pending
connections (oldest first) and one timer for the oldest deadline; it never logs per
connection, only a summary line at most every `REPORT_SECONDS`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("corrallm.http")

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PENDING_HEADS = 1024
MIN_PENDING_HEADS = 8
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20
REPORT_SECONDS = 10.0
# When /proc/self/fd cannot be read: assume this many descriptors are already in use.
ASSUMED_OPEN_FDS = 64


@dataclass(frozen=True)
class HeadLimits:
    timeout: float = DEFAULT_HEADER_TIMEOUT
    max_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_pending: int = DEFAULT_MAX_PENDING_HEADS

    @classmethod
    def from_env(cls, env: Mapping[str, str], fds_free: int) -> HeadLimits:
        """The limits from `CORRALLM_HEADER_TIMEOUT` (seconds), `CORRALLM_MAX_HEADER_BYTES`
        and `CORRALLM_MAX_PENDING_HEADS`; ValueError naming the variable when one is bad."""
        default_pending = max(MIN_PENDING_HEADS, min(DEFAULT_MAX_PENDING_HEADS, fds_free // 2))
        return cls(
            timeout=_number(env, "CORRALLM_HEADER_TIMEOUT", DEFAULT_HEADER_TIMEOUT, float),
            max_bytes=int(_number(env, "CORRALLM_MAX_HEADER_BYTES", DEFAULT_MAX_HEADER_BYTES, int)),
            max_pending=int(_number(env, "CORRALLM_MAX_PENDING_HEADS", default_pending, int)),
        )


def _number(env: Mapping[str, str], name: str, default: float, kind: type[float]) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {text!r}")
    return value


def raise_fd_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def fds_free(soft_limit: int) -> int:
    """Descriptors still free under `soft_limit`."""
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = ASSUMED_OPEN_FDS
    return max(0, soft_limit - used)


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over the limit."""


def _error_response(
    status: int, code: str, message: str, default_headers: list[tuple[bytes, bytes]]
) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = [STATUS_LINE[status]]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
        body,
    ]
    return b"".join(head)


class HeadGuard:
    """The connections still sending a request head, oldest first, with their deadlines.

    Insertion order is deadline order (the timeout is one constant, the loop clock is
    monotonic), so the oldest entry is both the next to expire and the one closed to make
    room. One timer, armed for the oldest deadline, sweeps the expired ones.
    """

    def __init__(self, limits: HeadLimits) -> None:
        self.limits = limits
        self._pending: dict[GuardedProtocol, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._report: asyncio.TimerHandle | None = None
        self.counts = {"timed out": 0, "closed for room": 0, "too large": 0}
        self._unreported = dict.fromkeys(self.counts, 0)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, conn: GuardedProtocol, loop: asyncio.AbstractEventLoop) -> None:
        pending = self._pending
        if len(pending) >= self.limits.max_pending:
            oldest = next(iter(pending))
            del pending[oldest]
            self.count("closed for room")
            oldest.head_expired()
        self._loop = loop
        pending[conn] = loop.time() + self.limits.timeout
        if self._timer is None:
            self._timer = loop.call_at(pending[next(iter(pending))], self._expire)

    def discard(self, conn: GuardedProtocol) -> None:
        self._pending.pop(conn, None)

    def _expire(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        expired = []
        for conn, deadline in self._pending.items():
            if deadline > now:
                break
            expired.append(conn)
        for conn in expired:
            del self._pending[conn]
            self.count("timed out")
            conn.head_expired()
        if self._pending:
            first = self._pending[next(iter(self._pending))]
            self._timer = self._loop.call_at(first, self._expire)

    def count(self, what: str) -> None:
        self.counts[what] += 1
        self._unreported[what] += 1
        if self._report is None and self._loop is not None:
            self._flush_report()

    def _flush_report(self) -> None:
        self._report = None
        if not any(self._unreported.values()):
            return
        parts = ", ".join(f"{n} {what}" for what, n in self._unreported.items() if n)
        log.warning(
            "request heads refused: %s (header timeout %gs, max %d bytes, %d pending heads; "
            "%d pending now)",
            parts,
            self.limits.timeout,
            self.limits.max_bytes,
            self.limits.max_pending,
            len(self._pending),
        )
        self._unreported = dict.fromkeys(self.counts, 0)
        assert self._loop is not None
        self._report = self._loop.call_later(REPORT_SECONDS, self._flush_report)


class _Linger(asyncio.Protocol):
    """After an error answer: our side shut, whatever the client still sends dropped, the
    connection closed when it stops or after LINGER_SECONDS/LINGER_BYTES (nginx's lingering
    close), so the client reads the answer instead of a reset."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.left = LINGER_BYTES
        self.timer = loop.call_later(LINGER_SECONDS, self.close)
        if transport.can_write_eof():
            transport.write_eof()

    def data_received(self, data: bytes) -> None:
        self.left -= len(data)
        if self.left < 0:
            self.close()

    def eof_received(self) -> bool:
        self.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.timer.cancel()

    def close(self) -> None:
        self.timer.cancel()
        self.transport.close()


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header timeout, head size and pending cap.

    The server uses it through `connection.ClientConnection`, bound to one server's
    `HeadGuard` by `connection.protocol_class(guard)`.
    """

    guard: ClassVar[HeadGuard]
    max_head: ClassVar[int]

    # Per connection; class defaults so that no __init__ runs per connection.
    _awaiting_head = False  # between a head's first byte (or the connection) and its end
    _timed = False  # in the guard's pending set
    _chunk = 0  # length of the read being parsed
    _head_first = 0  # length of the read in which the current head began
    _head_bytes = 0  # reads since the head began (the first one included)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._awaiting_head = True
        self._timed = True
        self.guard.add(self, self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timed:
            self._timed = False
            self.guard.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received, plus the head checks after the parser ran.
        self._unset_keepalive_if_required()
        self._chunk = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._refuse_head()
            else:
                self._bad_request()
            return
        except httptools.HttpParserError:
            self._bad_request()
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._awaiting_head:
            self._head_incomplete(len(data))

    def on_message_begin(self) -> None:
        _message_begin(self)
        self._awaiting_head = True
        self._head_first = self._chunk
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        # The head's bytes are at most the reads since it began plus this one: only a
        # head that might be over the limit is measured.
        if self._head_bytes + self._chunk > self.max_head and self._head_size() > self.max_head:
            raise _HeadTooLarge
        self._awaiting_head = False
        if self._timed:
            self._timed = False
            self.guard.discard(self)
        _headers_complete(self)

    def _head_size(self) -> int:
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _head_incomplete(self, length: int) -> None:
        self._head_bytes += length
        # Bytes certainly in this head: every read since the one in which it began.
        if self._head_bytes - self._head_first > self.max_head:
            self._refuse_head()
        elif not self._timed and self._idle():
            # A keep-alive request whose head spans reads: its deadline runs from here.
            self._timed = True
            self.guard.add(self, self.loop)

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def head_expired(self) -> None:
        """The guard's verdict: too slow, or the oldest when room was needed."""
        self._timed = False
        if self.transport.is_closing():
            return
        if self._chunk:
            message = (
                f"request head not complete within {self.guard.limits.timeout:g}s of the "
                "connection or of its first byte; send the whole head at once "
                "(CORRALLM_HEADER_TIMEOUT sets the limit)"
            )
            self.transport.write(self._error(408, "request_timeout", message))
        self.transport.close()

    def _refuse_head(self) -> None:
        self._awaiting_head = False
        if self._timed:
            self._timed = False
            self.guard.discard(self)
        self.guard.count("too large")
        self._unset_keepalive_if_required()
        if not self._idle():
            # A pipelined head behind a response still being sent: no room for an answer.
            self.transport.close()
            return
        message = (
            f"request head (request line and headers) over {self.max_head} bytes; send "
            "smaller headers (CORRALLM_MAX_HEADER_BYTES sets the limit)"
        )
        self.transport.write(self._error(431, "request_header_fields_too_large", message))
        self.connections.discard(self)
        self.flow.resume_reading()
        self.transport.set_protocol(_Linger(self.transport, self.loop))

    def _bad_request(self) -> None:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    def _error(self, status: int, code: str, message: str) -> bytes:
        return _error_response(status, code, message, self.server_state.default_headers)


_message_begin = HttpToolsProtocol.on_message_begin
_headers_complete = HttpToolsProtocol.on_headers_complete
