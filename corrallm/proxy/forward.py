"""Forwarding one request upstream and streaming the answer back, chunk by chunk.

Nothing is buffered: each chunk the backend sends goes to the client as it comes. The
caller's identity headers are corrallm's business only and never leave it (SPEC §3).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

import aiohttp
import orjson

from corrallm.proxy.asgi import Receive, Scope, Send
from corrallm.proxy.client import Client
from corrallm.proxy.errors import bad_gateway
from corrallm.proxy.metering import Meter

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
_CALLER_IDENTITY = frozenset({b"authorization", b"x-corrallm-key", b"cookie"})
_DROP_REQUEST = _HOP_BY_HOP | _CALLER_IDENTITY
_DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"server", b"date"})


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


def request_headers(
    raw: Iterable[tuple[bytes, bytes]], extra: dict[str, str]
) -> list[tuple[str, str]]:
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k not in _DROP_REQUEST]
    if extra:
        names = {k.lower() for k in extra}
        out = [(k, v) for k, v in out if k not in names]
        out.extend(extra.items())
    return out


class DisconnectWatch:
    """Cancels the request's task when its client goes away (SPEC §6 S7).

    Cancelling drops the upstream connection, which is how the backend learns to stop.
    """

    def __init__(self, receive: Receive) -> None:
        self.client_gone = False
        self.finishing = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not self.finishing and self._task is not None:
            self.client_gone = True
            self._task.cancel()

    def close(self) -> None:
        self._watcher.cancel()

    def absorb(self) -> bool:
        """In an `except CancelledError`: True if the cancel was ours and is now spent."""
        task = asyncio.current_task()
        return self.client_gone and task is not None and task.uncancel() == 0


PREEMPTED_EVENT = (
    b"data: "
    + orjson.dumps(
        {
            "error": {
                "message": "Preempted: a higher-priority request took this slot. "
                "Retry to continue; the partial answer above is complete up to here.",
                "type": "preempted",
                "param": None,
                "code": "preempted",
            }
        }
    )
    + b"\n\ndata: [DONE]\n\n"
)


async def forward(
    client: Client,
    scope: Scope,
    send: Send,
    url: str,
    body: bytes,
    headers: list[tuple[str, str]],
    extra_response_headers: list[tuple[bytes, bytes]],
    watch: DisconnectWatch,
    backend_id: str,
    stream: Relay | None = None,
    meter: Meter | None = None,
) -> int:
    """Send the request upstream and relay the response; returns the upstream status."""
    try:
        response = await client.request(scope["method"], url, body, headers)
    except OSError as exc:
        raise bad_gateway(
            f"backend '{backend_id}' did not answer at {url}: {exc or type(exc).__name__}. "
            "Check that it is running and listening on its proxy address."
        ) from exc
    async with response:
        raw = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in _DROP_RESPONSE]
        raw.extend(extra_response_headers)
        sse = response.content_type == "text/event-stream"
        # Whole events: so that a preemption cuts at a boundary, and metering sees each one.
        whole_events = sse and (meter is not None or (stream is not None and stream.preemptible))
        if meter is not None:
            meter.start(response.status, sse, response.content_type == "application/json")
        if stream is not None:
            stream.started = True
            stream.shielded = not sse
        await send({"type": "http.response.start", "status": response.status, "headers": raw})
        last = b"\n\n"
        pending = b""
        try:
            async for chunk in response.iter_any():
                if whole_events:
                    chunk, pending = _split_events(pending + chunk)
                if meter is not None and chunk:
                    chunk = meter.chunk(chunk)
                if not chunk:
                    continue
                last = chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError as exc:
            if sse:
                tail = _stream_error(last, backend_id, exc)
                await send({"type": "http.response.body", "body": tail, "more_body": True})
        if pending:
            if meter is not None:
                pending = meter.chunk(pending)
            await send({"type": "http.response.body", "body": pending, "more_body": True})
        if meter is not None:
            meter.finish()
        watch.finishing = True
        await send({"type": "http.response.body", "body": b""})
        return response.status


def _split_events(data: bytes) -> tuple[bytes, bytes]:
    """Whole SSE events, and the partial one still arriving."""
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return b"", data
    return data[: cut + 2], data[cut + 2 :]


def _stream_error(last: bytes, backend_id: str, exc: BaseException) -> bytes:
    """End a broken stream the way clients understand: one error event, then [DONE]."""
    error = {
        "error": {
            "message": f"backend '{backend_id}' broke off the stream: {exc or type(exc).__name__}",
            "type": "api_error",
            "param": None,
            "code": "backend_error",
        }
    }
    # Close a torn event first so the error event parses on its own.
    prefix = b"" if last.endswith(b"\n\n") else b"\n\n"
    return prefix + b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"
