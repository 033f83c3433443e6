"""The whole `corrallm.yaml` schema (SPEC §2) as Pydantic models.

Field names are snake_case in Python and camelCase in YAML (the alias). Durations are
seconds (float) and sizes are bytes (int) once parsed. Cross-field rules (unknown
servers, pools, port clashes…) live in `validation.py` so that every problem is
reported at once with its YAML path.
"""

from __future__ import annotations

import hashlib
import math
import re
import shlex
from datetime import date, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from corrallm.config.units import parse_address, parse_duration, parse_size


def _finite(parse: Any) -> Any:
    # `.inf` and `.nan` are YAML floats; no duration or size is infinite.
    def check(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        return parse(value)

    return check


# The JSON Schema (for editors) must accept what the YAML accepts: `30s` as well as 30.
Duration = Annotated[
    float,
    BeforeValidator(_finite(parse_duration)),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": 0},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"},
            ],
            "description": "seconds, or 500ms / 30s / 5m / 2h / 30d",
        }
    ),
]
Size = Annotated[
    int,
    BeforeValidator(_finite(parse_size)),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([kmgtpKMGTP]?[iI]?[bB])?\s*$"},
            ],
            "description": "bytes, or 512MB / 1.5GB / 32GB / 1GiB",
        }
    ),
]


def _scalar_text(value: object) -> object:
    # `env: {CUDA_VISIBLE_DEVICES: 0}` means the text "0"; YAML booleans stay errors.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


# Values of `env` and `headers`: text, numbers accepted as their text.
Text = Annotated[
    str,
    BeforeValidator(_scalar_text),
    WithJsonSchema({"type": ["string", "number"]}),
]
ProxyTarget = Annotated[
    str | None,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": 65535},
                {"type": "string"},
                {"type": "null"},
            ],
            "description": "a port on 127.0.0.1 (5800), an http(s):// URL, or ${PORT}",
        }
    ),
]

PORT_PLACEHOLDER = "${PORT}"
GPU_PLACEHOLDER = "${GPU}"
# In `ramUsage`, the pool word that means "whichever of the server's `gpus` it is placed on".
ANY_GPU = "gpu"


def _ram_usage_kind(value: object) -> str:
    return "<auto>" if isinstance(value, str) else "<sizes>"


# A declared footprint, `auto` (estimate it from the model file), or None (omitted: `auto`
# where a llama-server cmd names a GGUF on a server with pools, else no room at all). The
# tags (`<…>`, dropped from error paths by the loader) keep a bad size reported once, at
# its own key, rather than once per union member.
RamUsage = (
    Annotated[
        Annotated[dict[str, Size], Tag("<sizes>")] | Annotated[Literal["auto"], Tag("<auto>")],
        Discriminator(_ram_usage_kind),
    ]
    | None
)


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
    )


class CommandCost(Section):
    """A cost class; a backend's `type` names one (SPEC §9 C1)."""

    generate_watts_per_token: float = Field(0.0, ge=0, description="Wh per generated token")
    process_watts_per_token: float = Field(0.0, ge=0, description="Wh per prompt token")
    modality: Literal["text", "audio"] = "text"
    process_watts_per_byte: float = Field(0.0, ge=0, description="Wh per audio byte in")
    generate_watts_per_byte: float = Field(0.0, ge=0, description="Wh per audio byte out")
    slot_watts: float = Field(
        0.0,
        ge=0,
        description="W charged per slot held in a /v1/reservations lease (at costPerKwh)",
    )
    paid: bool = False


class Server(Section):
    pools: dict[str, Size] = Field(default_factory=dict, description="capacity vector")
    reserve: dict[str, Size] = Field(default_factory=dict, description="never handed out")
    gpus: list[str] = Field(
        default_factory=list,
        description="interchangeable GPU pools; a backend asking for `gpu` runs on one of "
        "them (SPEC §17 M3)",
    )


class Health(Section):
    path: str = "/health"
    expect_status: list[int] = Field(default_factory=lambda: [200], min_length=1)
    interval: Duration = Field(
        10.0, gt=0, description="how often a ready backend is probed (SPEC §17 M4)"
    )
    failures: int = Field(
        3, ge=1, description="consecutive failed probes that mark a ready backend failed"
    )
    stall_timeout: Duration = Field(
        60.0,
        gt=0,
        description="a start fails once the backend has written nothing and its health "
        "answer has not changed for this long (SPEC §17 M5)",
    )
    start_timeout: Duration | None = Field(
        None, gt=0, description="hard cap on a start; overrides --health-timeout"
    )


class Swap(Section):
    load_seconds: float | None = Field(None, ge=0, description="expected load time")
    wake_seconds: float | None = Field(
        None, ge=0, description="expected wake time of a sleeping backend (SPEC §18 W1)"
    )
    load_watts: float = Field(0.0, ge=0, description="power drawn while loading")


class HttpCall(Section):
    """One HTTP call on the backend's own origin (a `sleep: {kind: http}` action)."""

    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    path: str = Field(pattern=r"^/", description="path (and query) on the backend's origin")


class VllmSleep(Section):
    """vLLM's sleep mode: POST /sleep?level=N, POST /wake_up, GET /is_sleeping (W1)."""

    kind: Literal["vllm"]
    level: Literal[1, 2] = Field(
        1, description="1: weights to CPU RAM, KV cache dropped; 2: both dropped"
    )


class HttpSleep(Section):
    """Any backend with a sleep and a wake call of its own (W1)."""

    kind: Literal["http"]
    sleep: HttpCall
    wake: HttpCall


def _sleep_kind(value: object) -> str | None:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return {"vllm": "<vllm>", "http": "<http>"}.get(kind) if isinstance(kind, str) else None


# The tags (`<…>`) are dropped from error paths by the loader, as for ramUsage.
SleepSpec = Annotated[
    Annotated[VllmSleep, Tag("<vllm>")] | Annotated[HttpSleep, Tag("<http>")],
    Discriminator(
        _sleep_kind,
        custom_error_type="sleep_kind",
        custom_error_message="sleep.kind must be vllm or http",
    ),
]


class Pricing(Section):
    input_per_million: float = Field(0.0, ge=0)
    output_per_million: float = Field(0.0, ge=0)
    per_slot_hour: float = Field(
        0.0, ge=0, description="$ per slot-hour held in a /v1/reservations lease"
    )


Supervision = Literal["process", "command", "docker", "systemd"]


class ProcessSpec(Section):
    """What it takes to run one backend process (a model backend or an extension)."""

    cmd: str | None = None
    proxy: ProxyTarget = Field(None, description="port on 127.0.0.1, URL, or ${PORT}")
    server: str | None = None
    ram_usage: RamUsage = Field(
        None,
        description="bytes per pool ({gpu0: 20GB, system: 4GB}; `gpu` for any of the "
        "server's `gpus`), or `auto`: estimated from the GGUF file of a llama-server `cmd`, "
        "which is also what an omitted ramUsage means there (SPEC §17 M1)",
    )
    swap: Swap = Field(default_factory=Swap)
    sleep: SleepSpec | None = Field(
        None, description="how the process sleeps instead of stopping (SPEC §18 W1)"
    )
    sleep_usage: dict[str, Size] = Field(
        default_factory=dict, description="what the process still holds asleep, per pool"
    )
    slot_save: bool = Field(
        False,
        description="save llama-server's slot caches before a stop and restore them after "
        "the next start (needs --slot-save-path in cmd; SPEC §18 W2)",
    )
    health: Health = Field(default_factory=Health)
    env: dict[str, Text] = Field(default_factory=dict)
    cwd: str | None = None
    stop: str | None = Field(None, description="stop command for supervision: command")
    supervision: Supervision = "process"
    docker_container: str | None = None
    systemd_unit: str | None = None
    stop_grace: Duration = 10.0

    @property
    def declared(self) -> dict[str, int] | None:
        """What the config declares per pool; None when ramUsage is `auto` or omitted."""
        return dict(self.ram_usage) if isinstance(self.ram_usage, dict) else None

    @model_validator(mode="before")
    @classmethod
    def _proxy_as_text(cls, data: object) -> object:
        # `proxy: 5800` is a port; keep every form as text and resolve it in one place.
        if isinstance(data, dict):
            proxy = data.get("proxy")
            if isinstance(proxy, int) and not isinstance(proxy, bool):
                data = {**data, "proxy": str(proxy)}
        return data


Api = Literal["openai", "anthropic", "responses"]


def _openai_only() -> list[Api]:
    return ["openai"]


class BackendTimeouts(Section):
    """A backend's own timeouts; each one unset falls back to the top-level `timeouts`."""

    upstream_idle: Duration | None = Field(
        None, gt=0, description="overrides timeouts.upstreamIdle for this backend"
    )


_PARALLEL_FLAGS = ("-np", "--parallel")


def llama_slots(cmd: str | None) -> tuple[str, int] | None:
    """The slots a llama-server `cmd` asks for with `-np N` / `--parallel N` (N >= 1):
    `(flag, N)`; None for another program, no such flag, or auto (-1)."""
    try:
        argv = shlex.split(cmd or "")
    except ValueError:
        return None
    name = argv[0].replace("\\", "/").rsplit("/", 1)[-1].lower() if argv else ""
    if name not in ("llama-server", "llama-server.exe"):
        return None
    found: tuple[str, int] | None = None
    for index, arg in enumerate(argv[1:], 1):
        flag, eq, value = arg.partition("=")
        if flag not in _PARALLEL_FLAGS:
            continue
        if not eq:
            value = argv[index + 1] if index + 1 < len(argv) else ""
        # The last one given wins, as in llama-server; -1 (auto) means no count here.
        found = (flag, int(value)) if value.isdigit() and int(value) >= 1 else None
    return found


class BackendConfig(ProcessSpec):
    model_config = ConfigDict(title="Backend")  # its name in schemas, GraphQL and docs
    name: str | None = None
    type: str = "chat"
    max_concurrent: int = Field(
        1,
        ge=1,
        description="slots: requests served at once; default: -np/--parallel of a "
        "llama-server cmd, else 1",
    )
    quality: int = 100
    max_tokens: int | None = Field(None, ge=1)
    model: str | None = Field(None, description="model name sent upstream")
    headers: dict[str, Text] = Field(default_factory=dict)
    pricing: Pricing | None = None
    cost_factor: float = Field(1.0, ge=0)
    modes: list[Literal["batch", "realtime"]] = Field(default_factory=list)
    diarization: bool = False
    extension: str | None = None
    timeouts: BackendTimeouts = Field(default_factory=BackendTimeouts)
    apis: list[Api] = Field(
        default_factory=_openai_only,
        description="dialects the backend speaks natively (SPEC §16 K1/K2); others are "
        "translated to and from Chat Completions",
    )
    context_length: int | None = Field(
        None,
        ge=1,
        description="context tokens per slot, shown in GET /v1/models until the process "
        "reports its own n_ctx (SPEC §16 K3)",
    )
    peer: str | None = Field(
        None,
        exclude=True,
        description="set by corrallm on the backends it imports from `peers` (X1); never "
        "written in a config",
        json_schema_extra={"readOnly": True},
    )

    @model_validator(mode="after")
    def _slots_from_cmd(self) -> BackendConfig:
        # Issue 30: a llama-server started with -np 4 has four slots; maxConcurrent left
        # out means them, not 1.
        if "max_concurrent" not in self.model_fields_set:
            slots = llama_slots(self.cmd)
            if slots is not None:
                object.__setattr__(self, "max_concurrent", slots[1])
        return self

    @property
    def slots_from(self) -> str | None:
        """Where maxConcurrent came from when the config does not say (`-np 4 in cmd`)."""
        if "max_concurrent" in self.model_fields_set:
            return None
        slots = llama_slots(self.cmd)
        return f"{slots[0]} {slots[1]} in cmd" if slots is not None else None


def backend_id(model_name: str, index: int, backend: BackendConfig) -> str:
    """A backend's id: its `name` if set, else `<model>#<index>` (SPEC §8 F1)."""
    return backend.name if backend.name else f"{model_name}#{index}"


class Extension(ProcessSpec):
    """One process hosting several models (SPEC §4 L8)."""


class Sticky(Section):
    ttl: Duration | None = None
    evict_cost: Literal["low", "medium", "high"] = "medium"


# Request parameters: any JSON value, as the caller would send it.
Params = dict[str, Any]


class Filters(Section):
    """What is done to a request's parameters after routing, before forwarding (SPEC §16
    K5): removed, forced, or filled in when the caller did not set them. `model` and
    `stream` are never touched (validation.py reports a filter naming them)."""

    strip_params: list[str] = Field(default_factory=list, description="removed")
    set_params: Params = Field(default_factory=dict, description="forced")
    default_params: Params = Field(
        default_factory=dict, description="filled in when the caller did not set them"
    )


def _alias_json_schema(schema: dict[str, Any]) -> None:
    # An alias is a name or an object carrying its own setParams (SPEC §16 K5).
    obj = dict(schema)
    schema.clear()
    schema["title"] = obj.pop("title", "Alias")
    schema["anyOf"] = [{"type": "string", "minLength": 1}, obj]


class Alias(Section):
    model_config = ConfigDict(json_schema_extra=_alias_json_schema)

    name: str = Field(min_length=1)
    set_params: Params = Field(
        default_factory=dict, description="forced for requests that name this alias"
    )

    @model_validator(mode="before")
    @classmethod
    def _plain_name(cls, data: object) -> object:
        # `aliases: [chat]` is shorthand for `aliases: [{name: chat}]`.
        if isinstance(data, str):
            return {"name": data}
        if not isinstance(data, dict):
            raise ValueError(
                "expected an alias name or a mapping such as "
                "{name: chat-creative, setParams: {temperature: 1.1}}"
            )
        return data


class ModelConfig(Section):
    model_config = ConfigDict(title="Model")  # its name in schemas, GraphQL and docs
    backends: list[BackendConfig] = Field(min_length=1)
    persistent: bool = False
    sticky: Sticky | None = None
    alias_specs: list[Alias] = Field(
        default_factory=list,
        alias="aliases",
        description="other names callers may use; each a name or {name, setParams}",
    )
    unlisted: bool = False
    filters: Filters = Field(default_factory=Filters)

    @property
    def aliases(self) -> list[str]:
        """The alias names (what callers may send as `model`), in config order."""
        return [alias.name for alias in self.alias_specs]


POLICY_WORDS = ("preempt", "spill", "queue", "reject")


def _policy_json_schema(schema: dict[str, Any]) -> None:
    # A policy is an object or a single word (SPEC §6 S2).
    obj = dict(schema)
    schema.clear()
    schema["title"] = obj.pop("title", "Policy")
    schema["anyOf"] = [{"type": "string", "enum": list(POLICY_WORDS)}, obj]


class PolicyConfig(Section):
    model_config = ConfigDict(
        title="Policy",  # its name in schemas, GraphQL and docs
        json_schema_extra=_policy_json_schema,
    )

    preempt: bool = False
    spill: bool = False
    queue: bool = False
    reject: bool = False

    @model_validator(mode="before")
    @classmethod
    def _single_word(cls, data: object) -> object:
        if isinstance(data, str):
            if data not in POLICY_WORDS:
                raise ValueError(
                    f"unknown policy {data!r}: use preempt, spill, queue or reject, "
                    "or an object such as {queue: true, spill: true}"
                )
            return {data: True}
        return data


class SpendLimit(Section):
    usd: float = Field(ge=0)
    window: Duration = 86400.0


class FeedbackOverride(Section):
    """A group's own `feedback`: each key set here overrides the top level's."""

    after: Duration | None = Field(None, ge=0)
    every: Duration | None = Field(None, gt=0)
    enabled: bool | None = None


class Feedback(Section):
    """SSE comment lines for a streamed request that waits (SPEC §16 K4)."""

    after: Duration = Field(2.0, ge=0, description="wait this long before the first comment")
    every: Duration = Field(5.0, gt=0, description="then one comment this often")
    enabled: bool = True

    def merged(self, own: FeedbackOverride | None) -> Feedback:
        if own is None:
            return self
        return Feedback(
            after=self.after if own.after is None else own.after,
            every=self.every if own.every is None else own.every,
            enabled=self.enabled if own.enabled is None else own.enabled,
        )


class ReservationsConfig(Section):
    """What a group's callers may hold in `/v1/reservations` leases (SPEC §22 T5)."""

    model_config = ConfigDict(title="Reservations")  # its name in schemas, GraphQL and docs

    max_slots: int = Field(
        1, ge=0, description="slots its callers hold in leases at once, all models together"
    )


class PriorityGroup(Section):
    weight: float = Field(1.0, gt=0)
    share_currency: Literal["requests", "slotSeconds", "tokens", "dollars"] = "requests"
    interruptible: bool = False
    on_saturated: dict[str, PolicyConfig] = Field(
        default_factory=lambda: {"default": PolicyConfig(queue=True)}
    )
    accept_degrade: bool = False
    quality_floor: int | None = None
    spend_limit: SpendLimit | None = None
    max_wait: Duration | None = None
    max_queue_depth: int | None = Field(None, ge=0)
    feedback: FeedbackOverride | None = None
    reservations: ReservationsConfig = Field(default_factory=ReservationsConfig)

    @model_validator(mode="before")
    @classmethod
    def _one_policy_for_all(cls, data: object) -> object:
        # `onSaturated: queue` is shorthand for `onSaturated: {default: queue}`.
        if isinstance(data, dict) and isinstance(data.get("onSaturated"), str):
            data = {**data, "onSaturated": {"default": data["onSaturated"]}}
        return data


class RateLimits(Section):
    """What one key (or one user behind it) may use per minute and at once (SPEC §22 T3)."""

    rpm: int | None = Field(None, ge=1, description="requests in the last 60 s")
    tpm: int | None = Field(None, ge=1, description="prompt + completion tokens in the last 60 s")
    concurrent: int | None = Field(None, ge=1, description="requests held at once")


class KeyLimits(RateLimits):
    per_user: RateLimits | None = Field(
        None, description="the same limits for each user behind the key (T4)"
    )


class KeyPolicy(Section):
    """What a key may do (SPEC §22 T1, T3, T4): the config's named keys and the keys made
    at runtime through the management API (T2) take the same fields."""

    group: str | None = Field(None, description="its priority group; default: the default one")
    models: list[str] = Field(
        default_factory=list, description="allowlist: globs on served names and aliases"
    )
    limits: KeyLimits | None = None
    spend_limit: SpendLimit | None = None
    expires: date | datetime | None = Field(
        None, description="a date (valid through that day, UTC) or a time"
    )
    trust_user_header: bool = False


class ApiKey(KeyPolicy):
    """A named key (SPEC §22 T1). The secret never outlives validation: it is replaced by
    its SHA-256 digest, so no config object, dump or error holds it."""

    secret: Text | None = Field(
        None, description="the secret itself (usually ${ENV}); kept only as its digest"
    )
    secret_hash: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-fA-F]{64}$",
        description="sha256:<hex>, as `corrallm keys hash` prints it",
    )
    short: bool = Field(False, exclude=True, description="written as `<secret>: <group>`")

    @model_validator(mode="after")
    def _digest_only(self) -> ApiKey:
        if (self.secret is None) == (self.secret_hash is None):
            raise ValueError("give exactly one of 'secret' and 'secretHash'")
        if self.secret is not None:
            if not self.secret.strip():
                raise ValueError("'secret' is empty (an unset ${ENV}?)")
            hashed = "sha256:" + hashlib.sha256(self.secret.encode()).hexdigest()
            object.__setattr__(self, "secret_hash", hashed)
            object.__setattr__(self, "secret", None)
        else:
            assert self.secret_hash is not None
            object.__setattr__(self, "secret_hash", self.secret_hash.lower())
        return self


def short_key_name(secret: str) -> str:
    """T1: what a short-form key `<secret>: <group>` is called everywhere."""
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:8]


def _named_keys(value: object) -> object:
    # `<secret>: <group>` becomes `key-<8 hex>: {secretHash, group}` here, so the secret
    # is never kept as a key of the config either.
    if not isinstance(value, dict):
        return value
    out: dict[object, object] = {}
    for name, entry in value.items():
        if isinstance(entry, str) and isinstance(name, str):
            digest = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
            out[short_key_name(name)] = {"secretHash": digest, "group": entry, "short": True}
        else:
            out[name] = entry
    return out


Keys = Annotated[dict[str, ApiKey], BeforeValidator(_named_keys)]


class SchedulerConfig(Section):
    model_config = ConfigDict(title="Scheduler")  # its name in schemas, GraphQL and docs
    max_wait: Duration = 60.0
    max_queue_depth: int = Field(64, ge=0)
    default_group: str = "default"
    require_keys: bool = False


class Realtime(Section):
    idle_timeout: Duration = 60.0
    max_duration: Duration = 3600.0


class Upstream(Section):
    """Who may use `/upstream/<model>/…`, the passthrough to a backend's own API and web UI
    (SPEC §22 T5)."""

    access: Literal["admin", "keys"] = Field(
        "admin",
        description="admin: the admin token only (as for /api); keys: callers, through the "
        "same gates as /v1 (key, allowlist, pause, spend, a slot, an activity row)",
    )


class Timeouts(Section):
    """SPEC §20: how long a backend may stay silent before its request is given up."""

    upstream_idle: Duration = Field(
        300.0,
        gt=0,
        description="longest silence from a backend, before its headers and between body "
        "chunks; then 504 upstream_timeout (or an error event when streaming)",
    )


class LedgerConfig(Section):
    model_config = ConfigDict(title="Ledger")  # its name in schemas, GraphQL and docs
    gpu_hour_price: float | None = Field(None, ge=0)


class CaptureConfig(Section):
    """Request and response bodies kept in memory for inspection (SPEC §21 O2)."""

    model_config = ConfigDict(title="Capture")  # its name in schemas, GraphQL and docs

    buffer_mb: float = Field(
        16.0, gt=0, alias="bufferMB", description="the ring buffer's bound, in MB (10^6 bytes)"
    )
    bodies: Literal["errors", "all", "none"] = Field(
        "errors", description="which exchanges to keep: failed ones only, all, or none"
    )


# Headers that carry a credential: naming one as `auth.userHeader` would copy a secret
# into every row that shows the user.
CREDENTIAL_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "x-corrallm-key", "cookie"}
)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110)


class Auth(Section):
    """Who is behind a key (SPEC §22 T4)."""

    user_header: str | None = Field(
        None,
        description="a request header naming the user behind a key that has "
        "`trustUserHeader: true` (e.g. X-OpenWebUI-User-Email); other keys' are ignored",
    )

    @field_validator("user_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.strip()
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(
                f"'{value}' is not an HTTP header name (letters, digits and -, no spaces or "
                "colon), e.g. X-OpenWebUI-User-Email"
            )
        if name.lower() in CREDENTIAL_HEADERS:
            raise ValueError(
                f"'{name}' carries the caller's credentials: its value would be shown as the "
                "user on every row; name the header that carries the user, e.g. "
                "X-OpenWebUI-User-Email"
            )
        return name


class OllamaConfig(Section):
    """Ollama's API (SPEC §23 E1): always on corrallm's own port; `listen` adds a second
    listener for clients that assume Ollama's port."""

    model_config = ConfigDict(title="Ollama")  # its name in schemas and docs

    listen: str | None = Field(
        None,
        description="a second address the same gateway listens on (e.g. 127.0.0.1:11434, "
        "Ollama's port), read at start",
    )

    @field_validator("listen")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_address(value, "ollama.listen")
        return value


class Otlp(Section):
    """Where traces go: an OpenTelemetry collector's OTLP/HTTP receiver (SPEC §23 E2)."""

    endpoint: str = Field(
        description="the collector's base URL, e.g. http://collector:4318; spans are "
        "POSTed to <endpoint>/v1/traces"
    )
    headers: dict[str, Text] = Field(
        default_factory=dict,
        description="sent with every export (e.g. the collector's API key); redacted from "
        "the log and captures",
    )

    @field_validator("endpoint")
    @classmethod
    def _base_url(cls, value: str) -> str:
        url = value.strip().rstrip("/")
        if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", url):
            raise ValueError(
                f"'{value}' is not an http(s) URL; give the collector's OTLP/HTTP address, "
                "e.g. http://collector:4318"
            )
        if url.endswith("/v1/traces"):
            raise ValueError(
                f"give the collector's base URL ('{url.removesuffix('/v1/traces')}'): "
                "corrallm adds /v1/traces itself"
            )
        return url


class TelemetryConfig(Section):
    """OpenTelemetry traces of requests (SPEC §23 E2): off unless `otlp` is set."""

    model_config = ConfigDict(title="Telemetry")  # its name in schemas, GraphQL and docs

    otlp: Otlp | None = Field(
        None,
        description="export spans over OTLP/HTTP there (needs the `otel` extra: pip "
        "install 'corrallm[otel]'); unset: nothing is loaded, whatever OTEL_* says",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="the share of requests without a sampled parent that are traced (a "
        "client's traceparent decides for its own requests)",
    )


class Peer(Section):
    """Another corrallm node whose models this gateway also serves (SPEC §19 X1)."""

    url: Text = Field(description="the peer's base URL, e.g. http://10.0.0.2:6502")
    token: Text = Field(
        description="the peer's admin token: reads its management API and signs the lanes "
        "of the requests sent to it (X3)"
    )


class Config(Section):
    cost_per_kwh: float = Field(0.0, ge=0)
    command_costs: dict[str, CommandCost] = Field(default_factory=dict)
    servers: dict[str, Server] = Field(default_factory=dict)
    extensions: dict[str, Extension] = Field(default_factory=dict)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    priority_groups: dict[str, PriorityGroup] = Field(default_factory=dict)
    keys: Keys = Field(
        default_factory=dict,
        description="API keys by name (or `<secret>: <group>`, named key-<8 hex>)",
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    realtime: Realtime = Field(default_factory=Realtime)
    upstream: Upstream = Field(default_factory=Upstream)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    feedback: Feedback = Field(default_factory=Feedback)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    auth: Auth = Field(default_factory=Auth)
    ollama: OllamaConfig = Field(default_factory=OllamaConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    max_body_size: Size = 64 * 10**6
    peers: dict[str, Peer] = Field(
        default_factory=dict, description="other corrallm nodes, by name (SPEC §19 X1)"
    )
    peer_order: Literal["last", "first"] = Field(
        "last",
        description="where a peer's backends stand among the local ones of the same quality",
    )
    peer_timeout: Duration = Field(
        5.0, gt=0, description="a peer silent this long is marked down (X4)"
    )

    def upstream_idle(self, backend: BackendConfig) -> float:
        """Seconds a backend may stay silent mid-request: its own setting, else the top level."""
        own = backend.timeouts.upstream_idle
        return self.timeouts.upstream_idle if own is None else own
