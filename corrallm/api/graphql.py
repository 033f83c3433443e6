"""GraphQL at `/api/graphql` (SPEC §10 P5): the same data and actions as REST, from the
same service functions, typed from the same Pydantic models, so the two cannot drift.

Every GraphQL type is derived from a REST response model in `schemas.py`; map-valued
fields (pools, ram usage) are JSON scalars, GraphQL having no maps.
"""

from __future__ import annotations

import typing
from typing import Any

import strawberry
import strawberry.experimental.pydantic as sp
from pydantic import BaseModel
from strawberry.asgi import GraphQL
from strawberry.scalars import JSON
from strawberry.schema.config import StrawberryConfig
from strawberry.types import Info

from corrallm.api import keys, schemas, service, usage
from corrallm.config.names import public_name
from corrallm.gateway import Gateway
from corrallm.http.errors import ApiError

_TYPES: dict[type[BaseModel], type] = {}

# An integer that may pass 2^31 (GraphQL's Int is 32-bit): sizes in bytes. Mapped to its
# scalar in the schema's config (`scalar_map`; a class passed to `strawberry.scalar` is
# deprecated).
BigInt = typing.NewType("BigInt", int)
_BIG_INT = strawberry.scalar(
    name="BigInt",
    description="An integer that may pass 2^31 (GraphQL's Int is 32-bit): sizes in bytes.",
    serialize=int,
    parse_value=int,
)


def _gql(model: type[BaseModel]) -> type:
    """The Strawberry type of a response model (its nested models first)."""
    if model in _TYPES:
        return _TYPES[model]
    overrides: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        for inner in _models_in(field.annotation):
            _gql(inner)
        if typing.get_origin(field.annotation) is dict or _is_optional_dict(field.annotation):
            overrides[name] = JSON | None if _is_optional_dict(field.annotation) else JSON
        elif schemas.WIDE in field.metadata:
            overrides[name] = BigInt
    namespace = {"__annotations__": overrides}
    name = public_name(model)
    cls = sp.type(model=model, all_fields=True, name=name)(type(name, (), namespace))
    _TYPES[model] = cls
    return cls


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) is dict:
        return []
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _is_optional_dict(annotation: Any) -> bool:
    args = typing.get_args(annotation)
    return type(None) in args and any(typing.get_origin(a) is dict for a in args)


def build(model: type[BaseModel], data: BaseModel | dict[str, Any]) -> Any:
    """A service's view as the Strawberry object of `model`'s GraphQL type. A plain dict
    is read as the view first, as REST would read it (its declared defaults; a missing
    field is an error): GraphQL fills nothing in of its own."""
    if isinstance(data, model):
        return _strawberry(model, data, None)
    return _strawberry(model, model.model_validate(data), data)


def _strawberry(model: type[BaseModel], view: BaseModel, raw: Any) -> Any:
    """`raw`: the service's dict the view was read from, if any; a map-valued field (a JSON
    scalar) passes on what the service gave, as before views were typed."""
    cls = _gql(model)
    values = {}
    for name, field in model.model_fields.items():
        value = getattr(view, name)
        given = raw.get(name) if isinstance(raw, dict) else None
        inner = _models_in(field.annotation)
        if typing.get_origin(field.annotation) is dict or _is_optional_dict(field.annotation):
            value = given if isinstance(raw, dict) and name in raw else _plain(value)
        elif inner and value is not None:
            if isinstance(value, list):
                givens = given if isinstance(given, list) else [None] * len(value)
                value = [
                    _strawberry(_model_of(v, inner), v, g)
                    for v, g in zip(value, givens, strict=True)
                ]
            else:
                value = _strawberry(_model_of(value, inner), value, given)
        values[name] = value
    return cls(**values)


def _model_of(value: BaseModel, candidates: list[type[BaseModel]]) -> type[BaseModel]:
    return next((m for m in candidates if isinstance(value, m)), candidates[0])


def _plain(value: Any) -> Any:
    """A JSON scalar's value from a typed view: nested views as plain dicts."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class GraphQLApiRefusal(Exception):
    """A service's refusal, with the same words and code as REST gives it."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.extensions = {"code": error.code, "status": error.status}


def _gw(info: Info) -> Gateway:
    gateway: Gateway = info.context["gateway"]
    return gateway


async def _call(model: type[BaseModel], coro_or_value: Any) -> Any:
    try:
        value = await coro_or_value if hasattr(coro_or_value, "__await__") else coro_or_value
    except ApiError as exc:
        raise GraphQLApiRefusal(exc) from exc
    return build(model, value)


def _sync(model: type[BaseModel], fn: Any, *args: Any) -> Any:
    try:
        return build(model, fn(*args))
    except ApiError as exc:
        raise GraphQLApiRefusal(exc) from exc


Overview = _gql(schemas.Overview)
Residency = _gql(schemas.ResidencyView)
Lanes = _gql(schemas.Lanes)
Reservations = _gql(schemas.ReservationsView)
Economics = _gql(schemas.EconomicsView)
LiveRequests = _gql(schemas.LiveRequestsView)
CancelResult = _gql(schemas.CancelResult)
ReloadResult = _gql(schemas.ReloadResult)
Logs = _gql(schemas.Logs)
ActionResult = _gql(schemas.ActionResult)
PauseResult = _gql(schemas.PauseResult)
UsageByKey = _gql(schemas.UsageByKey)
UsageByUser = _gql(schemas.UsageByUser)
UsageRollup = _gql(schemas.UsageRollup)
UsageSeries = _gql(schemas.UsageSeries)
UsageGroupSeries = _gql(schemas.UsageGroupSeries)
QueueDepth = _gql(schemas.QueueDepth)
ActivityList = _gql(schemas.ActivityList)
# captures (SPEC §21 O2)
CaptureList = _gql(schemas.CaptureList)
CaptureRecord = _gql(schemas.CaptureRecord)
# keys (SPEC §22 T2)
Keys = _gql(schemas.Keys)
KeyWithSecret = _gql(schemas.KeyWithSecret)
KeyRevoked = _gql(schemas.KeyRevoked)


# -- resolvers: typed functions; the fields below give each its GraphQL type -------------


def _overview(info: Info) -> Any:
    return _sync(schemas.Overview, service.overview, _gw(info))


def _residency(info: Info) -> Any:
    return _sync(schemas.ResidencyView, service.residency, _gw(info))


def _lanes(info: Info) -> Any:
    return _sync(schemas.Lanes, service.lanes, _gw(info))


def _reservations(info: Info) -> Any:
    return _sync(schemas.ReservationsView, service.reservations, _gw(info))


def _economics(info: Info) -> Any:
    return _sync(schemas.EconomicsView, service.economics, _gw(info))


def _live_requests(info: Info) -> Any:
    return _sync(schemas.LiveRequestsView, service.live_requests, _gw(info))


def _cancel_request(info: Info, id: str) -> Any:
    return _sync(schemas.CancelResult, service.cancel_request, _gw(info), id)


def _model_logs(info: Info, model: str, lines: int = 100) -> Any:
    return _sync(schemas.Logs, service.model_logs, _gw(info), model, lines)


async def _usage_by_key(info: Info, since: str | None = None, until: str | None = None) -> Any:
    return await _call(schemas.UsageByKey, usage.usage_by_key(_gw(info), since, until))


async def _usage_by_user(info: Info, since: str | None = None, until: str | None = None) -> Any:
    return await _call(schemas.UsageByUser, usage.usage_by_user(_gw(info), since, until))


async def _usage_rollup(info: Info, since: str | None = None, until: str | None = None) -> Any:
    return await _call(schemas.UsageRollup, usage.usage_rollup(_gw(info), since, until))


async def _usage_series(
    info: Info, since: str | None = None, until: str | None = None, bucket: str | None = None
) -> Any:
    call = usage.usage_series(_gw(info), since, until, bucket)
    return await _call(schemas.UsageSeries, call)


async def _usage_series_by_group(
    info: Info, since: str | None = None, until: str | None = None, bucket: str | None = None
) -> Any:
    call = usage.usage_series(_gw(info), since, until, bucket, by_group=True)
    return await _call(schemas.UsageGroupSeries, call)


async def _queue_depth(
    info: Info, since: str | None = None, until: str | None = None, bucket: str | None = None
) -> Any:
    call = usage.queue_depth(_gw(info), since, until, bucket)
    return await _call(schemas.QueueDepth, call)


async def _activity(
    info: Info,
    limit: int = 100,
    key: str | None = None,
    model: str | None = None,
    group: str | None = None,
    since: str | None = None,
    until: str | None = None,
    user: str | None = None,
) -> Any:
    call = usage.activity(_gw(info), limit, key, model, group, since, until, user)
    return await _call(schemas.ActivityList, call)


# captures (SPEC §21 O2)


def _captures(
    info: Info, limit: int = 100, model: str | None = None, status: str | None = None
) -> Any:
    limit = max(1, min(limit, service.MAX_CAPTURES))
    return _sync(schemas.CaptureList, service.captures, _gw(info), limit, model, status)


def _capture(info: Info, request_id: str) -> Any:
    return _sync(schemas.CaptureRecord, service.capture, _gw(info), request_id)


# keys (SPEC §22 T2)


def _keys(info: Info) -> Any:
    return _sync(schemas.Keys, keys.list_keys, _gw(info))


async def _create_key(
    info: Info,
    name: str,
    group: str,
    models: list[str] | None = None,
    limits: JSON | None = None,
    spend_limit: JSON | None = None,
    expires: str | None = None,
    trust_user_header: bool | None = None,
) -> Any:
    given = {
        "models": models,
        "limits": limits,
        "spendLimit": spend_limit,
        "expires": expires,
        "trustUserHeader": trust_user_header,
    }
    fields = {"name": name, "group": group, **{k: v for k, v in given.items() if v is not None}}
    return await _call(schemas.KeyWithSecret, keys.create_key(_gw(info), fields))


async def _rotate_key(info: Info, name: str) -> Any:
    return await _call(schemas.KeyWithSecret, keys.rotate_key(_gw(info), name))


async def _revoke_key(info: Info, name: str) -> Any:
    return await _call(schemas.KeyRevoked, keys.revoke_key(_gw(info), name))


async def _reload_config(info: Info) -> Any:
    return await _call(schemas.ReloadResult, service.reload_config(_gw(info)))


async def _load_model(info: Info, model: str) -> Any:
    return await _call(schemas.ActionResult, service.load_model(_gw(info), model))


async def _unload_model(info: Info, model: str, force: bool = False) -> Any:
    return await _call(schemas.ActionResult, service.unload_model(_gw(info), model, force))


async def _pause_model(info: Info, model: str, until: str | None = None) -> Any:
    return await _call(schemas.PauseResult, service.pause(_gw(info), "model", model, until))


async def _unpause_model(info: Info, model: str) -> Any:
    return await _call(schemas.PauseResult, service.unpause(_gw(info), "model", model))


async def _load_extension(info: Info, extension: str) -> Any:
    return await _call(schemas.ActionResult, service.load_extension(_gw(info), extension))


async def _unload_extension(info: Info, extension: str, force: bool = False) -> Any:
    call = service.unload_extension(_gw(info), extension, force)
    return await _call(schemas.ActionResult, call)


async def _pause_extension(info: Info, extension: str, until: str | None = None) -> Any:
    call = service.pause(_gw(info), "extension", extension, until)
    return await _call(schemas.PauseResult, call)


async def _unpause_extension(info: Info, extension: str) -> Any:
    call = service.unpause(_gw(info), "extension", extension)
    return await _call(schemas.PauseResult, call)


@strawberry.type
class Query:
    overview = strawberry.field(
        resolver=_overview, graphql_type=Overview, description="GET /api/v1/overview"
    )
    residency = strawberry.field(
        resolver=_residency, graphql_type=Residency, description="GET /api/v1/residency"
    )
    lanes = strawberry.field(resolver=_lanes, graphql_type=Lanes, description="GET /api/v1/lanes")
    reservations = strawberry.field(
        resolver=_reservations, graphql_type=Reservations, description="GET /api/v1/reservations"
    )
    economics = strawberry.field(
        resolver=_economics, graphql_type=Economics, description="GET /api/v1/economics"
    )
    requests = strawberry.field(
        resolver=_live_requests, graphql_type=LiveRequests, description="GET /api/v1/requests"
    )
    model_logs = strawberry.field(
        resolver=_model_logs, graphql_type=Logs, description="GET /api/v1/models/logs"
    )
    usage_by_key = strawberry.field(
        resolver=_usage_by_key, graphql_type=UsageByKey, description="GET /api/v1/usage/by-key"
    )
    usage_by_user = strawberry.field(
        resolver=_usage_by_user, graphql_type=UsageByUser, description="GET /api/v1/usage/by-user"
    )
    usage_rollup = strawberry.field(
        resolver=_usage_rollup, graphql_type=UsageRollup, description="GET /api/v1/usage/rollup"
    )
    usage_series = strawberry.field(
        resolver=_usage_series, graphql_type=UsageSeries, description="GET /api/v1/usage/series"
    )
    usage_series_by_group = strawberry.field(
        resolver=_usage_series_by_group,
        graphql_type=UsageGroupSeries,
        description="GET /api/v1/usage/series-by-group",
    )
    queue_depth = strawberry.field(
        resolver=_queue_depth, graphql_type=QueueDepth, description="GET /api/v1/usage/queue-depth"
    )
    activity = strawberry.field(
        resolver=_activity, graphql_type=ActivityList, description="GET /api/v1/activity"
    )
    # captures (SPEC §21 O2)
    captures = strawberry.field(
        resolver=_captures, graphql_type=CaptureList, description="GET /api/v1/captures"
    )
    capture = strawberry.field(
        resolver=_capture,
        graphql_type=CaptureRecord,
        description="GET /api/v1/captures/{request_id}",
    )
    # keys (SPEC §22 T2)
    keys = strawberry.field(resolver=_keys, graphql_type=Keys, description="GET /api/v1/keys")


@strawberry.type
class Mutation:
    cancel_request = strawberry.mutation(
        resolver=_cancel_request,
        graphql_type=CancelResult,
        description="POST /api/v1/requests/{request_id}/cancel",
    )
    reload_config = strawberry.mutation(
        resolver=_reload_config, graphql_type=ReloadResult, description="POST /api/v1/config/reload"
    )
    load_model = strawberry.mutation(
        resolver=_load_model, graphql_type=ActionResult, description="POST /api/v1/models/load"
    )
    unload_model = strawberry.mutation(
        resolver=_unload_model, graphql_type=ActionResult, description="POST /api/v1/models/unload"
    )
    pause_model = strawberry.mutation(
        resolver=_pause_model, graphql_type=PauseResult, description="POST /api/v1/models/pause"
    )
    unpause_model = strawberry.mutation(
        resolver=_unpause_model,
        graphql_type=PauseResult,
        description="POST /api/v1/models/unpause",
    )
    load_extension = strawberry.mutation(
        resolver=_load_extension,
        graphql_type=ActionResult,
        description="POST /api/v1/extensions/load",
    )
    unload_extension = strawberry.mutation(
        resolver=_unload_extension,
        graphql_type=ActionResult,
        description="POST /api/v1/extensions/unload",
    )
    pause_extension = strawberry.mutation(
        resolver=_pause_extension,
        graphql_type=PauseResult,
        description="POST /api/v1/extensions/pause",
    )
    unpause_extension = strawberry.mutation(
        resolver=_unpause_extension,
        graphql_type=PauseResult,
        description="POST /api/v1/extensions/unpause",
    )
    # keys (SPEC §22 T2)
    create_key = strawberry.mutation(
        resolver=_create_key, graphql_type=KeyWithSecret, description="POST /api/v1/keys"
    )
    rotate_key = strawberry.mutation(
        resolver=_rotate_key,
        graphql_type=KeyWithSecret,
        description="POST /api/v1/keys/{name}/rotate",
    )
    revoke_key = strawberry.mutation(
        resolver=_revoke_key, graphql_type=KeyRevoked, description="DELETE /api/v1/keys/{name}"
    )


SCHEMA = strawberry.Schema(
    query=Query, mutation=Mutation, config=StrawberryConfig(scalar_map={BigInt: _BIG_INT})
)


def sdl() -> str:
    return SCHEMA.as_str()


class _App(GraphQL[dict[str, Any], None]):
    def __init__(self, gateway: Gateway) -> None:
        super().__init__(SCHEMA, graphql_ide=None)
        self.gateway = gateway

    async def get_context(self, request: Any, response: Any) -> dict[str, Any]:
        return {"gateway": self.gateway, "request": request, "response": response}


def build_graphql(gateway: Gateway) -> _App:
    return _App(gateway)
