"""`/upstream/<model>/<path>` (SPEC §3, §22 T5): straight to a backend's own API or web UI.

It is a side door, so it is shut by default: only an operator (the admin token, as for
`/api`) may use it, untracked. With `upstream: {access: keys}` callers may use it too,
and then it is a codec on the one pipeline like any /v1 surface (key, allowlist, pause,
spend, a slot while it runs, an activity row with endpoint `/upstream`, metrics). Either
way the backend's configured `headers` (often its API key) are added only behind those
gates, and every answer is sandboxed: `Content-Security-Policy: sandbox` and no
`Set-Cookie`, so a backend's page cannot run script as the dashboard's origin or set a
cookie there.

The path goes on as the client sent it (still percent-encoded), query string and all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from corrallm.http.asgi import Message, Receive, Scope, Send
from corrallm.http.errors import not_found
from corrallm.lifecycle.addresses import origin
from corrallm.proxy.forward import DisconnectWatch, request_headers
from corrallm.proxy.pipeline import Admitted, Inbound, Pipeline, caller_key, ready
from corrallm.proxy.relay import forward
from corrallm.routing.router import Route

ENDPOINT = "/upstream"  # what its activity rows say (never the caller's own path)
PREFIX = b"/upstream/"
CSP = (b"content-security-policy", b"sandbox")
# A backend's answer may set cookies on corrallm's origin, the dashboard's: never passed.
_DROPPED = frozenset({b"set-cookie", b"set-cookie2", b"content-security-policy"})


def sandboxed(send: Send) -> Send:
    """`send` with every answer's head sandboxed: CSP `sandbox` set, cookies dropped."""

    def out(message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in _DROPPED]
            headers.append(CSP)
            message = {**message, "headers": headers}
        return send(message)

    return out


def target(scope: Scope) -> tuple[str, str]:
    """(model, the rest of the path with its query string) of an /upstream request."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
    model, _, path = raw_path[len(PREFIX) :].partition(b"/")
    if not model:
        raise not_found("Use /upstream/<model>/<path> to reach a backend's own API or web UI.")
    rest = "/" + path.decode("latin-1")
    query: bytes = scope.get("query_string", b"")
    if query:
        rest += "?" + query.decode("latin-1")
    return model.decode("latin-1"), rest


def _url(route: Route, rest: str) -> str:
    return origin(route.endpoint.base_url) + rest


def _extra(route: Route) -> list[tuple[bytes, bytes]]:
    return [(b"x-corrallm-backend", route.id.encode())]


async def operator(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> None:
    """The admin's way (the app checked the token): the model's primary backend, loaded if
    needed, untracked (it holds no slot and never delays a drain)."""
    model, rest = target(scope)
    route = pipeline.lookup(model).tiers_for(None)[0][0]
    watch = DisconnectWatch(receive, scope)
    try:
        await ready(route)
        await forward(
            pipeline.upstream,
            scope,
            send,
            _url(route, rest),
            body,
            request_headers(scope["headers"], route.config.headers),
            _extra(route),
            watch,
            route.id,
            idle_timeout=pipeline.runtime.upstream_idle(route),
        )
    except asyncio.CancelledError:
        if watch.absorb():
            return
        raise
    finally:
        watch.close()


def keyed(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> Awaitable[None]:
    """`upstream.access: keys`: a caller's request through the pipeline's gates, holding a
    slot while it runs and recorded as endpoint `/upstream`."""
    model, rest = target(scope)
    inbound = Inbound(model, ENDPOINT, caller_key(scope), len(body))

    async def work(admitted: Admitted) -> int:
        route = admitted.route
        # Raw bytes that corrallm cannot end at a boundary: a preemption waits for it.
        admitted.progress.begin()
        url = _url(route, rest)
        return await forward(
            pipeline.upstream,
            scope,
            send,
            url,
            body,
            admitted.upstream_headers(scope["headers"], url, scope["method"]),
            _extra(route),
            watch,
            route.id,
            idle_timeout=pipeline.runtime.upstream_idle(route),
        )

    watch = DisconnectWatch(receive, scope)
    return pipeline.run_http(inbound, work, watch)
