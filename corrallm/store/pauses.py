"""The pauses table (SPEC §10 P1, §9 C5): what `lifecycle/pauses.py` keeps across restarts.

Each write is one transaction, so it is kept whole or not at all; a failed one raises
`StoreUnavailable` and the caller changes nothing in memory. On a shared store (SPEC §19
X5) the same transaction notifies `CHANNEL`, so every gateway following it (`follow`)
re-reads the table at once; notifications are sent on commit, never for a write that
failed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from corrallm.store.db import Store

Row = tuple[str, str, float | None]  # (kind, name, until: unix seconds or None)

CHANNEL = "corrallm_pauses"

_SAVE = (
    "INSERT INTO pauses (kind, name, until, paused_at) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (kind, name) DO UPDATE SET until = excluded.until, "
    "paused_at = excluded.paused_at"
)
_DELETE = "DELETE FROM pauses WHERE kind = ? AND name = ?"


async def read(store: Store) -> list[Row]:
    rows = await store.query("SELECT kind, name, until FROM pauses")
    return [(r["kind"], r["name"], r["until"]) for r in rows]


async def save(store: Store, kind: str, name: str, until: float | None, now: float) -> None:
    await _write(store, _SAVE, (kind, name, until, now))


async def delete(store: Store, kind: str, name: str) -> None:
    await _write(store, _DELETE, (kind, name))


def follow(store: Store) -> AsyncGenerator[None, None]:
    """Once when following starts (and after each reconnection), then once per change any
    gateway sharing the store wrote; ends at once on an embedded store."""
    return store.listen(CHANNEL)


async def _write(store: Store, sql: str, args: Sequence[Any]) -> None:
    batches: list[tuple[str, Sequence[Sequence[Any]]]] = [(sql, [args])]
    if store.dialect.shared:
        batches.append((f"NOTIFY {CHANNEL}", [()]))
    await store.execute_batches(batches)
