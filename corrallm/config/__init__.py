"""The config: schema, loading (YAML, `${VAR}`, every problem at once) and a summary.

from corrallm.config import load_config, ConfigError
try:
    config = load_config(Path("corrallm.yaml"))
except ConfigError as exc:
    print(exc.report())
"""

from __future__ import annotations

import json
import re

from corrallm.config.loading import (
    ConfigError,
    json_schema,
    load_config,
    load_config_text,
    load_demo_config,
)
from corrallm.config.schema import (
    PORT_PLACEHOLDER,
    Alias,
    ApiKey,
    BackendConfig,
    BackendTimeouts,
    CommandCost,
    Config,
    Extension,
    Filters,
    Health,
    LedgerConfig,
    ModelConfig,
    PolicyConfig,
    Pricing,
    PriorityGroup,
    ProcessSpec,
    Realtime,
    SchedulerConfig,
    Server,
    SpendLimit,
    Sticky,
    Swap,
    Timeouts,
    backend_id,
)
from corrallm.config.units import format_size, parse_duration, parse_size

__all__ = [
    "PORT_PLACEHOLDER",
    "Alias",
    "BackendConfig",
    "BackendTimeouts",
    "CommandCost",
    "Config",
    "ConfigError",
    "Extension",
    "Filters",
    "Health",
    "LedgerConfig",
    "ModelConfig",
    "PolicyConfig",
    "Pricing",
    "PriorityGroup",
    "ProcessSpec",
    "Realtime",
    "SchedulerConfig",
    "Server",
    "SpendLimit",
    "Sticky",
    "Swap",
    "Timeouts",
    "backend_id",
    "json_schema",
    "load_config",
    "load_config_text",
    "load_demo_config",
    "parse_duration",
    "parse_size",
    "summary",
]


_SECRET_FLAG = re.compile(
    r"(?P<flag>--?[\w-]*?(?:key|token|secret|password|passwd))(?P<sep>[= ])(?P<value>\S+)",
    re.IGNORECASE,
)
_URL_USERINFO = re.compile(r"(?P<scheme>https?://)[^/@\s]+@")


def _redact(text: str) -> str:
    """A command line or URL fit to print: no `--api-key X`, no `user:pass@`."""
    text = _SECRET_FLAG.sub(lambda m: f"{m['flag']}{m['sep']}***", text)
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}***@", text)


def _policy(policy: PolicyConfig) -> str:
    words = [w for w in ("preempt", "spill", "queue", "reject") if getattr(policy, w)]
    return "+".join(words) or "reject"


def _seconds(value: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if value >= size and value % size == 0:
            return f"{value / size:g}{unit}"
    return f"{value:g}s"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _process(spec: ProcessSpec) -> str:
    parts = []
    if spec.server:
        parts.append(f"on {spec.server}")
    if spec.declared:
        parts.append(", ".join(f"{p} {format_size(n)}" for p, n in spec.declared.items()))
    if spec.supervision != "process":
        parts.append(f"supervision {spec.supervision}")
    if spec.cmd:
        parts.append(f"cmd: {_redact(spec.cmd)} -> proxy {spec.proxy}")
    elif spec.proxy:
        parts.append(f"proxy: {_redact(spec.proxy)}")
    return "  ".join(parts)


def _params(params: dict[str, object]) -> str:
    return ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in params.items())


def _filters(model: ModelConfig) -> list[str]:
    """K5: the model's request filters, then each alias's own setParams."""
    spec = model.filters
    parts = []
    if spec.strip_params:
        parts.append(f"strip {', '.join(spec.strip_params)}")
    if spec.default_params:
        parts.append(f"default {_params(spec.default_params)}")
    if spec.set_params:
        parts.append(f"set {_params(spec.set_params)}")
    lines = [f"    filters: {'; '.join(parts)}"] if parts else []
    lines += [
        f"    alias {alias.name}: set {_params(alias.set_params)}"
        for alias in model.alias_specs
        if alias.set_params
    ]
    return lines


def summary(config: Config) -> str:
    """What `corrallm check` prints for a good config. Never prints key secrets."""
    groups = dict(config.priority_groups)
    default = config.scheduler.default_group
    lines = [
        f"config OK: {_count(len(config.models), 'model')}, "
        f"{_count(len(config.servers), 'server')}, "
        f"{_count(len(config.extensions), 'extension')}, "
        f"{_count(len(groups), 'priority group')}, {_count(len(config.keys), 'key')}"
    ]
    if config.servers:
        lines += ["", "servers:"]
        for name, server in config.servers.items():
            pools = (
                ", ".join(f"{p} {format_size(n)}" for p, n in server.pools.items()) or "no pools"
            )
            reserve = ", ".join(f"{p} {format_size(n)}" for p, n in server.reserve.items())
            lines.append(f"  {name}: {pools}" + (f" (reserve {reserve})" if reserve else ""))
    if config.extensions:
        lines += ["", "extensions:"]
        for name, ext in config.extensions.items():
            lines.append(f"  {name}  {_process(ext)}")
    if config.models:
        lines += ["", "models:"]
    for name, model in config.models.items():
        flags = [f"aliases: {', '.join(model.aliases)}"] if model.aliases else []
        flags += [word for word in ("persistent", "unlisted") if getattr(model, word)]
        if model.sticky:
            ttl = _seconds(model.sticky.ttl) if model.sticky.ttl is not None else "none"
            flags.append(f"sticky ttl {ttl}, evictCost {model.sticky.evict_cost}")
        lines.append(f"  {name}" + (f"  ({'; '.join(flags)})" if flags else ""))
        lines += _filters(model)
        for index, backend in enumerate(model.backends):
            head = (
                f"    {backend_id(name, index, backend)}: type {backend.type}, "
                f"quality {backend.quality}, maxConcurrent {backend.max_concurrent}"
                + (f" (from {backend.slots_from})" if backend.slots_from else "")
            )
            where = f"extension {backend.extension}" if backend.extension else _process(backend)
            lines.append(f"{head}  {where}")
    lines += ["", "priority groups:"]
    for name, group in groups.items():
        policies = ", ".join(f"{t}={_policy(p)}" for t, p in group.on_saturated.items())
        extra = []
        if group.interruptible:
            extra.append("interruptible")
        if group.accept_degrade:
            floor = group.quality_floor
            extra.append("accepts degrade" + (f" to quality {floor}" if floor is not None else ""))
        if group.spend_limit:
            limit = group.spend_limit
            extra.append(f"spend limit ${limit.usd:g} per {_seconds(limit.window)}")
        tail = f"; {', '.join(extra)}" if extra else ""
        mark = " (default group)" if name == default else ""
        lines.append(
            f"  {name}{mark}: weight {group.weight:g}, share in {group.share_currency}, "
            f"onSaturated {policies}{tail}"
        )
    if default not in groups:
        lines.append(f"  {default} (built-in default group): weight 1, queue on saturation")
    lines += ["", f"keys: {len(config.keys)}"]
    for name, key in config.keys.items():
        lines.append(f"  {name}: group {key.group or default}{_key_policy(key)}")
    short = [name for name, key in config.keys.items() if key.short]
    if short:
        lines += [
            "",
            f"note: {_count(len(short), 'short-form key')} ({', '.join(short)}) named after "
            "its secret's digest; write `<name>: {secret: ..., group: ...}` to give each a "
            "name people recognise (docs/config.md, keys)",
        ]
    return "\n".join(lines + _users(config))


def _users(config: Config) -> list[str]:
    """T4: where users come from, and the half-configured cases (a header no key may set,
    keys trusted with no header to read)."""
    header = config.auth.user_header
    trusted = [name for name, key in config.keys.items() if key.trust_user_header]
    if header and trusted:
        return ["", f"users: named by {', '.join(trusted)} in the header {header}"]
    if header:
        return [
            "",
            f"note: auth.userHeader ({header}) is set but no key has trustUserHeader: true, "
            "so no request names a user (keys made at runtime may still trust it)",
        ]
    if trusted:
        return [
            "",
            f"note: {', '.join(trusted)} trust the user header but auth.userHeader is not "
            "set, so no user is read; set auth: {userHeader: X-OpenWebUI-User-Email}",
        ]
    return []


def _key_policy(key: ApiKey) -> str:
    """A key's policy on one line (never its secret or digest)."""
    parts = []
    if key.models:
        parts.append(f"models {', '.join(key.models)}")
    if key.limits is not None:
        limits = key.limits
        each = [
            f"{w} {v}"
            for w, v in (
                ("rpm", limits.rpm),
                ("tpm", limits.tpm),
                ("concurrent", limits.concurrent),
            )
            if v is not None
        ]
        if each:
            parts.append(", ".join(each))
        if limits.per_user is not None:
            parts.append("per-user limits")
    if key.spend_limit is not None:
        parts.append(f"spend limit ${key.spend_limit.usd:g} per {_seconds(key.spend_limit.window)}")
    if key.expires is not None:
        parts.append(f"expires {key.expires}")
    if key.trust_user_header:
        parts.append("trusts the user header")
    return f"; {'; '.join(parts)}" if parts else ""
