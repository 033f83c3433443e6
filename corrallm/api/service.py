"""The one service layer behind every management surface (REST, GraphQL, the dashboard):
operator actions and the views of SPEC §14 (usage and activity in `usage.py`). Plain
functions over the gateway, each returning a typed view of `schemas.py` that every
surface renders as it is (REST as JSON, GraphQL through the type derived from it, the
dashboard's templates); surfaces render its `ApiError`s in their own shapes.

A management write that cannot be made durable fails as a whole: the store is written
first, and only then is anything changed (`store_unavailable`, 503, otherwise)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from corrallm.api.schemas import (
    ActionResult,
    BackendView,
    CancelResult,
    CaptureEncodings,
    CaptureHeaders,
    CaptureList,
    CaptureRecord,
    CaptureRow,
    CaptureSides,
    EconomicsRow,
    EconomicsView,
    Lanes,
    LaneView,
    LiveRequestsView,
    LiveRequestView,
    Logs,
    ModelView,
    Overview,
    PauseResult,
    PeerNodeView,
    PeerResidency,
    PeerResident,
    PoolView,
    ReloadResult,
    ReservationsView,
    ReservationView,
    ResidencyView,
    ResidentView,
    ServerResidency,
    ServerView,
)
from corrallm.config import ConfigError
from corrallm.config.units import parse_duration, rfc3339
from corrallm.gateway import Gateway
from corrallm.http.errors import ApiError, lifecycle_failure
from corrallm.lifecycle.errors import LifecycleBusy, LifecycleError
from corrallm.lifecycle.pauses import Kind
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.observe.ring import Record
from corrallm.routing.router import ServedModel
from corrallm.scheduler.admission import live_leases
from corrallm.store.db import StoreUnavailable

# -- lookups -------------------------------------------------------------------------


def served_model(gw: Gateway, name: str) -> ServedModel:
    served = gw.models.get(name)
    if served is None:
        known = ", ".join(s.name for s in gw.served) or "none"
        raise ApiError(404, f"No model '{name}'. Configured models: {known}.", "model_not_found")
    return served


def extension(gw: Gateway, name: str) -> Supervisor:
    sup = gw.extensions.get(name)
    if sup is None:
        known = ", ".join(gw.extensions) or "none"
        raise ApiError(
            404, f"No extension '{name}'. Configured extensions: {known}.", "extension_not_found"
        )
    return sup


# The latest `until` a pause takes: beyond it, "until unpaused" (no `until`) is what is meant,
# and datetimes past year 9999 cannot be written back as RFC 3339.
LATEST_UNTIL = datetime(9000, 1, 1, tzinfo=UTC).timestamp()


def parse_until(value: str | float | None) -> float | None:
    """`until`: an RFC 3339 time, a duration from now (`30m`, `2h`), or Unix seconds;
    None: until unpaused."""
    if value is None:
        return None
    now = time.time()
    if isinstance(value, int | float):
        until = float(value)
    else:
        try:
            until = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError):
            try:
                until = now + parse_duration(value)
            except ValueError:
                raise ApiError(
                    400,
                    f"'until' must be an RFC 3339 time (2026-12-01T08:00:00Z) or a duration "
                    f"from now (30m, 2h), got {value!r}.",
                    "invalid_until",
                ) from None
    if not until > now:  # also refuses NaN
        shown = rfc3339(until) if math.isfinite(until) and until >= 0 else repr(value)
        raise ApiError(400, f"'until' ({shown}) is in the past.", "invalid_until")
    if until > LATEST_UNTIL:
        raise ApiError(
            400,
            f"'until' ({value!r}) is too far in the future (latest: year 9000); "
            "leave 'until' out to pause until unpaused.",
            "invalid_until",
        )
    return until


def wall(gw: Gateway, monotonic: float | None) -> str | None:
    """A monotonic instant (what supervisors keep) as an RFC 3339 wall-clock time."""
    if not monotonic:
        return None
    return rfc3339(time.time() - (time.monotonic() - monotonic))


# -- actions -------------------------------------------------------------------------


async def load_model(gw: Gateway, name: str) -> ActionResult:
    served = served_model(gw, name)
    if gw.pauses.paused("model", served.name):
        raise ApiError(423, f"Model '{served.name}' is paused; unpause it first.", "paused")
    route = served.tiers_for(None, gw.placeable)[0][0]
    endpoint = route.endpoint
    try:
        await endpoint.load()
    except LifecycleError as exc:
        raise _lifecycle_error(exc) from exc
    return ActionResult(model=served.name, backend=route.id, state=str(endpoint.state))


async def unload_model(gw: Gateway, name: str, force: bool = False) -> ActionResult:
    served = served_model(gw, name)
    own = gw.own_supervisors(served)
    if not own:
        hosts = sorted({r.config.extension for r in served.routes if r.config.extension})
        what = f"hosted by extension {', '.join(hosts)}" if hosts else "a pure proxy"
        raise ApiError(
            409,
            f"Model '{served.name}' has no process of its own to unload: it is {what}."
            + (" Unload the extension instead." if hosts else ""),
            "nothing_to_unload",
        )
    await _unload(own, force)
    return ActionResult(model=served.name, state=str(own[0].state))


def _pause_target(gw: Gateway, kind: Kind, name: str) -> str:
    """The configured name a pause is kept under (a model's alias resolves to the model)."""
    if kind == "model":
        return served_model(gw, name).name
    extension(gw, name)
    return name


async def pause(gw: Gateway, kind: Kind, name: str, until: str | float | None) -> PauseResult:
    target = _pause_target(gw, kind, name)
    when = parse_until(until)
    try:
        await gw.pauses.pause(kind, target, when)
    except StoreUnavailable as exc:
        raise store_unavailable(exc, f"pause {kind} '{target}'") from exc
    return PauseResult.model_validate({kind: target, "paused": True, "paused_until": rfc3339(when)})


async def unpause(gw: Gateway, kind: Kind, name: str) -> PauseResult:
    target = _pause_target(gw, kind, name)
    try:
        await gw.pauses.unpause(kind, target)
    except StoreUnavailable as exc:
        raise store_unavailable(exc, f"unpause {kind} '{target}'") from exc
    return PauseResult.model_validate({kind: target, "paused": False, "paused_until": None})


def store_unavailable(exc: StoreUnavailable, action: str) -> ApiError:
    """A management write the store could not keep: nothing was changed (C5)."""
    return ApiError(
        503,
        f"Could not {action}: the store could not save it ({exc.reason}: {exc.path}), so "
        f"nothing was changed. To fix: {exc.fix}, then try again.",
        "store_unavailable",
    )


async def load_extension(gw: Gateway, name: str) -> ActionResult:
    sup = extension(gw, name)
    if gw.pauses.paused("extension", name):
        raise ApiError(423, f"Extension '{name}' is paused; unpause it first.", "paused")
    try:
        await sup.load()
    except LifecycleError as exc:
        raise _lifecycle_error(exc) from exc
    return ActionResult(extension=name, state=str(sup.state))


async def unload_extension(gw: Gateway, name: str, force: bool = False) -> ActionResult:
    sup = extension(gw, name)
    await _unload([sup], force)
    return ActionResult(extension=name, state=str(sup.state))


async def _unload(sups: list[Supervisor], force: bool) -> None:
    for sup in sups:
        try:
            await sup.unload(force=force)
        except LifecycleBusy as exc:
            raise ApiError(409, f"{exc} (or pass force: true).", "lifecycle_busy") from exc


def _lifecycle_error(exc: LifecycleError) -> ApiError:
    return lifecycle_failure(exc, management=True)


# -- views ---------------------------------------------------------------------------


def model_logs(gw: Gateway, name: str, lines: int = 100) -> Logs:
    served = served_model(gw, name)
    logs = served.primary.endpoint.describe().logs
    if logs is None:
        return Logs(model=served.name, lines=[], n_ctx=None, n_slots=None)
    return Logs(model=served.name, lines=logs.tail(lines), n_ctx=logs.n_ctx, n_slots=logs.n_slots)


def overview(gw: Gateway) -> Overview:
    models = []
    core = gw.admission.core
    for served in gw.served:
        until = gw.pauses.until.get(("model", served.name))
        paused = gw.pauses.paused("model", served.name)
        backends = []
        for route in served.routes:
            endpoint = route.endpoint
            described = endpoint.describe()
            logs = described.logs
            tenancy = gw.residency.tenancies.get(endpoint.id)
            _, in_flight, waiting = core.load(route.id)
            backends.append(
                BackendView(
                    id=route.id,
                    state=str(endpoint.state),
                    server=(tenancy.server if tenancy else None) or route.config.server,
                    quality=route.config.quality,
                    type=route.config.type,
                    max_concurrent=route.config.max_concurrent,
                    in_flight=in_flight,
                    waiting=waiting,
                    n_ctx=logs.n_ctx if logs else None,
                    n_slots=logs.n_slots if logs else None,
                    pid=described.pid,
                    extension=route.config.extension,
                    last_error=described.last_error,
                    sleeps=described.sleeps,
                    peer=route.config.peer,
                    modes=list(route.config.modes),
                    service_seconds=core.backends[route.id].service,
                    load_seconds=described.load_seconds,
                )
            )
        models.append(
            ModelView(
                name=served.name,
                aliases=list(served.config.aliases),
                state="paused" if paused else backends[0].state,
                paused=paused,
                paused_until=rfc3339(until) if paused else None,
                persistent=served.config.persistent,
                ttl_seconds=served.config.sticky.ttl if served.config.sticky else None,
                backends=backends,
            )
        )
    servers = [
        ServerView(
            name=name,
            pools={
                pool: PoolView(
                    capacity=capacity,
                    reserve=server.reserve.get(pool, 0),
                    used=gw.residency.used(name).get(pool, 0),
                )
                for pool, capacity in server.pools.items()
            },
        )
        for name, server in gw.config.servers.items()
    ]
    peers = [PeerNodeView.model_validate(view.view()) for view in gw.nodes.views.values()]
    return Overview(models=models, servers=servers, peers=peers)


def residency(gw: Gateway) -> ResidencyView:
    servers = []
    for name in gw.config.servers:
        residents = []
        for tenancy in gw.residency.residents(name):
            sup = tenancy.supervisor
            residents.append(
                ResidentView(
                    backend=sup.id,
                    state=str(sup.state),
                    pid=sup.pid,
                    ram_usage=tenancy.usage,
                    declared=tenancy.declared,
                    estimated=tenancy.estimated,
                    measured=tenancy.measured_here,
                    sleep_usage=tenancy.asleep_usage,
                    gpu=tenancy.placed,
                    in_flight=sup.in_flight,
                    last_used=wall(gw, sup.last_used),
                    ttl_expires_at=wall(gw, tenancy.ttl_expires_at()),
                    evict_cost=tenancy.evict_cost,
                    pinned=tenancy.pinned,
                )
            )
        servers.append(ServerResidency(name=name, residents=residents))
    # X1: what each peer holds is its own to plan; here, its models' state as it reports.
    peers = [
        PeerResidency(
            name=view.name,
            state="up" if view.up else "down",
            backends=[
                PeerResident(backend=m["backend"], state=m["state"], in_flight=m["in_flight"])
                for m in view.view()["models"]
            ],
        )
        for view in gw.nodes.views.values()
    ]
    return ResidencyView(servers=servers, peers=peers)


def lanes(gw: Gateway) -> Lanes:
    """Per priority group (lane): its weight, live load and share of recent usage."""
    core = gw.admission.core
    shares = core.usage_share(time.monotonic())
    rows = [
        LaneView(
            name=name,
            weight=group.spec.weight,
            interruptible=group.spec.interruptible,
            share_currency=group.spec.currency,
            in_flight=group.in_flight,
            waiting=group.waiting,
            usage_share=round(shares.get(name, 0.0), 4),
            spend_usd_window=round(gw.ledger.spent(name), 6),
        )
        for name, group in core.groups.items()
    ]
    return Lanes(lanes=rows)


# -- live requests (SPEC §21 O1) ------------------------------------------------------


def live_requests(gw: Gateway) -> LiveRequestsView:
    """Every request corrallm holds now, oldest first."""
    return LiveRequestsView(requests=[LiveRequestView(**view) for view in gw.live.views()])


def cancel_request(gw: Gateway, request_id: str) -> CancelResult:
    """End one held request: a queued or loading one gets 503 `cancelled`, a running one
    is cancelled upstream (a stream ends with an error event and [DONE])."""
    live = gw.live.cancel(request_id)
    if live is None:
        raise ApiError(
            404,
            f"No request {request_id} is held now: it may have finished already. "
            "GET /api/v1/requests lists the requests held now.",
            "request_not_found",
        )
    return CancelResult(id=live.id, state=live.state, cancelled=True)


def economics(gw: Gateway) -> EconomicsView:
    """SPEC §14, §11 D1: the economics ledger, one row per backend of the config in force."""
    ledger = gw.economics.view()
    rows = [
        EconomicsRow(**{**row, "first_seen": rfc3339(row["first_seen"])}) for row in ledger["rows"]
    ]
    return EconomicsView(**{**ledger, "since": rfc3339(ledger["since"]), "rows": rows})


def reservations(gw: Gateway) -> ReservationsView:
    """Live leases (SPEC §7): who holds how many slots of which backend, until when."""
    leases = live_leases(gw.admission)
    return ReservationsView(reservations=[ReservationView(**lease) for lease in leases])


async def reload_config(gw: Gateway) -> ReloadResult:
    """SPEC §10 P6: re-read the config file; refused with every problem if it is bad."""
    from corrallm.api.reload import read_config, reload

    try:
        config = read_config(gw)
    except ConfigError as exc:
        raise _refused(exc) from exc
    report = await reload(gw, config)
    return ReloadResult(
        kept=report.kept, restarted=report.restarted, removed=report.removed, added=report.added
    )


def _refused(exc: ConfigError) -> ApiError:
    """P6: a config that cannot be used, named by its path, with every problem and the fix."""
    source = Path(exc.source)
    fix = (
        f"Fix {source} and reload again."
        if source.exists() or exc.source.startswith("<")
        else f"Put the config file back at {source} (corrallm re-reads the file it was "
        "started with) and reload again."
    )
    return ApiError(
        400,
        f"The new config ({source}) was refused; the old one stays in force. "
        + "; ".join(exc.problems)
        + ". "
        + fix,
        "invalid_config",
    )


# -- captures (SPEC §21 O2) -------------------------------------------------------------

MAX_CAPTURES = 10_000


def captures(
    gw: Gateway, limit: int = 100, model: str | None = None, status: str | None = None
) -> CaptureList:
    """The kept captures, newest first, without their bodies; and the ring's fill."""
    statuses = _statuses(status)
    rows = []
    for kept in gw.captures.newest(model or None, statuses):
        rows.append(CaptureRow(**_capture_fields(kept)))
        if len(rows) >= limit:
            break
    ring = gw.captures.ring
    return CaptureList(
        captures=rows, bodies=gw.captures.bodies, used_bytes=ring.used, bound_bytes=ring.bound
    )


def capture(gw: Gateway, request_id: str) -> CaptureRecord:
    """One kept capture, bodies and headers included."""
    kept = gw.captures.get(request_id)
    if kept is None:
        raise ApiError(
            404,
            f"No capture of request {request_id!r}: it may have been evicted from the ring "
            f"buffer (capture.bufferMB) or never kept (capture.bodies is "
            f"{gw.captures.bodies!r}; `errors` keeps only failed requests). GET "
            "/api/v1/captures lists the kept ones.",
            "capture_not_found",
            param="request_id",
        )
    return CaptureRecord(
        **_capture_fields(kept),
        request=kept.request,
        response=kept.response,
        encoding=CaptureEncodings(request=kept.request_encoding, response=kept.response_encoding),
        headers=CaptureHeaders(request=kept.request_headers, response=kept.response_headers),
    )


def kept_captures(gw: Gateway, request_ids: Iterable[str | None]) -> set[str]:
    """Which of these requests have a capture kept (one lookup each)."""
    return {rid for rid in request_ids if rid is not None and gw.captures.get(rid) is not None}


def _capture_fields(kept: Record) -> dict[str, Any]:
    """What a capture's row and its whole record share."""
    return {
        "request_id": kept.request_id,
        "t": rfc3339(kept.t),
        "model": kept.model,
        "backend": kept.backend,
        "key": kept.key,
        "user": kept.user,
        "group": kept.group,
        "endpoint": kept.endpoint,
        "status": kept.status,
        "error": kept.error,
        "truncated": CaptureSides(request=kept.request_truncated, response=kept.response_truncated),
        "request_bytes": kept.request_bytes,
        "response_bytes": kept.response_bytes,
    }


def _statuses(status: str | None) -> range | None:
    """`status=`: a code (`502`) or a class (`5xx`); None or blank: any."""
    text = (status or "").strip().lower()
    if not text:
        return None
    if len(text) == 3 and text[0] in "12345" and (text[1:].isdigit() or text[1:] == "xx"):
        if text[1:] == "xx":
            return range(int(text[0]) * 100, int(text[0]) * 100 + 100)
        return range(int(text), int(text) + 1)
    raise ApiError(
        400,
        f"'status' must be an HTTP status (502) or a class of them (5xx, 4xx); got {status!r}.",
        "invalid_status",
        param="status",
    )
