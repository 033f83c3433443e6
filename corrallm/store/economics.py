"""The economics table (SPEC §11 D1, migration 4): the ledger's counters per backend, kept
from install on (`cost/economics.py` owns them in memory)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from corrallm.store.db import Store

COLUMNS = (
    "backend",
    "first_seen",
    "wakes",
    "sleeps",
    "asleep_seconds",
    "wake_count",
    "wake_seconds_total",
    "wake_seconds_max",
    "wake_seconds_last",
    "gpu_hours",
)
_UPSERT = (
    f"INSERT INTO economics ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
    "ON CONFLICT (backend) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in COLUMNS if c != "backend")
)


async def read(store: Store) -> list[dict[str, Any]]:
    """Every backend's stored counters, as dicts keyed by `COLUMNS`."""
    return [dict(r) for r in await store.query(f"SELECT {', '.join(COLUMNS)} FROM economics")]


async def write(store: Store, rows: Sequence[Sequence[Any]]) -> None:
    """Replace the counters of the given backends (values in `COLUMNS` order), in one
    transaction."""
    await store.execute_many(_UPSERT, rows)
