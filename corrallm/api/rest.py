"""The management REST API under `/api/v1/` (FastAPI, so the OpenAPI document comes free).

Every route is a thin call into `api/service.py`; errors leave in the OpenAI shape.
Admin auth is checked before any request reaches this app (see `api/auth.py`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corrallm import __version__
from corrallm.api import keys, schemas, service, usage
from corrallm.config.names import by_public_names
from corrallm.gateway import Gateway
from corrallm.http.errors import ApiError, internal
from corrallm.observe.events import HEARTBEAT_SECONDS
from corrallm.store.db import StoreUnavailable

log = logging.getLogger("corrallm.api")

PREFIX = "/api/v1"

_TIME = "RFC 3339 time, unix seconds, or a duration ago (24h, 7d)"
Since = Annotated[
    str | None, Query(description=f"{_TIME}; default 24h before until", examples=["7d"])
]
Until = Annotated[str | None, Query(description=f"{_TIME}; default now (exclusive)")]
Bucket = Annotated[
    str | None,
    Query(description="bucket length (60s, 5m, 1h, 1d); default from the range", examples=["1h"]),
]


def error(
    status: int,
    message: str,
    code: str | None,
    type: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class Unexpected:
    """No exception leaves the management API as a bare plain-text 500: it is logged with
    its traceback under a request id, and the client gets an OpenAI-shaped 500 naming that
    id (unless the answer had already begun; then the connection just ends)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if scope["type"] != "http":
                raise
            request_id = uuid.uuid4().hex[:16]
            log.exception("request=%s %s %s failed", request_id, scope["method"], scope["path"])
            if not started:
                error = internal(
                    f"corrallm hit an unexpected error (request {request_id}); the gateway "
                    "log has the details under that id."
                )
                error.headers["x-request-id"] = request_id
                await error.send(send)


REFS = "#/components/schemas/"


# What clients send a JSON body as when they are not told otherwise: curl's `-d` says
# `application/x-www-form-urlencoded`, some scripts `text/plain`.
_READ_AS_JSON = (b"application/x-www-form-urlencoded", b"text/plain")
JSON_HINT = (
    "the management API takes a JSON object as its body: send it with "
    "'Content-Type: application/json' (curl -H 'Content-Type: application/json' -d '{...}')"
)


class FormAsJson:
    """Every body this API takes is a JSON object, so one sent with a form's or plain
    text's content type, or none (`curl -d '{"model": "m"}'` without a header), is read as
    JSON;
    one that is not JSON is refused with JSON_HINT (see `invalid` below)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "GET":
            scope = {**scope, "headers": _as_json(scope["headers"])}
        await self.app(scope, receive, send)


def _as_json(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`headers` with a form's, plain text's or no content type said to be JSON."""
    for i, (name, value) in enumerate(headers):
        if name == b"content-type":
            if value.split(b";")[0].strip().lower() not in _READ_AS_JSON:
                return headers
            return [*headers[:i], (name, b"application/json"), *headers[i + 1 :]]
    return [*headers, (b"content-type", b"application/json")]


def _not_json(request: Request, exc: RequestValidationError) -> str | None:
    """The message for a body that is not a JSON object, else None."""
    for e in exc.errors():
        if e["type"] == "json_invalid":
            return f"the body is not valid JSON ({e['msg']}); {JSON_HINT}."
        if tuple(e["loc"]) == ("body",) and e["type"] in ("model_attributes_type", "dict_type"):
            sent = request.headers.get("content-type", "no Content-Type").split(";")[0]
            if "json" not in sent:
                return f"the body came as {sent}, not JSON; {JSON_HINT}."
    return None


def build_rest(gw: Gateway) -> FastAPI:
    app = FastAPI(
        title="corrallm management API",
        version=__version__,
        openapi_url=f"{PREFIX}/openapi.json",
        docs_url=f"{PREFIX}/docs",
        redoc_url=None,
        responses=schemas.ERRORS,
    )

    app.add_middleware(FormAsJson)
    app.add_middleware(Unexpected)

    @app.exception_handler(ApiError)
    async def service_error(_: Request, exc: ApiError) -> JSONResponse:
        return error(exc.status, exc.message, exc.code, exc.type, exc.param, exc.headers)

    @app.exception_handler(StoreUnavailable)
    async def store_error(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return error(
            503,
            f"The store failed ({exc.reason}: {exc.path}). To fix: {exc.fix}, then try again.",
            "store_unavailable",
            "api_error",
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        not_json = _not_json(request, exc)
        if not_json is not None:
            return error(400, f"Invalid request: {not_json}", "invalid_request")
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in exc.errors()
        )
        return error(400, f"Invalid request: {problems}.", "invalid_request")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"No management endpoint here; see {PREFIX}/openapi.json."
        return error(exc.status_code, message, "not_found" if exc.status_code == 404 else "error")

    @app.get(f"{PREFIX}/overview", response_model=schemas.Overview)
    async def overview() -> schemas.Overview:
        return service.overview(gw)

    @app.get(f"{PREFIX}/residency", response_model=schemas.ResidencyView)
    async def residency() -> schemas.ResidencyView:
        return service.residency(gw)

    @app.get(f"{PREFIX}/economics", response_model=schemas.EconomicsView)
    async def economics() -> schemas.EconomicsView:
        """The economics ledger (SPEC §11 D1): per backend of the config in force, wakes,
        sleeps, time asleep, wake latencies and the GPU-hours its sleeps returned; counted
        from install on, across reloads and restarts."""
        return service.economics(gw)

    @app.get(f"{PREFIX}/requests", response_model=schemas.LiveRequestsView)
    async def live_requests() -> schemas.LiveRequestsView:
        return service.live_requests(gw)

    @app.post(f"{PREFIX}/requests/{{request_id}}/cancel", response_model=schemas.CancelResult)
    async def cancel_request(request_id: str) -> schemas.CancelResult:
        return service.cancel_request(gw, request_id)

    @app.get(f"{PREFIX}/reservations", response_model=schemas.ReservationsView)
    async def reservations() -> schemas.ReservationsView:
        return service.reservations(gw)

    @app.get(
        f"{PREFIX}/events",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "SSE stream"}},
    )
    async def events(
        kinds: str | None = Query(
            None,
            description="comma-separated kinds to receive (lifecycle, admission, queue_depth, "
            "usage, log, reservation, request, peer); all when absent",
        ),
        heartbeat: float = Query(
            HEARTBEAT_SECONDS,
            ge=0.1,
            le=300,
            description="seconds of silence before a heartbeat comment (a gateway following "
            "this node asks for a third of its peerTimeout)",
        ),
    ) -> StreamingResponse:
        """Live events as Server-Sent Events, with a heartbeat comment every 15 s."""
        wanted = frozenset(k.strip() for k in kinds.split(",") if k.strip()) if kinds else None
        return StreamingResponse(
            gw.events.stream(wanted, heartbeat),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    @app.post(f"{PREFIX}/config/reload", response_model=schemas.ReloadResult)
    async def reload_config() -> schemas.ReloadResult:
        """Re-read the config file (as SIGHUP does); a bad one is refused, every problem named."""
        return await service.reload_config(gw)

    @app.get(f"{PREFIX}/lanes", response_model=schemas.Lanes)
    async def lanes() -> schemas.Lanes:
        return service.lanes(gw)

    @app.get(f"{PREFIX}/models/logs", response_model=schemas.Logs)
    async def model_logs(
        model: str = Query(min_length=1), lines: int = Query(100, ge=0, le=10000)
    ) -> schemas.Logs:
        return service.model_logs(gw, model, lines)

    @app.post(f"{PREFIX}/models/load", response_model=schemas.ActionResult)
    async def load_model(body: schemas.ModelRef) -> schemas.ActionResult:
        """Load a model's backend; answers once it is ready (409 while busy, 423 paused)."""
        return await service.load_model(gw, body.model)

    @app.post(f"{PREFIX}/models/unload", response_model=schemas.ActionResult)
    async def unload_model(body: schemas.ModelUnload) -> schemas.ActionResult:
        """Drain in-flight requests (unless `force`), then stop the model's processes."""
        return await service.unload_model(gw, body.model, body.force)

    @app.post(f"{PREFIX}/models/pause", response_model=schemas.PauseResult)
    async def pause_model(body: schemas.ModelPause) -> schemas.PauseResult:
        return await service.pause(gw, "model", body.model, body.until)

    @app.post(f"{PREFIX}/models/unpause", response_model=schemas.PauseResult)
    async def unpause_model(body: schemas.ModelRef) -> schemas.PauseResult:
        return await service.unpause(gw, "model", body.model)

    @app.post(f"{PREFIX}/extensions/load", response_model=schemas.ActionResult)
    async def load_extension(body: schemas.ExtensionRef) -> schemas.ActionResult:
        return await service.load_extension(gw, body.extension)

    @app.post(f"{PREFIX}/extensions/unload", response_model=schemas.ActionResult)
    async def unload_extension(body: schemas.ExtensionUnload) -> schemas.ActionResult:
        return await service.unload_extension(gw, body.extension, body.force)

    @app.post(f"{PREFIX}/extensions/pause", response_model=schemas.PauseResult)
    async def pause_extension(body: schemas.ExtensionPause) -> schemas.PauseResult:
        return await service.pause(gw, "extension", body.extension, body.until)

    @app.post(f"{PREFIX}/extensions/unpause", response_model=schemas.PauseResult)
    async def unpause_extension(body: schemas.ExtensionRef) -> schemas.PauseResult:
        return await service.unpause(gw, "extension", body.extension)

    @app.get(f"{PREFIX}/usage/by-key", response_model=schemas.UsageByKey)
    async def usage_by_key(since: Since = None, until: Until = None) -> schemas.UsageByKey:
        """Usage per (key, group) over `[since, until)`."""
        return await usage.usage_by_key(gw, since, until)

    @app.get(f"{PREFIX}/usage/by-user", response_model=schemas.UsageByUser)
    async def usage_by_user(since: Since = None, until: Until = None) -> schemas.UsageByUser:
        """Usage per (user, key) over `[since, until)`: the users that keys with
        `trustUserHeader` named in `auth.userHeader` (SPEC §22 T4)."""
        return await usage.usage_by_user(gw, since, until)

    @app.get(f"{PREFIX}/usage/rollup", response_model=schemas.UsageRollup)
    async def usage_rollup(since: Since = None, until: Until = None) -> schemas.UsageRollup:
        """Usage per (group, model) over `[since, until)`."""
        return await usage.usage_rollup(gw, since, until)

    @app.get(f"{PREFIX}/usage/series", response_model=schemas.UsageSeries)
    async def usage_series(
        since: Since = None, until: Until = None, bucket: Bucket = None
    ) -> schemas.UsageSeries | schemas.UsageGroupSeries:
        """Usage per time bucket (aligned to the epoch; empty buckets have zero sums)."""
        return await usage.usage_series(gw, since, until, bucket)

    @app.get(f"{PREFIX}/usage/series-by-group", response_model=schemas.UsageGroupSeries)
    async def usage_series_by_group(
        since: Since = None, until: Until = None, bucket: Bucket = None
    ) -> schemas.UsageSeries | schemas.UsageGroupSeries:
        """Usage per time bucket and group (every group seen in the range, every bucket)."""
        return await usage.usage_series(gw, since, until, bucket, by_group=True)

    @app.get(f"{PREFIX}/usage/queue-depth", response_model=schemas.QueueDepth)
    async def queue_depth(
        since: Since = None, until: Until = None, bucket: Bucket = None
    ) -> schemas.QueueDepth:
        """Per bucket and backend, the peak of the queue samples (taken every few seconds)."""
        return await usage.queue_depth(gw, since, until, bucket)

    @app.get(f"{PREFIX}/activity", response_model=schemas.ActivityList)
    async def activity(
        limit: int = Query(100, ge=1, le=usage.MAX_ACTIVITY),
        key: str | None = None,
        model: str | None = None,
        group: str | None = None,
        since: Since = None,
        until: Until = None,
        user: str | None = Query(None, description="only the rows of this user (T4)"),
    ) -> schemas.ActivityList:
        """The newest rows first: one per request and per backend load."""
        return await usage.activity(gw, limit, key, model, group, since, until, user)

    # -- keys (SPEC §22 T2) ----------------------------------------------------------------

    @app.get(f"{PREFIX}/keys", response_model=schemas.Keys)
    async def list_keys() -> schemas.Keys:
        """Every key by name (config and API ones); never a secret or a digest."""
        return keys.list_keys(gw)

    @app.post(
        f"{PREFIX}/keys",
        status_code=201,
        response_model=schemas.KeyWithSecret,
        responses={409: {"model": schemas.ErrorBody, "description": "key_exists"}},
    )
    async def create_key(
        body: Annotated[dict[str, Any], Body(json_schema_extra=schemas.KEY_CREATE_SCHEMA)],
    ) -> schemas.KeyWithSecret:
        """Make a key; its `secret` is in this answer and nowhere else (the store keeps its
        SHA-256 digest). 400 names every bad field; 409 `key_exists` for a name in use."""
        return await keys.create_key(gw, body)

    @app.post(
        f"{PREFIX}/keys/{{name}}/rotate",
        response_model=schemas.KeyWithSecret,
        responses={
            404: {"model": schemas.ErrorBody, "description": "key_not_found"},
            409: {"model": schemas.ErrorBody, "description": "key_in_config"},
        },
    )
    async def rotate_key(name: str) -> schemas.KeyWithSecret:
        """A new `secret` for a key made here; the old one is refused (401) at once."""
        return await keys.rotate_key(gw, name)

    @app.delete(
        f"{PREFIX}/keys/{{name}}",
        response_model=schemas.KeyRevoked,
        responses={
            404: {"model": schemas.ErrorBody, "description": "key_not_found"},
            409: {"model": schemas.ErrorBody, "description": "key_in_config"},
        },
    )
    async def revoke_key(name: str) -> schemas.KeyRevoked:
        """Revoke a key made here: refused (401) from the next request on, on every gateway
        sharing a PostgreSQL store within a second."""
        return await keys.revoke_key(gw, name)

    # -- captures (SPEC §21 O2) ----------------------------------------------------------

    @app.get(f"{PREFIX}/captures", response_model=schemas.CaptureList)
    async def captures(
        limit: int = Query(100, ge=1, le=service.MAX_CAPTURES),
        model: str | None = None,
        status: str | None = Query(None, description="a status (502) or a class (5xx)"),
    ) -> schemas.CaptureList:
        """Kept request/response captures, newest first, without bodies; `used_bytes` of
        `bound_bytes` (capture.bufferMB) held."""
        return service.captures(gw, limit, model, status)

    @app.get(f"{PREFIX}/captures/{{request_id}}", response_model=schemas.CaptureRecord)
    async def capture(request_id: str) -> schemas.CaptureRecord:
        """One capture: bodies (each cut at 64 KB), headers, status; secrets redacted.
        404 when it was evicted or never kept."""
        return service.capture(gw, request_id)

    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """The document with each view under its public name (config/names.py)."""
        named = by_public_names(plain_openapi(), ["components", "schemas"], REFS)
        app.openapi_schema = named
        return named

    app.openapi = openapi  # type: ignore[method-assign]
    return app
