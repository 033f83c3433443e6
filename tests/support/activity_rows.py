"""Activity rows for the store's tests, and writing them the way the gateway does (one
flush of the batched writer)."""

from __future__ import annotations

from typing import Any

from corrallm.store.activity import Activity, ActivityLog
from corrallm.store.db import Store


def req(
    t: float, key: str | None = "alice", grp: str = "team", model: str = "m", **kw: Any
) -> Activity:
    return Activity(t, "request", key, grp, model, f"{model}#0", "/v1/chat/completions", 200, **kw)


def load(
    t: float, key: str | None = "alice", grp: str = "team", model: str = "m", **kw: Any
) -> Activity:
    return Activity(t, "load", key, grp, model, f"{model}#0", "load", 200, **kw)


async def write(store: Store, *rows: Activity) -> None:
    log = ActivityLog(store)
    for row in rows:
        log.record(row)
    await log.flush()
