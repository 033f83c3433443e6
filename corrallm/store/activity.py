"""Activity (SPEC §9 C3): one row per request (and per backend load), written off the
request path by one batched writer.

`record()` only appends to an in-memory list: no I/O on the hot path. A background task
flushes the list every second (and at shutdown) in one transaction, so a crash loses at
most the last second and, with SQLite in WAL mode, never corrupts the file.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, fields
from operator import attrgetter

from corrallm.store.db import Store

log = logging.getLogger("corrallm.store")

FLUSH_SECONDS = 1.0


@dataclass(slots=True)
class Activity:
    t: float  # unix seconds when the request arrived
    kind: str  # "request" | "load"
    key: str | None  # the caller's configured key name; never a secret not in the config
    grp: str
    model: str
    backend: str | None
    endpoint: str
    status: int
    dwell_ms: float = 0.0
    duration_ms: float = 0.0
    ttfb_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    bytes: int = 0
    energy_wh: float = 0.0
    cost_usd: float = 0.0
    estimated: bool = False
    degraded: bool = False
    spilled: bool = False
    preempted: bool = False
    error: str | None = None


COLUMNS = tuple(f.name for f in fields(Activity))
_VALUES = attrgetter(*COLUMNS)  # ten times faster than dataclasses.astuple
INSERT = f"INSERT INTO activity ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


class ActivityLog:
    """The one writer of the activity table."""

    def __init__(self, store: Store, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.store = store
        self.flush_seconds = flush_seconds
        self._pending: list[Activity] = []

    def record(self, row: Activity) -> None:
        self._pending.append(row)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            try:
                await self.flush()
            except Exception:  # a full disk must not take the gateway down; rows wait
                log.exception(
                    "activity flush failed; %d rows kept for the next try", len(self._pending)
                )

    async def flush(self) -> None:
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        try:
            await self.store.execute_many(INSERT, [_VALUES(r) for r in rows])
        except Exception:
            self._pending[:0] = rows  # nothing is lost: they go first next time
            raise
