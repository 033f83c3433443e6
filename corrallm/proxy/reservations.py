"""`/v1/reservations` (SPEC §7, §22 T5): a keyed caller holds slots on a model's primary
backend for its own lane, for a bounded time, renewed by re-POSTing.

No side door round the gates (T5): a lease passes the first gates (key, lookup, pause,
the key's allowlist); a lane's callers hold at most `reservations.maxSlots` slots in
leases at once (409 `reservation_limit` past it); and a lease's slot-seconds count against
the lane's (and the key's) spend at the backend's price (cost/model.py `lease`): its
estimate (slots x ttl) is reserved through the ledger when it is granted, and the
slot-seconds it really held are settled when it ends (released, renewed, expired, or at
shutdown), as one visit with endpoint `/v1/reservations`: an activity row, the spend
windows and the metrics see it. A caller lists and releases its own leases only.
"""

from __future__ import annotations

import math
import time
from typing import Any
from urllib.parse import parse_qs

import orjson

from corrallm.config.schema import ReservationsConfig as Reservations
from corrallm.config.units import parse_duration, rfc3339
from corrallm.cost.ledger import Visit
from corrallm.gateway import Caller, Gateway
from corrallm.http.asgi import Scope, Send, send_bytes
from corrallm.http.errors import ApiError, bad_request, not_found, quoted
from corrallm.observe.context import new_request_id
from corrallm.proxy import jsonbody
from corrallm.proxy.pipeline import Inbound, Pipeline
from corrallm.proxy.refusals import spend_limited
from corrallm.routing.router import Route
from corrallm.scheduler.admission import live_leases
from corrallm.scheduler.leases import Lease

ENDPOINT = "/v1/reservations"
DEFAULT = Reservations()  # a lane with no configured group (the built-in default)


def holder_of(caller: Caller) -> str:
    """Whose a lease is: the key's name (a lane a peer signed has no key: the lane's)."""
    return caller.name or f"lane:{caller.group_name}"


def judge(pipeline: Pipeline, scope: Scope) -> Caller:
    """From the request head alone, before any body byte is read (T5): the method, and a
    caller whose key is configured here (a lease is held by a key)."""
    method = scope["method"]
    if method not in ("GET", "POST", "DELETE"):
        raise ApiError(
            405,
            f"/v1/reservations takes GET, POST or DELETE, not {quoted(method)}.",
            code="method_not_allowed",
            headers={"allow": "GET, POST, DELETE"},
        )
    caller = pipeline.caller_of(scope)
    if not caller.known:
        raise ApiError(
            401,
            "Reservations are held by a key, for its lane, so they need an API key configured "
            "in `keys` (Authorization: Bearer <key> or X-Corrallm-Key).",
            type="authentication_error",
            code="invalid_api_key",
        )
    return caller


async def handle(pipeline: Pipeline, caller: Caller, scope: Scope, send: Send, body: bytes) -> None:
    """`/v1/reservations` for a caller `judge` admitted: list, lease or release."""
    method = scope["method"]
    holder = holder_of(caller)
    if method == "GET":  # T5: the caller's own leases only
        await _json(
            send, 200, {"object": "list", "data": live_leases(pipeline.gw.admission, holder)}
        )
    elif method == "POST":
        await _json(send, 200, await _reserve(pipeline, caller, holder, body))
    else:
        await _json(send, 200, _release(pipeline, caller, holder, scope))


async def _reserve(pipeline: Pipeline, caller: Caller, holder: str, body: bytes) -> dict[str, Any]:
    payload = jsonbody.parse(body or b"{}")  # a key repeated is refused (T5)
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), str):
        raise bad_request("Missing 'model': which model's slots to reserve.", param="model")
    # The pipeline's gates before a lane may hold slots: keys, lookup, allowlist, pause.
    served = pipeline.gates(Inbound(payload["model"], ENDPOINT, None), caller)
    gateway = pipeline.gw
    route = served.primary  # V1: the primary (top-quality) backend
    capacity = route.config.max_concurrent
    slots = payload.get("slots", 1)
    # More slots than the backend has is a bad request, whatever the lane's cap (T5).
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
    _within_cap(gateway, caller, holder, route, slots)
    # T5: the lease's estimate is held against the lane's (and the key's) spend limit.
    visit = Visit(caller.name, caller.group_name, served.name, ENDPOINT, len(body))
    visit.request_id = new_request_id()
    visit.backend, visit.backend_id = route.config, route.id
    visit.admitted_mono = visit.arrived_mono  # it waits for nothing: no dwell
    ledger = gateway.ledger
    estimate = ledger.costs.lease(route.config, slots * ttl).cost_usd
    identity = caller.identity
    key_limit = identity.spend_limit if identity is not None else None
    over = await ledger.reserve(visit, route.config, None, key_limit, usd=estimate)
    if over is not None:
        raise spend_limited(over)
    try:  # again: another lease of the lane may have been granted while it reserved
        _within_cap(gateway, caller, holder, route, slots)
    except ApiError as exc:
        visit.status, visit.error = exc.status, exc.summary
        gateway.settle(visit)  # gives its reservation back
        raise

    def ended(lease: Lease, slot_seconds: float) -> None:
        """Its real cost: the slot-seconds it held, at the backend's price."""
        visit.price = ledger.costs.lease(lease.route.config, slot_seconds)
        visit.status = 200
        gateway.settle(visit)

    gateway.admission.lease(caller.group_name, route, slots, ttl, holder, ended)
    lease = {
        "model": served.name,
        "lane": caller.group_name,
        "key": holder,
        "slots": slots,
        "expires_at": rfc3339(time.time() + ttl),
        "renew_within_seconds": max(1, math.floor(ttl / 2)),
    }
    gateway.events.publish("reservation", lease)
    return lease


def _within_cap(gateway: Gateway, caller: Caller, holder: str, route: Route, slots: int) -> None:
    """T5: 409 `reservation_limit` if the lane's callers would hold more than its
    `reservations.maxSlots` (a renewal replaces the holder's lease on that backend)."""
    group = caller.group
    allowed = (group.reservations if group is not None else DEFAULT).max_slots
    held = gateway.admission.held.held(caller.group_name, (holder, route.id))
    if held + slots > allowed:
        raise ApiError(
            409,
            f"Lane '{caller.group_name}' may hold {allowed} reserved slot(s) at once "
            f"(priorityGroups.{caller.group_name}.reservations.maxSlots) and its callers hold "
            f"{held} already; release one (DELETE /v1/reservations?model=M), wait for it to "
            "expire, or ask for fewer slots.",
            code="reservation_limit",
        )


def _release(pipeline: Pipeline, caller: Caller, holder: str, scope: Scope) -> dict[str, Any]:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    model = (query.get("model") or [""])[0]
    if not model:
        raise bad_request("Name the model: DELETE /v1/reservations?model=M.", param="model")
    route = pipeline.lookup(model).primary
    if pipeline.gw.admission.unlease(holder, route) is None:  # settles what it held
        raise not_found(f"The key '{holder}' holds no reservation on '{route.model}'.")
    released = {"model": route.model, "lane": caller.group_name, "key": holder, "released": True}
    pipeline.gw.events.publish("reservation", released)
    return released


async def _json(send: Send, status: int, body: Any) -> None:
    await send_bytes(send, status, orjson.dumps(body))
