"""The inference endpoints: chat, completions, embeddings, rerank (SPEC §3, §4, §8).

The hot path: read the body once, parse it once, look the model up in a prebuilt table,
wait for a slot and a ready backend, forward. No blocking I/O, no config parsing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from corrallm.cost.ledger import Visit
from corrallm.gateway import Caller, Gateway
from corrallm.lifecycle.addresses import origin, upstream_url
from corrallm.lifecycle.errors import BackendFailed, BackendPaused, BackendRetired
from corrallm.lifecycle.supervisor import Cause
from corrallm.proxy.asgi import Receive, Scope, Send, header
from corrallm.proxy.errors import ApiError, bad_gateway, bad_request, not_found, unavailable
from corrallm.proxy.forward import PREEMPTED_EVENT, DisconnectWatch, forward, request_headers
from corrallm.proxy.metering import Meter, ask_for_usage
from corrallm.residency.manager import NoRoom
from corrallm.routing.router import Route, ServedModel
from corrallm.scheduler.admission import Rejected, Ticket, retry_after_header

log = logging.getLogger("corrallm.proxy")

_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")


# Uploads (multipart): forwarded byte for byte, boundary and all.
UPLOAD_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})

# Surfaces an STT model's `modes` gate (SPEC §12 U3); empty modes offer both.
SURFACE_MODE = {
    "/v1/audio/transcriptions": "batch",
    "/v1/audio/translations": "batch",
    "/v1/realtime": "realtime",
}


def modes_of(served: ServedModel) -> list[str]:
    modes = {m for r in served.routes for m in r.config.modes}
    return sorted(modes) or ["batch", "realtime"]


def offered(served: ServedModel, mode: str) -> bool:
    return mode in modes_of(served)


def caller_key(scope: Scope) -> str | None:
    """The caller's API key: `Authorization: Bearer <key>` or `X-Corrallm-Key: <key>`."""
    raw = header(scope, b"x-corrallm-key")
    if raw:
        return raw.decode("latin-1").strip()
    auth = header(scope, b"authorization")
    if auth and auth[:7].lower() == b"bearer ":
        return auth[7:].decode("latin-1").strip() or None
    return None


def parse_request(body: bytes) -> tuple[dict[str, Any], str]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(
            f"The request body is not valid JSON ({exc}). Send a JSON object."
        ) from None
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object with a 'model' field.")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "Missing 'model': name the model to use (GET /v1/models lists them).", param="model"
        )
    return payload, model


RETIRED = "backend_retired"  # a reload took the backend away before the request reached it


def lookup(gateway: Gateway, model: str, reloaded: bool = False) -> ServedModel:
    served = gateway.models.get(model)
    if served is None:
        names = ", ".join(s.name for s in gateway.served if not s.config.unlisted)
        what = (
            "was removed by a config reload while this request waited"
            if reloaded
            else ("does not exist here")
        )
        raise not_found(
            f"The model '{model}' {what}. Served models: {names or 'none'}. "
            "GET /v1/models lists them with their aliases.",
            code="model_not_found",
        )
    return served


def upstream_body(body: bytes, payload: dict[str, Any], route: Route, force: bool = False) -> bytes:
    """Rename the model for the backend and clamp its token limit; else forward as sent
    (`force`: the payload was changed already, e.g. to ask a stream for its usage)."""
    config = route.config
    changed = force
    if config.model and payload.get("model") != config.model:
        payload["model"] = config.model
        changed = True
    if config.max_tokens is not None:
        for name in _TOKEN_LIMITS:
            asked = payload.get(name)
            if isinstance(asked, int) and asked > config.max_tokens:
                payload[name] = config.max_tokens
                changed = True
        if not any(name in payload for name in _TOKEN_LIMITS):
            payload["max_tokens"] = config.max_tokens
            changed = True
    return orjson.dumps(payload) if changed else body


async def serve(gateway: Gateway, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
    """A JSON request: chat, completions, embeddings, rerank, speech."""
    payload, model = parse_request(body)
    await serve_parsed(gateway, scope, receive, send, body, payload, model)


async def serve_parsed(
    gateway: Gateway,
    scope: Scope,
    receive: Receive,
    send: Send,
    body: bytes,
    payload: dict[str, Any],
    model: str,
) -> None:
    """Admit, forward and meter one request whose model is known. A non-JSON body (an
    audio upload) has only `model` in `payload` and is forwarded byte for byte."""
    caller = gateway.caller(caller_key(scope))
    visit = Visit(
        caller.key if caller.known else None, caller.group_name, model, scope["path"], len(body)
    )
    try:
        await _serve(gateway, visit, caller, scope, receive, send, payload, body)
    except ApiError as exc:
        visit.status, visit.error = exc.status, f"{exc.code}: {exc.message}"
        raise
    except asyncio.CancelledError:
        visit.status, visit.error = 499, "the client went away"
        raise
    finally:
        gateway.settle(visit)


async def _serve(
    gateway: Gateway,
    visit: Visit,
    caller: Caller,
    scope: Scope,
    receive: Receive,
    send: Send,
    payload: dict[str, Any],
    body: bytes,
) -> None:
    served = lookup(gateway, visit.model)
    visit.model = served.name
    surface = SURFACE_MODE.get(scope["path"])
    if surface is not None and not offered(served, surface):
        raise not_found(
            f"The model '{served.name}' is not offered on {scope['path']}: its modes are "
            f"{', '.join(modes_of(served))}. GET /v1/capabilities lists each surface's models.",
            code="model_not_found",
        )
    if gateway.pauses.paused("model", served.name):
        raise model_paused(served.name)
    if not caller.known and gateway.config.scheduler.require_keys:
        raise ApiError(
            401,
            "This gateway serves only configured API keys (scheduler.requireKeys); send yours "
            "as 'Authorization: Bearer <key>' or 'X-Corrallm-Key'.",
            type="authentication_error",
            code="invalid_api_key",
        )
    tiers = served.tiers_for(caller.group, gateway.placeable)
    limit = payload.get("max_tokens") or payload.get("max_completion_tokens")
    wait = gateway.ledger.reserve(
        visit, tiers[0][0].config, limit if isinstance(limit, int) else None
    )
    if wait is not None:
        raise spend_limited(caller.group_name, wait)
    strip_usage = ask_for_usage(scope["path"], payload)
    cause = (visit.key, caller.group_name, served.name)  # who pays for a cold start
    watch = DisconnectWatch(receive)
    admission = gateway.admission
    ticket: Ticket | None = None
    meter: Meter | None = None
    try:
        ticket = await admission.acquire(caller.group_name, caller.group, tiers)
        while True:
            if gateway.stale(ticket.route):
                # P6: a reload removed or replaced the backend while this request waited
                # for it (or for its cold start): route it again under the config now in
                # force, its slot given back.
                admission.release(ticket)
                ticket = None
                served = lookup(gateway, served.name, reloaded=True)
                tiers = served.tiers_for(caller.group, gateway.placeable)
                ticket = await admission.acquire(caller.group_name, caller.group, tiers)
                continue
            visit.admitted_mono = visit.admitted_mono or time.monotonic()
            stream = ticket
            stream.started = stream.shielded = False
            meter = Meter(strip_usage)
            visit.backend, visit.backend_id = ticket.route.config, ticket.route.id
            visit.degraded = served.degraded(ticket.route)
            visit.spilled = ticket.route not in tiers[0]
            try:
                visit.status = await _forward_admitted(
                    gateway, served, ticket, stream, meter, scope, send, payload, body, watch, cause
                )
                return
            except ApiError as exc:
                if exc.code == RETIRED and gateway.stale(ticket.route):
                    continue  # nothing was sent: route it again (above)
                raise
            except asyncio.CancelledError:
                if not (ticket.preempted and _uncancel()):
                    raise
            visit.preempted = True
            if stream.started:  # S4: end the stream at an event boundary, then [DONE]
                visit.status = meter.status
                await send({"type": "http.response.body", "body": PREEMPTED_EVENT})
                return
            ticket = await admission.requeue(ticket, caller.group)  # only a delay for its client
    except Rejected as exc:
        raise too_many_requests(exc) from None
    except asyncio.CancelledError:
        if watch.absorb():
            visit.status, visit.error = 499, "the client went away"
            return  # the client left: its slot is free and its upstream request dropped
        raise
    finally:
        if meter is not None:
            visit.metered = meter.metered(len(body))
            visit.ttfb_ms = meter.ttfb_ms()
        if ticket is not None:
            price = gateway.ledger.price(visit)
            tokens = visit.metered.tokens if visit.metered else 0
            admission.release(ticket, tokens, price.cost_usd)
        watch.close()


async def _forward_admitted(
    gateway: Gateway,
    served: ServedModel,
    ticket: Ticket,
    stream: Ticket,
    meter: Meter,
    scope: Scope,
    send: Send,
    payload: dict[str, Any],
    body: bytes,
    watch: DisconnectWatch,
    cause: Cause,
) -> int:
    route = ticket.route
    extra = [(b"x-corrallm-backend", route.id.encode())]
    if served.degraded(route):
        extra.append((b"x-corrallm-degraded", b"true"))
    if scope["path"] in UPLOAD_PATHS:
        data = body  # no model rename or token clamp inside a multipart upload
    else:
        data = upstream_body(body, payload, route, force=meter.strip_usage)
    await _enter_ready(route, cause)
    try:
        return await forward(
            gateway.upstream,
            scope,
            send,
            upstream_url(route.endpoint.base_url, scope["path"]),
            data,
            request_headers(scope["headers"], route.config.headers),
            extra,
            watch,
            route.id,
            stream,
            meter,
        )
    finally:
        route.endpoint.leave()


def spend_limited(group: str, wait: float) -> ApiError:
    """S6: the lane's spendLimit would be passed; come back when enough spend has aged out."""
    retry = retry_after_header(wait)
    error = ApiError(
        429,
        f"Lane '{group}' has reached its spendLimit for the window; this request's estimated "
        f"cost would pass it. Retry after {retry}s, when enough spend has left the window.",
        type="rate_limit_error",
        code="spend_limit",
        headers={"retry-after": retry},
    )
    error.extra = {"retry_after_seconds": int(retry)}
    return error


def _uncancel() -> bool:
    """Spend a cancel that was a preemption; True if no other cancel is pending."""
    task = asyncio.current_task()
    return task is not None and task.uncancel() == 0


def too_many_requests(exc: Rejected) -> ApiError:
    """S5: 429 with when to come back, in the headers and in the body."""
    d = exc.decision
    retry = retry_after_header(d.retry_after)
    why = {
        "queue_full": "its queue is full",
        "max_wait_exceeded": "no slot came free within maxWait",
        "saturated": "every slot is busy and this lane does not queue",
    }[exc.reason]
    error = ApiError(
        429,
        f"Backend '{d.backend}' cannot take this request now: {why} "
        f"({d.in_flight}/{d.capacity} slots busy, {d.waiting} waiting). Retry after {retry}s.",
        type="rate_limit_error",
        code=exc.reason,
        headers={
            "retry-after": retry,
            "x-ratelimit-capacity": str(d.capacity),
            "x-ratelimit-inflight": str(d.in_flight),
            "x-ratelimit-waiting": str(d.waiting),
        },
    )
    error.extra = {
        "retry_after_seconds": int(retry),
        "capacity": d.capacity,
        "in_flight": d.in_flight,
        "waiting": d.waiting,
    }
    return error


async def _enter_ready(route: Route, cause: Cause | None = None) -> None:
    """Wait until the backend is ready and count this request in flight on it."""
    while True:
        await _ready(route, cause)
        if route.endpoint.enter():
            return


def model_paused(model: str) -> ApiError:
    # F3: a pause is a decision, not congestion: no Retry-After.
    return unavailable(
        f"The model '{model}' is paused by an operator; it serves again once unpaused.",
        code="paused",
    )


async def _ready(route: Route, cause: Cause | None = None) -> None:
    try:
        await route.endpoint.ensure_ready(cause)
    except BackendPaused as exc:
        raise model_paused(route.model) from exc
    except BackendRetired as exc:
        raise bad_gateway(str(exc), code=RETIRED) from exc
    except BackendFailed as exc:
        raise bad_gateway(str(exc), code="backend_start_failed") from exc
    except NoRoom as exc:
        raise unavailable(str(exc), code="insufficient_capacity") from exc


async def upstream(
    gateway: Gateway, scope: Scope, receive: Receive, send: Send, body: bytes
) -> None:
    """`/upstream/<model>/<path>`: straight to the backend, loading it if needed, unscheduled."""
    rest = scope["path"][len("/upstream/") :]
    model, _, path = rest.partition("/")
    if not model:
        raise not_found("Use /upstream/<model>/<path> to reach a backend's own API or web UI.")
    route = lookup(gateway, model).tiers_for(None)[0][0]
    query = scope.get("query_string", b"")
    extra = [(b"x-corrallm-backend", route.id.encode())]
    watch = DisconnectWatch(receive)
    try:
        await _ready(route)  # untracked: it holds no slot and never delays a drain
        url = f"{origin(route.endpoint.base_url)}/{path}"
        if query:
            url += "?" + query.decode("latin-1")
        headers = request_headers(scope["headers"], route.config.headers)
        await forward(gateway.upstream, scope, send, url, body, headers, extra, watch, route.id)
    except asyncio.CancelledError:
        if watch.absorb():
            return
        raise
    finally:
        watch.close()


__all__ = ["ApiError", "serve", "upstream"]
