"""What a worker does not serve itself goes up to the owner: the management API, the
dashboard, /metrics, /health, /v1/models, reservations, /upstream... — every path but the
pipeline's surfaces, and a request another gateway forwarded (worker.py's `_forwarded`)
— relayed as it came to the owner's full app, which listens on a Unix
socket (its folder only this user may open).

Relayed rather than served from a copy: those answers read the owner's state (the live
list, residency, the store, the metrics every worker's requests were settled into), and
are not the hot path. The answer's body is passed on chunk by chunk (the events streams,
a forwarded stream); a client that leaves closes the request to the owner at once, so
that the owner sees it gone (its slot freed, its upstream request dropped) as it would
have seen it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp

from corrallm.http.asgi import Receive, Scope, Send
from corrallm.http.errors import unavailable

log = logging.getLogger("corrallm.workers")

# Hop-by-hop, or set by this worker's server itself.
_DROPPED = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"date", b"server"}
)


class Upward:
    def __init__(self, path: str) -> None:
        self.path = path
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.path),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request goes up as it comes: its head at once, its body streamed after it,
        so that the owner judges the head first (T5: a key refused before a body byte
        is read) and applies its own body limits."""
        raw: bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
        query: bytes = scope.get("query_string", b"")
        url = "http://owner" + raw.decode("latin-1") + ("?" + query.decode() if query else "")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.lower() not in _DROPPED
        ]
        sized = any(
            (k == b"content-length" and v.strip() != b"0") or k == b"transfer-encoding"
            for k, v in scope["headers"]
        )
        body = _Body(receive) if sized else None
        try:
            answer = await self.session().request(
                scope["method"],
                url,
                data=body.chunks() if body is not None else None,
                headers=headers,
                allow_redirects=False,
                # The body only once the owner asks for it (it reads it): a request it
                # refuses from its head is answered without the body ever going up.
                expect100=sized,
            )
        except aiohttp.ClientError as exc:
            log.warning("the owner did not answer %s %s: %s", scope["method"], scope["path"], exc)
            await unavailable(
                "This gateway's owner process did not answer; retry in a moment.",
                code="owner_unavailable",
            ).send(send)
            return
        async with answer:
            await send(
                {
                    "type": "http.response.start",
                    "status": answer.status,
                    "headers": [
                        (k, v)
                        for k, v in answer.raw_headers
                        if k.lower() not in _DROPPED or _closing(k, v)
                    ],
                }
            )
            copy = asyncio.ensure_future(_copy(answer, send))
            # Once the body is read, `receive` says only one thing more: the client left.
            # (A body the owner answered before reading it all is not watched: its
            # answer is a refusal, short.)
            gone = asyncio.ensure_future(_gone(receive)) if body is None or body.read else None
            try:
                await asyncio.wait(
                    {copy} if gone is None else {copy, gone}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                if gone is not None:
                    gone.cancel()
                if not copy.done():  # the client left (or this relay was cancelled)
                    copy.cancel()
                    answer.close()  # the owner sees its client gone
                    with contextlib.suppress(asyncio.CancelledError):
                        await copy
            if not copy.cancelled():
                copy.result()  # (an error while copying is raised here)


async def _copy(answer: aiohttp.ClientResponse, send: Send) -> None:
    async for chunk in answer.content.iter_any():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Body:
    """The request's body, streamed up as it comes; `read` once it is all read."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.read = False

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            message = await self.receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                self.read = True
                return


def _closing(name: bytes, value: bytes) -> bool:
    """`connection: close` goes on: the owner ended the exchange (a body that stalled, T5)
    and this worker's server then closes the client's connection too."""
    return name.lower() == b"connection" and value.strip().lower() == b"close"
