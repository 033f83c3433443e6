"""Request and response shapes of the management REST API (SPEC §14), for validation and
for the OpenAPI document."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRef(Body):
    model: str = Field(min_length=1, examples=["my-chat"])


class ModelUnload(ModelRef):
    force: bool = Field(False, description="stop at once, cancelling requests in flight")


class ModelPause(ModelRef):
    until: str | float | None = Field(
        None,
        description="RFC 3339 time, or a duration from now (30m, 2h); absent: until unpaused",
        examples=["2026-12-01T08:00:00Z", "2h"],
    )


class ExtensionRef(Body):
    extension: str = Field(min_length=1, examples=["sherpa"])


class ExtensionUnload(ExtensionRef):
    force: bool = False


class ExtensionPause(ExtensionRef):
    until: str | float | None = None


class ActionResult(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    extension: str | None = None
    state: str | None = None


class PauseResult(BaseModel):
    model_config = ConfigDict(extra="allow")
    paused: bool
    paused_until: str | None


class Logs(BaseModel):
    model: str
    lines: list[str]
    n_ctx: int | None
    n_slots: int | None


class BackendView(BaseModel):
    id: str
    state: str
    server: str | None
    quality: int
    type: str
    max_concurrent: int
    in_flight: int
    waiting: int
    n_ctx: int | None
    n_slots: int | None
    pid: int | None
    extension: str | None
    last_error: str | None


class ModelView(BaseModel):
    name: str
    aliases: list[str]
    state: str
    paused: bool
    paused_until: str | None
    persistent: bool
    backends: list[BackendView]


class PoolView(BaseModel):
    capacity: int
    reserve: int
    used: int


class ServerView(BaseModel):
    name: str
    pools: dict[str, PoolView]


class Overview(BaseModel):
    models: list[ModelView]
    servers: list[ServerView]


class ResidentView(BaseModel):
    backend: str
    state: str
    ram_usage: dict[str, int]
    measured: dict[str, int] | None = Field(description="bytes NVML reports; null without NVML")
    in_flight: int
    last_used: str | None
    ttl_expires_at: str | None
    evict_cost: str
    pinned: bool


class ServerResidency(BaseModel):
    name: str
    residents: list[ResidentView]


class Residency(BaseModel):
    servers: list[ServerResidency]


class LaneView(BaseModel):
    name: str
    weight: float
    interruptible: bool
    share_currency: str
    in_flight: int
    waiting: int
    usage_share: float = Field(description="share of decayed usage, in its currency, 0..1")
    spend_usd_window: float = Field(description="spend in the spendLimit window (cost issue)")


class Lanes(BaseModel):
    lanes: list[LaneView]
