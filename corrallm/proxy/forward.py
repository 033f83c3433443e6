"""The plumbing of forwarding a request upstream: which headers go on and come back,
opening the upstream exchange, what a broken or silent backend means, and the watch on
the client's connection. The relaying itself is proxy/relay.py's.

The caller's identity headers are corrallm's business only and never leave it (SPEC §3).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from itertools import compress
from operator import itemgetter, not_
from typing import NamedTuple

import aiohttp
import orjson

from corrallm.http.asgi import CONNECTION, BodyWriter, Connection, Headers, Receive, Scope
from corrallm.http.client import Client, Response, UpstreamTimeout
from corrallm.http.errors import ApiError, bad_gateway, unavailable
from corrallm.observe.context import CURRENT
from corrallm.proxy.metering import Meter
from corrallm.scheduler.ticket import Interrupt, Stop

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
DROP_RESPONSE = frozenset(
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


def new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


def kept(headers: Sequence[tuple[bytes, bytes]], dropped: frozenset[bytes]) -> Headers:
    """`headers` less those named in `dropped`, in order. Every request passes its
    headers and its answer's through here: picked by C iterators, with no Python opcode
    per header (bench/opcodes.py)."""
    names = map(_NAME, headers)
    return list(compress(headers, map(not_, map(dropped.__contains__, names))))


_NAME = itemgetter(0)


def request_headers(raw: Sequence[tuple[bytes, bytes]], extra: dict[str, str]) -> Headers:
    """The client's headers for the backend (as they came, lowercased by the server), the
    hop-by-hop ones and the caller's identity left out, `extra` set over them."""
    out = kept(raw, _DROP_REQUEST)
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
        # The request's Stop once the pipeline holds it: the client leaving is then its
        # interrupt (CLIENT_GONE), recorded before the cancel.
        self.stop: Stop | None = None
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
            if self.stop is not None:
                self.stop.interrupt(Interrupt.CLIENT_GONE)
            else:
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
