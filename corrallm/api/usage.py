"""Usage and activity views (SPEC §9 C4, §14): ranges, buckets and the store's reads,
each answered as its typed view (`schemas.py`) for REST, GraphQL and the dashboard alike."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

from corrallm.api.schemas import (
    ActivityList,
    QueueDepth,
    UsageByKey,
    UsageByUser,
    UsageGroupSeries,
    UsageRollup,
    UsageSeries,
)
from corrallm.config.units import parse_duration, rfc3339
from corrallm.gateway import Gateway
from corrallm.http.errors import ApiError
from corrallm.store import queries

DEFAULT_RANGE = 86400.0
MAX_ACTIVITY = 10_000


LAST_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, the last time RFC 3339 can write
MAX_BUCKET = 3650 * 86400


def parse_time(value: str | None, name: str, now: float) -> float | None:
    """`since`/`until`: an RFC 3339 time (UTC if it names no offset), unix seconds, or a
    duration meaning that long ago (`24h`, `7d`). None or blank: not given."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        t = float(text)
    except ValueError:
        try:
            when = datetime.fromisoformat(text.replace("z", "Z").replace("Z", "+00:00"))
        except ValueError:
            try:
                t = now - parse_duration(text)
            except ValueError:
                raise _bad_time(name, value) from None
        else:
            t = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    if not 0 <= t <= LAST_TIME:  # also NaN
        raise _bad_time(name, value)
    return t


def _bad_time(name: str, value: str) -> ApiError:
    return ApiError(
        400,
        f"'{name}' must be an RFC 3339 time (2026-12-01T08:00:00Z), unix seconds "
        f"(1764576000) or a duration ago (30m, 24h, 7d); got {value!r}.",
        f"invalid_{name}",
        param=name,
    )


def time_range(
    since: str | None, until: str | None, now: float | None = None
) -> tuple[float, float]:
    """`[since, until)` in unix seconds; until defaults to now, since to 24 h before until."""
    now = time.time() if now is None else now
    end = parse_time(until, "until", now)
    end = now if end is None else end
    start = parse_time(since, "since", now)
    start = end - DEFAULT_RANGE if start is None else start
    if start >= end:
        raise ApiError(
            400,
            f"'since' ({rfc3339(start)}) must be before 'until' ({rfc3339(end)}).",
            "invalid_since",
            param="since",
        )
    return start, end


def parse_bucket(value: str | None, since: float, until: float) -> int:
    """Seconds per series bucket: a duration (`5m`, `1h`, `1d`) or seconds; whole seconds.
    None: chosen from the range (`queries.default_bucket`)."""
    if value is None or not value.strip():
        return queries.default_bucket(until - since)
    try:
        seconds = parse_duration(value.strip())
    except ValueError:
        seconds = -1.0
    if not 1 <= seconds <= MAX_BUCKET or seconds != int(seconds):
        raise ApiError(
            400,
            f"'bucket' must be a whole number of seconds from 1 to {MAX_BUCKET} (3650d): a "
            f"duration (60s, 5m, 1h, 1d) or seconds (300); got {value!r}.",
            "invalid_bucket",
            param="bucket",
        )
    bucket = int(seconds)
    points = len(queries.bucket_starts(since, until, bucket))
    if points > queries.MAX_BUCKETS:
        least = math.ceil((until - since) / (queries.MAX_BUCKETS - 1))
        raise ApiError(
            400,
            f"'bucket' {value!r} cuts this range into {points} buckets, more than "
            f"{queries.MAX_BUCKETS}; use a bucket of at least {least}s or a shorter range.",
            "invalid_bucket",
            param="bucket",
        )
    return bucket


def _range(since: float, until: float) -> dict[str, Any]:
    return {"since": rfc3339(since), "until": rfc3339(until)}


def _timed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "t": rfc3339(row["t"])} for row in rows]


async def usage_by_key(
    gw: Gateway, since: str | None = None, until: str | None = None
) -> UsageByKey:
    start, end = time_range(since, until)
    rows = await queries.usage_by_key(gw.store, start, end)
    return UsageByKey.model_validate({**_range(start, end), "rows": rows})


async def usage_by_user(
    gw: Gateway, since: str | None = None, until: str | None = None
) -> UsageByUser:
    start, end = time_range(since, until)
    rows = await queries.usage_by_user(gw.store, start, end)
    return UsageByUser.model_validate({**_range(start, end), "rows": rows})


async def usage_rollup(
    gw: Gateway, since: str | None = None, until: str | None = None
) -> UsageRollup:
    start, end = time_range(since, until)
    rows = await queries.usage_rollup(gw.store, start, end)
    return UsageRollup.model_validate({**_range(start, end), "rows": rows})


async def usage_series(
    gw: Gateway,
    since: str | None = None,
    until: str | None = None,
    bucket: str | None = None,
    by_group: bool = False,
) -> UsageSeries | UsageGroupSeries:
    """The usage per bucket (`by_group`: per bucket and lane, a `UsageGroupSeries`)."""
    start, end = time_range(since, until)
    seconds = parse_bucket(bucket, start, end)
    points = await queries.usage_series(gw.store, start, end, seconds, by_group)
    view = UsageGroupSeries if by_group else UsageSeries
    return view.model_validate(
        {**_range(start, end), "bucket_seconds": seconds, "points": _timed(points)}
    )


async def queue_depth(
    gw: Gateway, since: str | None = None, until: str | None = None, bucket: str | None = None
) -> QueueDepth:
    start, end = time_range(since, until)
    seconds = parse_bucket(bucket, start, end)
    points = await queries.queue_depth(gw.store, start, end, seconds)
    return QueueDepth.model_validate(
        {**_range(start, end), "bucket_seconds": seconds, "points": _timed(points)}
    )


async def activity(
    gw: Gateway,
    limit: int = 100,
    key: str | None = None,
    model: str | None = None,
    group: str | None = None,
    since: str | None = None,
    until: str | None = None,
    user: str | None = None,
) -> ActivityList:
    if not 1 <= limit <= MAX_ACTIVITY:
        raise ApiError(
            400,
            f"'limit' must be 1 to {MAX_ACTIVITY}; got {limit}.",
            "invalid_limit",
            param="limit",
        )
    start, end = time_range(since, until)
    rows = await queries.activity(gw.store, start, end, limit, key, model, group, user)
    return ActivityList.model_validate({**_range(start, end), "rows": _timed(rows)})
