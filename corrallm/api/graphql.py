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
from strawberry.types import Info

from corrallm.api import schemas, service, usage
from corrallm.gateway import Gateway
from corrallm.proxy.errors import ApiError

_TYPES: dict[type[BaseModel], type] = {}


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
    namespace = {"__annotations__": overrides}
    cls = sp.type(model=model, all_fields=True, name=model.__name__)(
        type(model.__name__, (), namespace)
    )
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


def build(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """A service dict as the Strawberry object of `model`'s GraphQL type."""
    cls = _gql(model)
    values = {}
    for name, field in model.model_fields.items():
        value = data.get(name, field.default)
        inner = _models_in(field.annotation)
        if inner and typing.get_origin(field.annotation) is not dict and value is not None:
            if isinstance(value, list):
                value = [build(inner[0], v) for v in value]
            else:
                value = build(inner[0], value)
        values[name] = value
    return cls(**values)


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
Residency = _gql(schemas.Residency)
Lanes = _gql(schemas.Lanes)
Reservations = _gql(schemas.Reservations)
ReloadResult = _gql(schemas.ReloadResult)
Logs = _gql(schemas.Logs)
ActionResult = _gql(schemas.ActionResult)
PauseResult = _gql(schemas.PauseResult)
UsageByKey = _gql(schemas.UsageByKey)
UsageRollup = _gql(schemas.UsageRollup)
UsageSeries = _gql(schemas.UsageSeries)
UsageGroupSeries = _gql(schemas.UsageGroupSeries)
QueueDepth = _gql(schemas.QueueDepth)
ActivityList = _gql(schemas.ActivityList)


@strawberry.type
class Query:
    @strawberry.field(description="GET /api/v1/overview")
    def overview(self, info: Info) -> Overview:  # type: ignore[valid-type]
        return _sync(schemas.Overview, service.overview, _gw(info))

    @strawberry.field(description="GET /api/v1/residency")
    def residency(self, info: Info) -> Residency:  # type: ignore[valid-type]
        return _sync(schemas.Residency, service.residency, _gw(info))

    @strawberry.field(description="GET /api/v1/lanes")
    def lanes(self, info: Info) -> Lanes:  # type: ignore[valid-type]
        return _sync(schemas.Lanes, service.lanes, _gw(info))

    @strawberry.field(description="GET /api/v1/reservations")
    def reservations(self, info: Info) -> Reservations:  # type: ignore[valid-type]
        return _sync(schemas.Reservations, service.reservations, _gw(info))

    @strawberry.field(description="GET /api/v1/models/logs")
    def model_logs(self, info: Info, model: str, lines: int = 100) -> Logs:  # type: ignore[valid-type]
        return _sync(schemas.Logs, service.model_logs, _gw(info), model, lines)

    @strawberry.field(description="GET /api/v1/usage/by-key")
    async def usage_by_key(
        self, info: Info, since: str | None = None, until: str | None = None
    ) -> UsageByKey:  # type: ignore[valid-type]
        return await _call(schemas.UsageByKey, usage.usage_by_key(_gw(info), since, until))

    @strawberry.field(description="GET /api/v1/usage/rollup")
    async def usage_rollup(
        self, info: Info, since: str | None = None, until: str | None = None
    ) -> UsageRollup:  # type: ignore[valid-type]
        return await _call(schemas.UsageRollup, usage.usage_rollup(_gw(info), since, until))

    @strawberry.field(description="GET /api/v1/usage/series")
    async def usage_series(
        self,
        info: Info,
        since: str | None = None,
        until: str | None = None,
        bucket: str | None = None,
    ) -> UsageSeries:  # type: ignore[valid-type]
        call = usage.usage_series(_gw(info), since, until, bucket)
        return await _call(schemas.UsageSeries, call)

    @strawberry.field(description="GET /api/v1/usage/series-by-group")
    async def usage_series_by_group(
        self,
        info: Info,
        since: str | None = None,
        until: str | None = None,
        bucket: str | None = None,
    ) -> UsageGroupSeries:  # type: ignore[valid-type]
        call = usage.usage_series(_gw(info), since, until, bucket, by_group=True)
        return await _call(schemas.UsageGroupSeries, call)

    @strawberry.field(description="GET /api/v1/usage/queue-depth")
    async def queue_depth(
        self,
        info: Info,
        since: str | None = None,
        until: str | None = None,
        bucket: str | None = None,
    ) -> QueueDepth:  # type: ignore[valid-type]
        call = usage.queue_depth(_gw(info), since, until, bucket)
        return await _call(schemas.QueueDepth, call)

    @strawberry.field(description="GET /api/v1/activity")
    async def activity(
        self,
        info: Info,
        limit: int = 100,
        key: str | None = None,
        model: str | None = None,
        group: str | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> ActivityList:  # type: ignore[valid-type]
        call = usage.activity(_gw(info), limit, key, model, group, since, until)
        return await _call(schemas.ActivityList, call)


@strawberry.type
class Mutation:
    @strawberry.mutation(description="POST /api/v1/config/reload")
    async def reload_config(self, info: Info) -> ReloadResult:  # type: ignore[valid-type]
        return await _call(schemas.ReloadResult, service.reload_config(_gw(info)))

    @strawberry.mutation(description="POST /api/v1/models/load")
    async def load_model(self, info: Info, model: str) -> ActionResult:  # type: ignore[valid-type]
        return await _call(schemas.ActionResult, service.load_model(_gw(info), model))

    @strawberry.mutation(description="POST /api/v1/models/unload")
    async def unload_model(self, info: Info, model: str, force: bool = False) -> ActionResult:  # type: ignore[valid-type]
        return await _call(schemas.ActionResult, service.unload_model(_gw(info), model, force))

    @strawberry.mutation(description="POST /api/v1/models/pause")
    async def pause_model(self, info: Info, model: str, until: str | None = None) -> PauseResult:  # type: ignore[valid-type]
        return await _call(schemas.PauseResult, service.pause(_gw(info), "model", model, until))

    @strawberry.mutation(description="POST /api/v1/models/unpause")
    async def unpause_model(self, info: Info, model: str) -> PauseResult:  # type: ignore[valid-type]
        return await _call(schemas.PauseResult, service.unpause(_gw(info), "model", model))

    @strawberry.mutation(description="POST /api/v1/extensions/load")
    async def load_extension(self, info: Info, extension: str) -> ActionResult:  # type: ignore[valid-type]
        return await _call(schemas.ActionResult, service.load_extension(_gw(info), extension))

    @strawberry.mutation(description="POST /api/v1/extensions/unload")
    async def unload_extension(
        self, info: Info, extension: str, force: bool = False
    ) -> ActionResult:  # type: ignore[valid-type]
        call = service.unload_extension(_gw(info), extension, force)
        return await _call(schemas.ActionResult, call)

    @strawberry.mutation(description="POST /api/v1/extensions/pause")
    async def pause_extension(
        self, info: Info, extension: str, until: str | None = None
    ) -> PauseResult:  # type: ignore[valid-type]
        call = service.pause(_gw(info), "extension", extension, until)
        return await _call(schemas.PauseResult, call)

    @strawberry.mutation(description="POST /api/v1/extensions/unpause")
    async def unpause_extension(self, info: Info, extension: str) -> PauseResult:  # type: ignore[valid-type]
        call = service.unpause(_gw(info), "extension", extension)
        return await _call(schemas.PauseResult, call)


SCHEMA = strawberry.Schema(query=Query, mutation=Mutation)


def sdl() -> str:
    return SCHEMA.as_str()


class _App(GraphQL):  # type: ignore[type-arg]
    def __init__(self, gateway: Gateway) -> None:
        super().__init__(SCHEMA, graphql_ide=None)
        self.gateway = gateway

    async def get_context(self, request: Any, response: Any) -> dict[str, Any]:
        return {"gateway": self.gateway, "request": request, "response": response}


def build_graphql(gateway: Gateway) -> _App:
    return _App(gateway)
