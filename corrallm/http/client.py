"""The hot path's upstream HTTP/1.1 client: pooled keep-alive connections, the response
parsed by httptools (the parser uvicorn uses for the client side), its body handed on
chunk by chunk as it arrives.

aiohttp's client did the same job at several times the cost per request (a third of the
event loop's time under load, by py-spy); this one does only what forwarding needs: a
request with a known body, a streamed answer, a connection reused when the answer was
read whole and the server keeps it alive. aiohttp still serves the health probes and the
realtime WebSocket relay, where cost per request does not matter.

An idle timeout (`request(..., idle_timeout=)`) bounds the backend's silence while the
answer is awaited and between body chunks: one timer per exchange, pushed back by the
bytes that arrive, that fails the answer with `UpstreamTimeout` and closes the
connection (so the backend sees the cancel). Time the client spends not reading (paused
by backpressure) is not the backend's silence.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT = 10.0
KEEPALIVE_SECONDS = 60.0  # an idle pooled connection older than this is closed, not reused
HIGH_WATER = 1 << 20  # stop reading from the backend when the client is this far behind


class UpstreamError(ConnectionError):
    """The backend broke the exchange (closed early, sent something that is not HTTP)."""


class ServerDisconnected(UpstreamError):
    """The connection closed before any answer: safe to send again on a fresh one."""


class UpstreamTimeout(UpstreamError):
    """The backend sent nothing for `idle` seconds (before its headers or mid-body)."""

    def __init__(self, idle: float, headers_seen: bool) -> None:
        where = "mid-answer" if headers_seen else "before answering"
        super().__init__(f"no bytes from the backend for {idle:g}s {where}")
        self.idle = idle
        self.headers_seen = headers_seen


class Response:
    """One answer: status and headers once they are in, then `next_chunk()` (or
    `iter_any()`) for the body."""

    def __init__(self, conn: _Connection, head_only: bool) -> None:
        self._conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # as they came, names lowercased
        self._content_type = b""
        self.head_only = head_only
        self.headers_done: asyncio.Future[None] = conn.loop.create_future()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        # Takes body pieces as they arrive, in the connection's callback, instead of
        # `next_chunk()`; False when it cannot now (the piece is queued for `next_chunk()`).
        # Only while nothing is queued, so that pieces keep their order.
        self.sink: Callable[[bytes], bool] | None = None

    @property
    def content_type(self) -> str:
        if not self._content_type:
            return "application/octet-stream"
        return self._content_type.split(b";", 1)[0].strip().lower().decode("latin-1")

    async def next_chunk(self) -> bytes | None:
        """What of the body arrived since the last call, as one piece (at most HIGH_WATER
        and one read), or None at its end; raises what broke it. One piece, not each
        that the parser gave (a chunk of a chunked body, an SSE event as the backend
        wrote it): what came in one read is relayed in one write. (A coroutine rather
        than an async generator: no finalizer hook per answer.)"""
        while True:
            chunks = self.chunks
            if chunks:
                if len(chunks) == 1:
                    chunk = chunks.popleft()
                else:
                    chunk = b"".join(chunks)
                    chunks.clear()
                self.buffered = 0
                if self._conn.paused:
                    self._conn.resume()
                return chunk
            if self.complete or self.head_only:
                return None
            if self.error is not None:
                raise self.error
            self.waiter = self._conn.loop.create_future()
            await self.waiter

    async def iter_any(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._conn.finished(self)

    # -- fed by the connection -------------------------------------------------------

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        if self.error is not None:
            return  # the first failure is the cause (a timeout, then the close it made)
        self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # retrieved here; the request raises it
        self.wake()


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Client, key: tuple[str, str, int]) -> None:
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.lost = False
        self.paused = False
        self.idle_since = 0.0
        self.has_length = self.chunked = False  # how the answer's body is delimited
        self.keep_alive = False
        self.idle_timeout: float | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.last_read = 0.0

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.idle_timer is not None:
            self.last_read = self.loop.time()
        if self.response is None:
            self.close()  # bytes nobody asked for: the connection is not safe to reuse
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response.fail(UpstreamError(f"the backend's answer is not valid HTTP: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._disarm()
        response = self.response
        if response is None or response.complete or response.error is not None:
            return
        if not response.headers_done.done():
            response.fail(ServerDisconnected("the backend closed the connection before answering"))
        elif not self.has_length and not self.chunked:
            response.complete = True  # a body delimited by the connection's close
            response.wake()
        else:
            response.fail(UpstreamError("the backend closed the connection mid-answer"))

    # -- httptools callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        assert self.response is not None
        self.response.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        response.status = status
        # What the head says of its body, looked up once here rather than per header.
        first = dict(reversed(response.headers))
        response._content_type = first.get(b"content-type", b"")
        self.has_length = b"content-length" in first
        self.chunked = b"transfer-encoding" in first and any(
            b"chunked" in value.lower()
            for name, value in response.headers
            if name == b"transfer-encoding"
        )
        # Read now: llhttp forgets it once the message is complete.
        self.keep_alive = self.parser.should_keep_alive()
        response.headers_done.set_result(None)
        if response.head_only:
            response.complete = True

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        if response.sink is not None and not response.chunks and response.sink(body):
            return
        response.chunks.append(body)
        response.buffered += len(body)
        if response.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        response.wake()

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        if response.status == 0:
            return  # the end of an interim answer
        self._disarm()
        response.complete = True
        response.wake()

    # -- the pool's side -----------------------------------------------------------

    def send(self, response: Response, data: bytes, idle_timeout: float | None = None) -> None:
        assert self.transport is not None
        self.response = response
        self.idle_timeout = idle_timeout
        if idle_timeout is not None:
            self.last_read = self.loop.time()
            self.idle_timer = self.loop.call_at(self.last_read + idle_timeout, self._idle_check)
        self.transport.write(data)

    def _idle_check(self) -> None:
        """The idle timer fired: fail the answer if the backend really was silent that long."""
        self.idle_timer = None
        response, idle = self.response, self.idle_timeout
        if response is None or idle is None or response.complete or response.error is not None:
            return
        now = self.loop.time()
        if self.paused or response.chunks:
            self.last_read = now  # the client is behind, not the backend
        if now - self.last_read < idle:
            self.idle_timer = self.loop.call_at(self.last_read + idle, self._idle_check)
            return
        response.fail(UpstreamTimeout(idle, response.headers_done.done()))
        self.close()

    def _disarm(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    def finished(self, response: Response) -> None:
        """The caller is done with the answer: pool the connection if it can take more."""
        self._disarm()
        reusable = (
            response.complete and not response.head_only and not self.lost and self.keep_alive
        )
        self.response = None
        if reusable:
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class Client:
    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._targets: dict[str, tuple[tuple[str, str, int], bytes, bytes]] = {}

    async def request(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        idle_timeout: float | None = None,
    ) -> Response:
        """Send once, and once more on a fresh connection if a pooled one turned out to be
        closed (servers such as llama-server close keep-alive connections after a few
        requests; the pool learns it only when the next request fails before any answer,
        which is safe to resend). `idle_timeout`: the longest silence allowed from the
        backend, before its headers and between body chunks (`UpstreamTimeout`)."""
        key, host, path = self._target(url)
        head = b"".join(
            [
                method.encode("ascii"),
                b" ",
                path,
                b" HTTP/1.1\r\nHost: ",
                host,
                b"\r\nContent-Length: ",
                str(len(body)).encode("ascii"),
                b"\r\n",
                *(b"%s: %s\r\n" % header for header in headers),
                b"\r\n",
            ]
        )
        data = head + body
        head_only = method == "HEAD"
        conn = self._pooled(key)
        fresh = conn is None
        while True:  # one coroutine for the exchange: the hot path awaits it (app.py)
            if conn is None:
                conn = await self._connect(key)
            response = Response(conn, head_only)
            conn.send(response, data, idle_timeout)
            try:
                await response.headers_done
            except ServerDisconnected:
                conn.close()
                if fresh:
                    raise
                conn, fresh = None, True  # nothing came back: resend, once, on a fresh one
                continue
            except BaseException:
                conn.close()
                raise
            return response

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
        """(scheme, host, port), the Host header and the request target, parsed once."""
        known = self._targets.get(url)
        if known is None:
            parts = urlsplit(url)
            scheme = parts.scheme
            port = parts.port or (443 if scheme == "https" else 80)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            known = (
                (scheme, parts.hostname or "", port),
                parts.netloc.rsplit("@", 1)[-1].encode("ascii", "replace"),
                target.encode("latin-1"),
            )
            if len(self._targets) < 10_000:  # URLs are few: one per backend and path
                self._targets[url] = known
        return known

    def _pooled(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < KEEPALIVE_SECONDS:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context: Any = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), host, port, ssl=context),
                CONNECT_TIMEOUT,
            )
        except TimeoutError:
            raise ConnectionError(f"no connection within {CONNECT_TIMEOUT:g}s") from None
        return conn

    def put(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
