"""Reads and housekeeping of the activity store (SPEC §9 C4, §14).

Every range is half-open, `since <= t < until`, in unix seconds. Usage sums read whole
UTC hours from the hourly rollups (`usage_key_hour`, `usage_model_hour`, kept by the
activity writer) and the raw `activity` rows of the partial hours at either end, so a
30-day range reads a row per hour and combination, not one per request (every raw
read goes through the `activity_t` index, named on SQLite so that no plan can pick
another). The statements are the same on both dialects: what differs (index hints, integer
truncation) comes from the store's dialect (`store/dialect.py`).
Series buckets are aligned to multiples of their length since the epoch (a day bucket
starts at 00:00 UTC); a bucket that is not a whole number of hours is summed from the
raw rows.

Results are plain dicts with the API's field names; times stay unix seconds here (the
service layer formats them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from corrallm.store.db import Store
from corrallm.store.dialect import SQLITE, SqlDialect

HOUR = 3600
SUM_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "bytes", "energy_wh", "cost_usd")
ACTIVITY_FIELDS = (
    "id, t, kind, key, grp, model, backend, endpoint, status, dwell_ms, duration_ms, ttfb_ms, "
    "prompt_tokens, completion_tokens, bytes, energy_wh, cost_usd, estimated, degraded, "
    "spilled, preempted, error, request_id, usr"
)
FLAGS = ("estimated", "degraded", "spilled", "preempted")

# One activity row as rollup columns, for the partial hours: the writer's arithmetic
# (`activity.rollups`).
_RAW = (
    "CASE WHEN kind = 'request' THEN 1 ELSE 0 END, prompt_tokens, completion_tokens, bytes, "
    "energy_wh, cost_usd, CASE WHEN kind = 'request' THEN dwell_ms ELSE 0 END"
)
_ROLLED = "requests, prompt_tokens, completion_tokens, bytes, energy_wh, cost_usd, dwell_ms"
_SUMS = (
    "SUM(requests) AS requests, SUM(prompt_tokens) AS prompt_tokens, "
    "SUM(completion_tokens) AS completion_tokens, SUM(bytes) AS bytes, "
    "SUM(energy_wh) AS energy_wh, SUM(cost_usd) AS cost_usd, SUM(dwell_ms) AS dwell_sum"
)


# -- usage sums --------------------------------------------------------------------------


def whole_hours(since: float, until: float, bucket: int = HOUR) -> tuple[float, float]:
    """`[h0, h1)`: the whole UTC hours read from the rollups; raw rows cover `[since, h0)`
    and `[h1, until)`. Empty (`h0 == h1 == until`) when no whole hour fits in the range or
    the bucket is not a whole number of hours.

    Integer arithmetic on `floor(t)`, as in the writer, so a row is in exactly one part."""
    h0 = -(-math.ceil(since) // HOUR) * HOUR
    h1 = math.floor(until) // HOUR * HOUR
    if bucket % HOUR or h0 >= h1:
        return until, until
    return h0, h1


def _union(table: str, rolled: str, raw: str, dialect: SqlDialect = SQLITE) -> str:
    """The rows to sum, as one subquery: rollup hours plus the raw rows at both ends.

    Parameters, in order: h0, h1, since, h0, h1, until."""
    activity = f"activity {dialect.indexed('activity_t')}"
    return f"""
        SELECT {rolled}, {_ROLLED} FROM {table} WHERE hour >= ? AND hour < ?
        UNION ALL
        SELECT {raw}, {_RAW} FROM {activity} WHERE t >= ? AND t < ?
        UNION ALL
        SELECT {raw}, {_RAW} FROM {activity} WHERE t >= ? AND t < ?
    """


def _args(since: float, until: float) -> tuple[float, ...]:
    h0, h1 = whole_hours(since, until)
    return (h0, h1, since, h0, h1, until)


def _sums(row: Any) -> dict[str, Any]:
    sums = {name: row[name] or 0 for name in SUM_FIELDS}
    sums["energy_wh"] = float(sums["energy_wh"])
    sums["cost_usd"] = float(sums["cost_usd"])
    requests = sums["requests"]
    sums["dwell_ms_avg"] = row["dwell_sum"] / requests if requests else None
    return sums


async def usage_by_key(store: Store, since: float, until: float) -> list[dict[str, Any]]:
    """Sums per (key, group); `key` is None for requests made without one."""
    union = _union("usage_key_hour", "key, grp", "COALESCE(key, ''), grp", store.dialect)
    sql = f"""
        SELECT NULLIF(key, '') AS key, grp, {_SUMS}
        FROM ({union}) AS u
        GROUP BY key, grp ORDER BY key NULLS FIRST, grp
    """
    rows = await store.query(sql, _args(since, until))
    return [{"key": r["key"], "group": r["grp"], **_sums(r)} for r in rows]


async def usage_by_user(store: Store, since: float, until: float) -> list[dict[str, Any]]:
    """SPEC §22 T4: sums per (user, key), for the rows that name a user (only keys that
    may name one do). Read from the raw rows in the range: there is no hourly rollup per
    user (a user is anybody a trusted front end names, and the rollups stay one row per
    hour and key), so this reads one row per request, through the `activity_t` index."""
    sql = f"""
        SELECT usr, key, SUM(CASE WHEN kind = 'request' THEN 1 ELSE 0 END) AS requests,
               SUM(prompt_tokens) AS prompt_tokens, SUM(completion_tokens) AS completion_tokens,
               SUM(bytes) AS bytes, SUM(energy_wh) AS energy_wh, SUM(cost_usd) AS cost_usd,
               SUM(CASE WHEN kind = 'request' THEN dwell_ms ELSE 0 END) AS dwell_sum
        FROM activity {store.dialect.indexed("activity_t")}
        WHERE t >= ? AND t < ? AND usr IS NOT NULL
        GROUP BY usr, key ORDER BY usr, key NULLS FIRST
    """
    rows = await store.query(sql, (since, until))
    return [{"user": r["usr"], "key": r["key"], **_sums(r)} for r in rows]


async def usage_rollup(store: Store, since: float, until: float) -> list[dict[str, Any]]:
    """Sums per (group, model)."""
    sql = f"""
        SELECT grp, model, {_SUMS}
        FROM ({_union("usage_model_hour", "grp, model", "grp, model", store.dialect)}) AS u
        GROUP BY grp, model ORDER BY grp, model
    """
    rows = await store.query(sql, _args(since, until))
    return [{"group": r["grp"], "model": r["model"], **_sums(r)} for r in rows]


MAX_BUCKETS = 10_000


def default_bucket(span: float) -> int:
    """A bucket giving a readable number of points: 1 min up to 2 h, 5 min up to a day,
    an hour up to a week, else a day (or whole days, to stay within MAX_BUCKETS)."""
    for limit, bucket in ((2 * HOUR, 60), (24 * HOUR, 300), (7 * 24 * HOUR, HOUR)):
        if span <= limit:
            return bucket
    return max(1, math.ceil(span / MAX_BUCKETS / 86400)) * 86400


def bucket_starts(since: float, until: float, bucket: int) -> range:
    """The starts of the aligned buckets that meet `[since, until)`."""
    return range(math.floor(since) // bucket * bucket, math.ceil(until), bucket)


async def usage_series(
    store: Store, since: float, until: float, bucket: int, by_group: bool = False
) -> list[dict[str, Any]]:
    """Sums per aligned bucket (and group). Every bucket of the range is there: one with no
    activity has zero sums (for each group seen in the range, when `by_group`)."""
    group = ", grp" if by_group else ""
    rolled, raw = "hour / ? * ? AS b, grp", f"{store.dialect.floor_to('t', '?')}, grp"
    sql = f"""
        SELECT b{group}, {_SUMS}
        FROM ({_union("usage_model_hour", rolled, raw, store.dialect)}) AS u
        GROUP BY b{group}
    """
    h0, h1 = whole_hours(since, until, bucket)
    args = (bucket, bucket, h0, h1, bucket, bucket, since, h0, bucket, bucket, h1, until)
    found = {
        (r["b"], r["grp"] if by_group else None): _sums(r) for r in await store.query(sql, args)
    }
    groups: list[str | None] = (
        sorted({g for _, g in found if g is not None}) if by_group else [None]
    )
    empty: dict[str, Any] = {name: 0 for name in SUM_FIELDS}
    empty.update(energy_wh=0.0, cost_usd=0.0, dwell_ms_avg=None)
    points = []
    for start in bucket_starts(since, until, bucket):
        for g in groups:
            point: dict[str, Any] = {"t": start, "group": g} if by_group else {"t": start}
            point.update(found.get((start, g), empty))
            points.append(point)
    return points


# -- queue depth and activity ------------------------------------------------------------


async def queue_depth(
    store: Store, since: float, until: float, bucket: int
) -> list[dict[str, Any]]:
    """Per aligned bucket and backend, the peak `waiting` and `in_flight` of its samples.
    Buckets with no sample (corrallm was not running) are left out."""
    dialect = store.dialect
    rows = await store.query(
        f"""
        SELECT {dialect.floor_to("t", "?")} AS b, backend,
               MAX(waiting) AS waiting, MAX(in_flight) AS in_flight
        FROM queue_depth {dialect.indexed("queue_depth_t")} WHERE t >= ? AND t < ?
        GROUP BY b, backend ORDER BY b, backend
        """,
        (bucket, bucket, since, until),
    )
    return [
        {"t": r["b"], "backend": r["backend"], "waiting": r["waiting"], "in_flight": r["in_flight"]}
        for r in rows
    ]


async def activity(
    store: Store,
    since: float,
    until: float,
    limit: int = 100,
    key: str | None = None,
    model: str | None = None,
    group: str | None = None,
    user: str | None = None,
) -> list[dict[str, Any]]:
    """The newest `limit` rows in the range, newest first, optionally filtered (each filter
    has its own `(column, t)` index)."""
    where: list[str] = ["t >= ?", "t < ?"]
    args: list[Any] = [since, until]
    for column, value in (("key", key), ("model", model), ("grp", group), ("usr", user)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    rows = await store.query(
        f"SELECT {ACTIVITY_FIELDS} FROM activity WHERE {' AND '.join(where)} "
        "ORDER BY t DESC, id DESC LIMIT ?",
        (*args, limit),
    )
    out = []
    for r in rows:
        row = dict(r)
        row["group"] = row.pop("grp")
        row["user"] = row.pop("usr")
        for flag in FLAGS:
            row[flag] = bool(row[flag])
        out.append(row)
    return out


# -- housekeeping ------------------------------------------------------------------------


async def record_queue_depth(
    store: Store, t: float, samples: Sequence[tuple[str, int, int]]
) -> None:
    """One row per backend: (backend, waiting, in_flight) at time t."""
    await store.execute_many(
        "INSERT INTO queue_depth (t, backend, waiting, in_flight) VALUES (?, ?, ?, ?)",
        [(t, backend, waiting, in_flight) for backend, waiting, in_flight in samples],
    )


async def prune(store: Store, before: float) -> int:
    """Delete activity older than `before` rounded down to the hour (so the hourly rollups
    and the raw rows always cover the same time), and queue samples older than `before`;
    how many activity rows went."""
    hour = math.floor(before / HOUR) * HOUR
    rows = await store.query("SELECT COUNT(*) AS n FROM activity WHERE t < ?", (hour,))
    await store.execute("DELETE FROM activity WHERE t < ?", (hour,))
    await store.execute("DELETE FROM usage_key_hour WHERE hour < ?", (hour,))
    await store.execute("DELETE FROM usage_model_hour WHERE hour < ?", (hour,))
    await store.execute("DELETE FROM queue_depth WHERE t < ?", (before,))
    return int(rows[0]["n"])
