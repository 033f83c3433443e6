"""Keys on the management surfaces (SPEC §22 T2): list every key, and create, rotate and
revoke the ones made at runtime. One set of functions for REST, GraphQL and the dashboard;
the work is the runtime keys' owner's (`auth/runtime.py`). No view holds a secret or a
digest: a secret is in the answer that made it, and nowhere else."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import pydantic

from corrallm.api.schemas import KeyCreate, KeyRevoked, Keys, KeyView, KeyWithSecret
from corrallm.api.service import store_unavailable
from corrallm.auth.keys import expiry
from corrallm.auth.runtime import KeyExists, KeyInConfig, KeyNotFound, RuntimeKeyRecord
from corrallm.config.schema import KeyPolicy
from corrallm.config.units import rfc3339
from corrallm.config.validation import did_you_mean
from corrallm.gateway import Gateway
from corrallm.http.errors import ApiError
from corrallm.store.db import StoreUnavailable


def list_keys(gw: Gateway) -> Keys:
    """Config keys (in config order, short-form ones by their `key-<8 hex>` name), then
    the runtime ones by name; a runtime key a config key of its name shadows left out."""
    used = gw.runtime_keys.last_used
    rows = [
        KeyView(**_fields(name, key, "config"), last_used=rfc3339(used.get(name)))
        for name, key in gw.config.keys.items()
    ]
    for name, record in sorted(gw.runtime_keys.records.items()):
        if name not in gw.config.keys:
            rows.append(KeyView(**_api_fields(record), last_used=rfc3339(used.get(name))))
    return Keys(keys=rows)


async def create_key(gw: Gateway, fields: Mapping[str, Any]) -> KeyWithSecret:
    """A new key; its secret is in this answer and nowhere else."""
    spec = _parse(gw, fields)
    policy = KeyPolicy.model_validate(spec.model_dump(exclude={"name"}))
    try:
        record, secret = await gw.runtime_keys.create(spec.name, policy)
    except KeyExists as exc:
        raise _exists(exc) from exc
    except StoreUnavailable as exc:
        raise store_unavailable(exc, f"create the key '{spec.name}'") from exc
    await gw.in_force()
    return KeyWithSecret(**_api_fields(record), secret=secret)


async def rotate_key(gw: Gateway, name: str) -> KeyWithSecret:
    """A new secret for a runtime key; the old one is refused from now on."""
    try:
        record, secret = await gw.runtime_keys.rotate(name)
    except (KeyInConfig, KeyNotFound) as exc:
        raise _unchangeable(exc, name, "rotated") from exc
    except StoreUnavailable as exc:
        raise store_unavailable(exc, f"rotate the key '{name}'") from exc
    await gw.in_force()
    return KeyWithSecret(**_api_fields(record), secret=secret)


async def revoke_key(gw: Gateway, name: str) -> KeyRevoked:
    """A runtime key is refused from the next request on, and no longer listed."""
    try:
        await gw.runtime_keys.revoke(name)
    except (KeyInConfig, KeyNotFound) as exc:
        raise _unchangeable(exc, name, "revoked") from exc
    except StoreUnavailable as exc:
        raise store_unavailable(exc, f"revoke the key '{name}'") from exc
    await gw.in_force()
    return KeyRevoked(name=name, revoked=True)


def groups(gw: Gateway) -> list[str]:
    """The lanes a key may be put in: the configured groups and the default one."""
    config = gw.config
    return sorted({*config.priority_groups, config.scheduler.default_group})


# -- pieces ---------------------------------------------------------------------------


def _parse(gw: Gateway, fields: Mapping[str, Any]) -> KeyCreate:
    """The request's fields, validated as the config's named keys are, every problem
    named at once (the group's too)."""
    problems: list[str] = []
    spec: KeyCreate | None = None
    try:
        spec = KeyCreate.model_validate(fields)
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "body"
            text = f"{where}: {error['msg']}"
            if error["loc"][:1] == ("expires",):  # one problem, not one per union member
                text = (
                    "expires: must be a date (2027-01-31) or an RFC 3339 time "
                    f"(2027-01-31T18:00:00Z), got {error['input']!r}"
                )
            if text not in problems:
                problems.append(text)
    group = fields.get("group")
    lanes = groups(gw)
    if isinstance(group, str) and group not in lanes:
        problems.append(
            f"group: unknown group '{group}'{did_you_mean(group, lanes)}; the groups are "
            f"{', '.join(lanes)}"
        )
    if problems or spec is None:
        raise ApiError(400, f"Invalid key: {'; '.join(problems)}.", "invalid_request")
    return spec


def _fields(name: str, policy: KeyPolicy, source: str) -> dict[str, Any]:
    limits = policy.limits
    return {
        "name": name,
        "group": policy.group,
        "source": source,
        "prefix": None,
        "models": list(policy.models),
        "limits": limits.model_dump() if limits is not None else None,
        "spend_limit": policy.spend_limit.model_dump() if policy.spend_limit else None,
        "expires": _expires(policy),
        "created": None,
        "trust_user_header": policy.trust_user_header,
    }


def _api_fields(record: RuntimeKeyRecord) -> dict[str, Any]:
    return {
        **_fields(record.name, record.policy, "api"),
        "prefix": record.prefix,
        "created": rfc3339(record.created),
    }


def _expires(policy: KeyPolicy) -> str | None:
    """As given: a date stays a date (the key is valid through it); a time is RFC 3339."""
    value = policy.expires
    if value is None:
        return None
    if isinstance(value, datetime):
        return rfc3339(expiry(value))
    return value.isoformat()


def _exists(exc: KeyExists) -> ApiError:
    if exc.source == "config":
        why = f"is the config's (keys.{exc.name}); pick another name"
    else:
        why = (
            "was made through this API already; pick another name, or give it a new secret "
            f"with POST /api/v1/keys/{exc.name}/rotate"
        )
    return ApiError(409, f"A key named '{exc.name}' {why}.", "key_exists", param="name")


def _unchangeable(exc: Exception, name: str, done: str) -> ApiError:
    if isinstance(exc, KeyInConfig):
        return ApiError(
            409,
            f"The key '{name}' is a config key and cannot be {done} here: change it in the "
            f"config file (keys.{name}) and reload the config. Only keys made through "
            "POST /api/v1/keys are managed here.",
            "key_in_config",
            param="name",
        )
    return ApiError(
        404,
        f"No key '{name}' was made through this API (a revoked key is gone). "
        "GET /api/v1/keys lists the keys.",
        "key_not_found",
        param="name",
    )
