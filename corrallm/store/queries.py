"""Reads and housekeeping of the activity store (SPEC §9 C4, §14). Being written now."""

from __future__ import annotations

from collections.abc import Sequence

from corrallm.store.db import Store


async def record_queue_depth(
    store: Store, t: float, samples: Sequence[tuple[str, int, int]]
) -> None:
    """One row per backend: (backend, waiting, in_flight) at time t."""
    await store.execute_many(
        "INSERT INTO queue_depth (t, backend, waiting, in_flight) VALUES (?, ?, ?, ?)",
        [(t, backend, waiting, in_flight) for backend, waiting, in_flight in samples],
    )


async def prune(store: Store, before: float) -> int:
    """Delete activity and queue samples older than `before`; how many activity rows went."""
    rows = await store.query("SELECT COUNT(*) AS n FROM activity WHERE t < ?", (before,))
    await store.execute("DELETE FROM activity WHERE t < ?", (before,))
    await store.execute("DELETE FROM queue_depth WHERE t < ?", (before,))
    return int(rows[0]["n"])
