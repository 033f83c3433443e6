"""The pauses table (SPEC §10 P1, §9 C5): what `lifecycle/pauses.py` keeps across restarts.

Each write is one statement, so it is kept whole or not at all; a failed one raises
`StoreUnavailable` and the caller changes nothing in memory.
"""

from __future__ import annotations

from corrallm.store.db import Store

Row = tuple[str, str, float | None]  # (kind, name, until: unix seconds or None)


async def read(store: Store) -> list[Row]:
    rows = await store.query("SELECT kind, name, until FROM pauses")
    return [(r["kind"], r["name"], r["until"]) for r in rows]


async def save(store: Store, kind: str, name: str, until: float | None, now: float) -> None:
    await store.execute(
        "INSERT OR REPLACE INTO pauses (kind, name, until, paused_at) VALUES (?, ?, ?, ?)",
        (kind, name, until, now),
    )


async def delete(store: Store, kind: str, name: str) -> None:
    await store.execute("DELETE FROM pauses WHERE kind = ? AND name = ?", (kind, name))
