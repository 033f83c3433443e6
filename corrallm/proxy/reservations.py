"""`/v1/reservations` (SPEC §7): a keyed caller holds slots on a model's primary backend for
its own lane, for a bounded time, renewed by re-POSTing."""

from __future__ import annotations

import math
import time
from typing import Any
from urllib.parse import parse_qs

import orjson

from corrallm.config.units import parse_duration, rfc3339
from corrallm.gateway import Caller, Gateway
from corrallm.proxy.asgi import Receive, Scope, Send, send_bytes
from corrallm.proxy.errors import ApiError, bad_request, not_found, quoted
from corrallm.proxy.pipeline import Inbound, Pipeline


def live_leases(gateway: Gateway) -> list[dict[str, Any]]:
    """Live leases (SPEC §7): who holds how many slots of which backend, until when."""
    return [
        {
            "model": route.model,
            "backend": route.id,
            "lane": lane,
            "slots": slots,
            "expires_at": rfc3339(time.time() + left),
        }
        for lane, route, slots, left in gateway.admission.leases()
    ]


async def handle(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> None:
    gateway = pipeline.gw
    caller = pipeline.caller_of(scope)
    method = scope["method"]
    if method == "GET":
        await _json(send, 200, {"object": "list", "data": live_leases(gateway)})
        return
    if not caller.known:
        raise ApiError(
            401,
            "Reservations hold slots for a lane, so they need an API key configured in "
            "`keys` (Authorization: Bearer <key> or X-Corrallm-Key).",
            type="authentication_error",
            code="invalid_api_key",
        )
    if method == "POST":
        await _json(send, 200, _reserve(pipeline, caller, body))
    elif method == "DELETE":
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        model = (query.get("model") or [""])[0]
        if not model:
            raise bad_request("Name the model: DELETE /v1/reservations?model=M.", param="model")
        route = pipeline.lookup(model).primary
        if not any(
            g == caller.group_name and r is route for g, r, *_ in gateway.admission.leases()
        ):
            raise not_found(f"Lane '{caller.group_name}' holds no reservation on '{model}'.")
        gateway.admission.unlease(caller.group_name, route)
        released = {"model": route.model, "lane": caller.group_name, "released": True}
        gateway.events.publish("reservation", released)
        await _json(send, 200, released)
    else:
        raise ApiError(
            405,
            f"/v1/reservations takes GET, POST or DELETE, not {method}.",
            code="method_not_allowed",
            headers={"allow": "GET, POST, DELETE"},
        )


def _reserve(pipeline: Pipeline, caller: Caller, body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError:
        raise bad_request('The body must be JSON: {"model", "slots"?, "ttl"?}.') from None
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), str):
        raise bad_request("Missing 'model': which model's slots to reserve.", param="model")
    # The pipeline's gates before a lane may hold slots: lookup, pause, keys.
    served = pipeline.gates(Inbound(payload["model"], "/v1/reservations", None), caller)
    gateway = pipeline.gw
    route = served.primary  # V1: the primary (top-quality) backend
    capacity = route.config.max_concurrent
    slots = payload.get("slots", 1)
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= capacity:
        raise bad_request(
            f"'slots' must be a whole number from 1 to {capacity} (maxConcurrent of "
            f"'{route.id}'), got {quoted(slots)}.",
            param="slots",
        )
    cap = gateway.reservation_max_ttl
    try:
        ttl = min(parse_duration(payload["ttl"]), cap) if "ttl" in payload else cap
    except ValueError as exc:
        raise bad_request(f"'ttl': {exc}.", param="ttl") from None
    if ttl <= 0:
        raise bad_request("'ttl' must be more than 0 seconds.", param="ttl")
    gateway.admission.lease(caller.group_name, route, slots, ttl)
    lease = {
        "model": served.name,
        "lane": caller.group_name,
        "slots": slots,
        "expires_at": rfc3339(time.time() + ttl),
        "renew_within_seconds": max(1, math.floor(ttl / 2)),
    }
    gateway.events.publish("reservation", lease)
    return lease


async def _json(send: Send, status: int, body: Any) -> None:
    await send_bytes(send, status, orjson.dumps(body))
