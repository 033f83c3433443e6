"""Request and response shapes of the management REST API (SPEC §14), for validation and
for the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from corrallm.config.schema import KeyPolicy


class Wide:
    """Marks an integer that may pass 2^31 (sizes in bytes): GraphQL's `Int` is 32-bit, so
    its GraphQL type is `BigInt` (api/graphql.py); REST and OpenAPI see a plain integer."""


WIDE = Wide()
Bytes = Annotated[int, WIDE]


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
    sleeps: bool = Field(
        description="it has a `sleep` config: idle ttl and eviction may put it to sleep (W1)"
    )
    peer: str | None = Field(
        None, description="the peer node serving it (`<model>@<peer>`, SPEC §19 X1); null: local"
    )
    modes: list[str] = Field(default_factory=list, description="STT surfaces it serves (U3)")
    service_seconds: float | None = Field(
        None, description="how long a request holds a slot here, on average (X2); null: none yet"
    )
    load_seconds: float | None = Field(
        None, description="how long its last start took; null: never started here"
    )


class ModelView(BaseModel):
    name: str
    aliases: list[str]
    state: str
    paused: bool
    paused_until: str | None
    persistent: bool
    ttl_seconds: float | None = Field(None, description="sticky.ttl: idle time before unload")
    backends: list[BackendView]


class PoolView(BaseModel):
    capacity: int
    reserve: int
    used: int


class ServerView(BaseModel):
    name: str
    pools: dict[str, PoolView]


class PeerBackendView(BaseModel):
    id: str
    state: str
    in_flight: int


class PeerModelView(BaseModel):
    name: str
    backend: str = Field(description="its backend here: <model>@<peer>")
    state: str = Field(description="the best state among its backends on the peer")
    capacity: int
    in_flight: int
    waiting: int
    backends: list[PeerBackendView]


class PeerNodeView(BaseModel):
    name: str
    url: str
    state: str = Field(description="up or down")
    error: str | None = Field(description="why it is down; null while up")
    models: list[PeerModelView]


class Overview(BaseModel):
    models: list[ModelView]
    servers: list[ServerView]
    peers: list[PeerNodeView] = Field(
        default_factory=list, description="the other nodes this gateway serves (SPEC §19 X4)"
    )


Footprint = dict[str, int]  # bytes per pool


class ResidentView(BaseModel):
    backend: str
    state: str
    pid: int | None = Field(description="the backend's process; null while it has none")
    ram_usage: Footprint = Field(
        description="bytes per pool that planning counts now (SPEC §17 M2): the declared "
        "footprint, else the estimate, raised per pool to measured x 1.05; a backend placed on "
        "one of the server's `gpus` counts its `gpu` part on that pool"
    )
    declared: Footprint | None = Field(
        description="ramUsage as the config declares it (may name `gpu`); null when auto or omitted"
    )
    estimated: Footprint | None = Field(
        description="estimated from the model file (ramUsage auto or omitted); null otherwise"
    )
    measured: Footprint | None = Field(
        description="what the process held after its last load (RSS for `system`, NVML for "
        "GPU pools), or what an earlier run learned for the same backend and cmd; null until "
        "measured"
    )
    sleep_usage: Footprint | None = Field(
        description="what it holds asleep (sleepUsage, SPEC §18 W1; null when it cannot "
        "sleep): ram_usage while asleep, and while waking until room is made for it"
    )
    gpu: str | None = Field(
        description="the GPU pool it was placed on (SPEC §17 M3); null when it asks for no `gpu`"
    )
    in_flight: int
    last_used: str | None
    ttl_expires_at: str | None
    evict_cost: str
    pinned: bool


class ServerResidency(BaseModel):
    name: str
    residents: list[ResidentView]


class PeerResident(BaseModel):
    backend: str = Field(description="<model>@<peer>")
    state: str
    in_flight: int


class PeerResidency(BaseModel):
    name: str
    state: str = Field(description="up or down")
    backends: list[PeerResident]


class ResidencyView(BaseModel):
    model_config = ConfigDict(title="Residency")  # its name in schemas, GraphQL and docs
    servers: list[ServerResidency]
    peers: list[PeerResidency] = Field(
        default_factory=list,
        description="each peer's models as it reports them (its pools are its own to plan)",
    )


class LaneView(BaseModel):
    name: str
    weight: float
    interruptible: bool
    share_currency: str
    in_flight: int
    waiting: int
    usage_share: float = Field(description="share of decayed usage, in its currency, 0..1")
    spend_usd_window: float = Field(description="spend inside its spendLimit window; 0 without")


class Lanes(BaseModel):
    lanes: list[LaneView]


# -- usage and activity (SPEC §14) ------------------------------------------------------


class UsageSums(BaseModel):
    requests: int = Field(description="requests made (load rows not counted)")
    prompt_tokens: int
    completion_tokens: int
    bytes: int = Field(description="audio bytes metered instead of tokens")
    energy_wh: float = Field(description="requests' and backend loads' energy, Wh")
    cost_usd: float = Field(description="requests' and backend loads' cost, USD")
    dwell_ms_avg: float | None = Field(description="mean queue wait; null without requests")


class Ranged(BaseModel):
    since: str = Field(description="start of the range (inclusive), RFC 3339")
    until: str = Field(description="end of the range (exclusive), RFC 3339")


class KeyUsage(UsageSums):
    key: str | None = Field(description="the configured key name; null: no key")
    group: str


class UsageByKey(Ranged):
    rows: list[KeyUsage]


class UserUsage(UsageSums):
    user: str = Field(
        description="the user a key with trustUserHeader named in auth.userHeader (T4)"
    )
    key: str | None = Field(description="the key that named the user")


class UsageByUser(Ranged):
    rows: list[UserUsage] = Field(description="one per (user, key); rows without a user left out")


class ModelUsage(UsageSums):
    group: str
    model: str


class UsageRollup(Ranged):
    rows: list[ModelUsage]


class SeriesPoint(UsageSums):
    t: str = Field(description="start of the bucket, RFC 3339")


class GroupSeriesPoint(SeriesPoint):
    group: str


class UsageSeries(Ranged):
    bucket_seconds: int
    points: list[SeriesPoint]


class UsageGroupSeries(Ranged):
    bucket_seconds: int
    points: list[GroupSeriesPoint]


class QueuePoint(BaseModel):
    t: str = Field(description="start of the bucket, RFC 3339")
    backend: str
    waiting: int = Field(description="most requests waiting in one sample of the bucket")
    in_flight: int = Field(description="most requests in flight in one sample of the bucket")


class QueueDepth(Ranged):
    bucket_seconds: int
    points: list[QueuePoint]


class ActivityRow(BaseModel):
    id: int
    t: str = Field(description="when the request arrived (or the load began), RFC 3339")
    kind: str = Field(description="request | load")
    key: str | None
    user: str | None = Field(
        None, description="the user behind the key (auth.userHeader, T4); null: none named"
    )
    group: str
    model: str
    backend: str | None
    endpoint: str
    status: int
    dwell_ms: float
    duration_ms: float
    ttfb_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    bytes: int
    energy_wh: float
    cost_usd: float
    estimated: bool = Field(description="token counts estimated: the backend reported none")
    degraded: bool
    spilled: bool
    preempted: bool
    error: str | None = Field(
        description="what went wrong, `code: message` (e.g. `cancelled: …` for a request an "
        "operator cancelled)"
    )
    request_id: str | None = Field(
        None,
        description="the request's X-Corrallm-Request-Id (SPEC §21 O1); null for load rows",
    )


class ActivityList(Ranged):
    rows: list[ActivityRow]


class ReservationView(BaseModel):
    model: str
    backend: str
    lane: str
    key: str = Field(description="the name of the key that holds it (SPEC §22 T5)")
    slots: int
    expires_at: str


class ReservationsView(BaseModel):
    model_config = ConfigDict(title="Reservations")  # its name in schemas, GraphQL and docs
    reservations: list[ReservationView]


# -- the economics ledger (SPEC §14, §11 D1) ----------------------------------------------


class LiveRequestView(BaseModel):
    id: str = Field(description="X-Corrallm-Request-Id of the request")
    key: str | None = Field(description="the caller's configured key name, or null")
    user: str | None = Field(
        None, description="the user behind the key (auth.userHeader, T4); null: none named"
    )
    group: str
    model: str
    backend: str | None = Field(description="the backend it was admitted to; null while queued")
    endpoint: str
    state: str = Field(
        description="queued (for a slot) | loading (its backend starting or waking) | running"
    )
    age_ms: float = Field(description="since it arrived")
    stream: bool
    completion_tokens: int = Field(
        description="tokens so far, counted from the relayed stream's events (0 until a "
        "non-streamed answer is whole)"
    )


class LiveRequestsView(BaseModel):
    model_config = ConfigDict(title="LiveRequests")  # its name in schemas, GraphQL and docs
    requests: list[LiveRequestView]


class CancelResult(BaseModel):
    id: str
    state: str = Field(description="where it was when the cancel was asked")
    cancelled: bool


class EconomicsRow(BaseModel):
    backend: str
    asleep_now: bool = Field(
        description="stopped, paused, failed or asleep (W1): its memory handed back"
    )
    wakes: int = Field(description="starts and wakes (W1) that reached ready")
    sleeps: int = Field(
        description="stops and sleeps (W1) after a wake (failed starts are not counted)"
    )
    asleep_seconds: float
    wake_count: int = Field(description="wakes with a measured load time")
    wake_seconds_last: float | None
    wake_seconds_avg: float | None
    wake_seconds_max: float | None
    gpu_footprint: Bytes = Field(description="bytes it declares in pools named gpu*")
    gpu_hours: float = Field(
        description="hours asleep x GPU bytes handed back (the footprint, less a real sleep's "
        "sleepUsage in gpu* pools) / total GPU capacity"
    )
    first_seen: str = Field(description="when counting began for it, RFC 3339")


class EconomicsView(BaseModel):
    model_config = ConfigDict(title="Economics")  # its name in schemas, GraphQL and docs
    since: str = Field(description="when counting began (the earliest row's), RFC 3339")
    gpu_capacity: Bytes = Field(description="bytes in all servers' pools named gpu*")
    gpu_hours: float = Field(description="GPU-hours returned to the pool, all rows")
    gpu_hour_price: float | None = Field(description="ledger.gpuHourPrice; null: not set")
    avoided_usd: float | None = Field(description="gpu_hours x gpu_hour_price; null: no price")
    rows: list[EconomicsRow] = Field(description="one per backend of the config in force")


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: str = Field(description="what went wrong and what to do about it")
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error, OpenAI-shaped."""

    error: ErrorDetail


ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody, "description": why}
    for status, why in {
        400: "invalid input; the message names every problem",
        401: "missing or wrong admin token",
        404: "no such model, extension or endpoint",
        409: "another lifecycle action is under way on that process",
        423: "paused: unpause it first",
        500: "corrallm hit an unexpected error; the message carries the request id to find "
        "in the gateway log",
        502: "the backend failed to start or did not answer; the message carries its log",
        503: "no room could be made in the memory pools, or the store could not save a "
        "change (store_unavailable: nothing was changed)",
    }.items()
}


class ReloadResult(BaseModel):
    kept: list[str] = Field(description="backends whose process kept running")
    restarted: list[str] = Field(description="changed: drained, stopped, started on demand")
    removed: list[str] = Field(description="drained and stopped")
    added: list[str] = Field(description="available at once")


# -- captures (SPEC §21 O2) -------------------------------------------------------------


class CaptureSides(BaseModel):
    request: bool
    response: bool


class CaptureRow(BaseModel):
    request_id: str = Field(description="the request's X-Corrallm-Request-Id")
    t: str = Field(description="when the request arrived, RFC 3339")
    model: str | None = Field(description="as the request named it; null if it named none")
    backend: str | None = Field(description="the backend it was admitted to, or null")
    key: str | None = Field(description="the caller's key as the activity shows it, or null")
    user: str | None = Field(
        None, description="the user behind the key (auth.userHeader, T4); null: none named"
    )
    group: str | None
    endpoint: str
    status: int = Field(description="the outcome: a stream broken after its 200 head is 502")
    error: str | None = Field(description="what went wrong, `code: message`")
    truncated: CaptureSides = Field(description="which bodies were cut at 64 KB")
    request_bytes: int = Field(description="the whole request body's size, as received")
    response_bytes: int = Field(description="the whole response body's size, as sent")


class CaptureList(BaseModel):
    captures: list[CaptureRow] = Field(description="newest first; no bodies")
    bodies: str = Field(description="capture.bodies in force: errors | all | none")
    used_bytes: int = Field(description="bytes the kept captures hold")
    bound_bytes: int = Field(description="capture.bufferMB in bytes: used_bytes never passes it")


class CaptureHeaders(BaseModel):
    request: dict[str, str]
    response: dict[str, str]


class CaptureEncodings(BaseModel):
    request: str = Field(description="utf-8 (text as sent) | base64 (a body that is not UTF-8)")
    response: str


class CaptureRecord(CaptureRow):
    request: str = Field(description="the request body (first 64 KB), secrets redacted")
    response: str = Field(
        description="the response body (first 64 KB; a stream's events as relayed), secrets "
        "redacted"
    )
    encoding: CaptureEncodings
    headers: CaptureHeaders = Field(description="as text; credentials shown as [redacted]")


# -- keys made at runtime (SPEC §22 T2) ---------------------------------------------------

KEY_NAME = r"^[A-Za-z0-9._@-]{1,64}$"  # as the config's named keys (config/validation.py)


class KeyCreate(KeyPolicy):
    """`POST /api/v1/keys`: the policy fields are the config's named keys' (camelCase); the
    secret is corrallm's to make."""

    name: str = Field(pattern=KEY_NAME, description="1-64 letters, digits, '.', '-', '_', '@'")
    group: str = Field(description="a configured priority group, or scheduler.defaultGroup")


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its `$defs` written in place: what a body taken as a plain
    mapping (validated by the service, every problem at once) documents as its schema."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


KEY_CREATE_SCHEMA = _inline(KeyCreate.model_json_schema(by_alias=True))


class RateLimitsView(BaseModel):
    rpm: int | None = None
    tpm: int | None = None
    concurrent: int | None = None


class KeyLimitsView(RateLimitsView):
    per_user: RateLimitsView | None = Field(None, serialization_alias="perUser")


class SpendLimitView(BaseModel):
    usd: float
    window: float = Field(description="seconds")


class KeyFields(BaseModel):
    name: str = Field(description="what rows, views, events and metrics show")
    group: str | None = Field(description="its priority group; null: the default group")
    source: str = Field(description="config | api (made through this API)")
    prefix: str | None = Field(description="the secret's first 7 characters; null for config keys")
    models: list[str] = Field(description="allowlist globs; empty: every model")
    limits: KeyLimitsView | None
    spend_limit: SpendLimitView | None = Field(serialization_alias="spendLimit")
    expires: str | None = Field(description="as given: a date (valid through it, UTC) or a time")
    created: str | None = Field(description="RFC 3339; null for config keys")
    trust_user_header: bool = Field(serialization_alias="trustUserHeader")


class KeyView(KeyFields):
    last_used: str | None = Field(description="when a request of it last settled, RFC 3339")


class Keys(BaseModel):
    keys: list[KeyView] = Field(description="config keys (in config order), then the API's")


class KeyWithSecret(KeyFields):
    secret: str = Field(description="`ck-` and 43 URL-safe characters: shown this once")


class KeyRevoked(BaseModel):
    name: str
    revoked: bool
