"""Learned footprints (SPEC §17 M2, migration 6): what a backend's process held after its
last load, per pool, keyed by the backend and its command line. `residency/manager.py`
reads them once when the store opens and writes one vector after each measured load."""

from __future__ import annotations

from collections.abc import Mapping

from corrallm.store.db import Store

Key = tuple[str, str]  # (backend id, command key)


async def read(store: Store) -> dict[Key, dict[str, int]]:
    """Every stored footprint: (backend, command) -> bytes per pool."""
    rows = await store.query("SELECT backend, command, pool, bytes FROM footprints")
    found: dict[Key, dict[str, int]] = {}
    for r in rows:
        found.setdefault((r["backend"], r["command"]), {})[r["pool"]] = int(r["bytes"])
    return found


async def save(
    store: Store, backend: str, command: str, held: Mapping[str, int], now: float
) -> None:
    """Replace what is stored for (backend, command) with `held`, in one transaction."""
    await store.execute_batches(
        [
            ("DELETE FROM footprints WHERE backend = ? AND command = ?", [(backend, command)]),
            (
                "INSERT INTO footprints (backend, command, pool, bytes, measured_at) "
                "VALUES (?, ?, ?, ?, ?)",
                [(backend, command, pool, n, now) for pool, n in sorted(held.items())],
            ),
        ]
    )
