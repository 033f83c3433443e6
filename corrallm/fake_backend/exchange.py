"""One HTTP request/response on raw ASGI: body reading, sends, and disconnect watching."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]


class FakeExchange:
    """A request being answered. `gone()` turns true once the client has disconnected."""

    __slots__ = ("_json", "body", "finished", "receive", "scope", "send", "status", "watch")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.body = b""
        self.status = 0
        self.finished = False
        self.watch: asyncio.Task[None] | None = None
        self._json: Any = ...

    async def read_body(self) -> None:
        chunks = []
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ConnectionError("client disconnected while sending its body")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.body = b"".join(chunks)

    def json(self) -> Any:
        """The parsed body; raises ValueError (orjson.JSONDecodeError) when malformed."""
        if self._json is ...:
            self._json = orjson.loads(self.body) if self.body else None
        return self._json

    def query(self) -> dict[str, list[str]]:
        """The query string's parameters, each with every value it was given."""
        return parse_qs(self.scope["query_string"].decode("latin-1"))

    def json_or_none(self) -> Any:
        try:
            return self.json()
        except ValueError:
            return None

    # --- disconnects -------------------------------------------------------------------------

    def watch_disconnect(self) -> None:
        """Start noticing `http.disconnect` (needed before any waiting)."""
        if self.watch is None:
            self.watch = asyncio.ensure_future(self._wait_disconnect())

    async def _wait_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass

    def gone(self) -> bool:
        return self.watch is not None and self.watch.done() and not self.finished

    async def pause(self, seconds: float) -> bool:
        """Wait `seconds` or until the client leaves; True when it left."""
        if seconds > 0:
            self.watch_disconnect()
            assert self.watch is not None
            await asyncio.wait((self.watch,), timeout=seconds)
        return self.gone()

    async def until_gone(self) -> None:
        """Wait, answering nothing, until the client leaves."""
        self.watch_disconnect()
        assert self.watch is not None
        await asyncio.wait((self.watch,))

    def close(self) -> None:
        if self.watch is not None and not self.watch.done():
            self.watch.cancel()

    # --- sending -----------------------------------------------------------------------------

    async def respond(
        self,
        status: int,
        body: bytes,
        content_type: bytes = JSON,
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.status = status
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", b"%d" % len(body)),
                    *extra,
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": body})
        self.finished = True

    async def start_body(self, status: int, length: int, content_type: bytes = JSON) -> None:
        """Headers for a body of `length` bytes, to be sent with `write` (faults use it)."""
        self.status = status
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % length)]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def start_stream(self, headers: list[tuple[bytes, bytes]] = SSE_HEADERS) -> None:
        self.status = 200
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})

    async def write(self, data: bytes) -> bool:
        """Send one chunk (flushed to the socket at once); False when the client is gone."""
        if self.gone():
            return False
        try:
            await self.send({"type": "http.response.body", "body": data, "more_body": True})
        except OSError:
            return False
        return True

    async def end_stream(self) -> bool:
        if self.gone():
            return False
        await self.send({"type": "http.response.body", "body": b""})
        self.finished = True
        return True


Handler = Callable[[FakeExchange, bool], Awaitable[None]]  # (exchange, inject the faults)
Route = tuple[str, Handler]  # (method, handler)
