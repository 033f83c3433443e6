"""The few raw-ASGI helpers the hot path and every surface share (no framework
per-request machinery)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = b"application/json"
# Header pairs as they travel: bytes both ways, never decoded on the hot path.
Headers = list[tuple[bytes, bytes]]
# The scope key under which corrallm's own server puts the request's side of its
# connection (connection.py `LeanCycle`, a `Connection` here), for the hot path.
CONNECTION = "corrallm.connection"
_HEADER_INDEX = "corrallm.headers"  # `header()`'s index of the request's headers


class BodyWriter(Protocol):
    """Body pieces written without ASGI messages, from any callback."""

    def writable(self) -> bool:
        """Whether `write_more` may be called now (else `send`, which waits)."""
        ...

    def write_more(self, body: bytes) -> None: ...


class Connection(BodyWriter, Protocol):
    """The request's side of its connection (`scope[CONNECTION]`)."""

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        """Call `gone` when the client goes away; returns what stops watching."""
        ...

    def body_ready(self) -> bool:
        """Whether `receive()` would answer at once (body bytes, its end, or a
        disconnect are there): a body read needs no timer then."""
        ...


class ClientGone(Exception):
    pass


def header(scope: Scope, name: bytes) -> bytes | None:
    """The request's first `name` header (names as the server gives them: lowercase).

    A request's headers are looked up half a dozen times on the hot path (key, lane,
    body length...): the first lookup indexes them in the scope, each one after is a
    dict lookup instead of a scan of every header the client sent."""
    index: dict[bytes, bytes] | None = scope.get(_HEADER_INDEX)
    if index is None:
        index = scope[_HEADER_INDEX] = dict(reversed(scope["headers"]))  # the first wins
    return index.get(name)


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: dict[str, str] | None = None,
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw.extend((k.lower().encode(), v.encode()) for k, v in headers.items())
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
