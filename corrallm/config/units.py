"""Durations and sizes as operators write them: `500ms`, `30s`, `1.5GB`, `1GiB`, or numbers;
listening addresses (`:6502`, `127.0.0.1:6502`, `[::1]:6502`); and positive settings read
from the environment."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TypeVar

N = TypeVar("N", int, float)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b)?\s*$", re.IGNORECASE)
_SIZE_BYTES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}


def env_value(env: Mapping[str, str], name: str, parse: Callable[[str], N], what: str) -> N | None:
    """The positive, finite setting in the environment variable `name`, parsed; None when
    it is unset or blank. ValueError `<name> must be <what>, got '<text>'` when it is bad."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value: N | None = parse(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < math.inf:
        raise ValueError(f"{name} must be {what}, got {text!r}")
    return value


def parse_duration(value: object) -> float:
    """Seconds from `500ms`, `30s`, `5m`, `2h`, `30d` or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s or 5m, got {value!r}")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(
                f"a duration must be a finite, non-negative number of seconds, got {value!r}"
            )
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _DURATION_SECONDS[match.group(2)]
    raise ValueError(f"expected a duration like 500ms, 30s, 5m, 2h, 30d or seconds, got {value!r}")


def parse_size(value: object) -> int:
    """Bytes from `512MB`, `1.5GB`, `1GiB` or a number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 512MB or 1GiB, got {value!r}")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(
                f"a size must be a finite, non-negative number of bytes, got {value!r}"
            )
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            unit = (match.group(2) or "b").lower()
            return int(float(match.group(1)) * _SIZE_BYTES[unit])
    raise ValueError(f"expected a size like 512MB, 1.5GB, 1GiB or bytes, got {value!r}")


def format_size(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n}B"


def rfc3339(unix: float | None) -> str | None:
    if unix is None:
        return None
    return datetime.fromtimestamp(unix, UTC).isoformat().replace("+00:00", "Z")


def parse_address(addr: str, what: str = "the address") -> tuple[str, int]:
    """`:6502` (all interfaces), `127.0.0.1:6502`, `[::1]:6502` as (host, port); ValueError
    naming `what` otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} must look like :6502, 127.0.0.1:6502 or [::1]:6502, got {addr!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
