"""Activity (SPEC §9 C3): one row per request (and per backend load), written off the
request path by a batched writer (one per process: under `serve --workers N` each
relaying worker writes its own requests' rows).

`record()` only appends to an in-memory list: no I/O on the hot path. A background task
flushes the list every second (and at shutdown) in one transaction, so a crash loses at
most the last second and, with SQLite in WAL mode, never corrupts the file. The same
statements run on a shared PostgreSQL store (SPEC §19 X5), where each gateway's writer adds
its rows, and its rollup sums, to the same tables: the upserts add, so the hours add up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from itertools import compress, repeat
from operator import attrgetter, eq
from typing import Any

from corrallm.store.db import Store

log = logging.getLogger("corrallm.store")

FLUSH_SECONDS = 1.0


@dataclass(slots=True)
class Activity:
    t: float  # unix seconds when the request arrived
    kind: str  # "request" | "load"
    key: str | None  # the caller's key name (`unknown`: not configured); never a secret
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
    request_id: str | None = None  # X-Corrallm-Request-Id of a request row (SPEC §21 O1)
    usr: str | None = None  # the user behind the key, where it may name one (SPEC §22 T4)


COLUMNS = tuple(f.name for f in fields(Activity))
# A row's values in the order of COLUMNS (ten times faster than dataclasses.astuple).
values: Callable[[Activity], tuple[Any, ...]] = attrgetter(*COLUMNS)
INSERT = f"INSERT INTO activity ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"

# The hourly rollups (SPEC §9 C4): what a batch adds, summed per hour and key or model.
_SUMS = (
    "requests",  # request rows only
    "prompt_tokens",
    "completion_tokens",
    "bytes",
    "energy_wh",
    "cost_usd",
    "dwell_ms",  # request rows only
)
_T, _KIND, _KEY, _GRP, _MODEL, _DWELL = (
    COLUMNS.index(c) for c in ("t", "kind", "key", "grp", "model", "dwell_ms")
)
_ADDED = tuple(COLUMNS.index(c) for c in _SUMS[1:-1])  # summed as they are, every kind


def _upsert(table: str, identity: str) -> str:
    added = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in _SUMS)
    return (
        f"INSERT INTO {table} VALUES ({', '.join('?' * 10)}) "
        f"ON CONFLICT ({identity}) DO UPDATE SET {added}"
    )


UPSERT_KEY_HOUR = _upsert("usage_key_hour", "hour, key, grp")
UPSERT_MODEL_HOUR = _upsert("usage_model_hour", "hour, grp, model")


def rollups(rows: Sequence[Sequence[Any]]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The rollup rows a batch of activity rows (column order of COLUMNS) adds to: per UTC
    hour and (key, group), and per hour and (group, model). Requests count and dwell only
    for `request` rows; tokens, bytes, energy and cost for every row (a `load` row's energy
    is part of its lane's bill). A row without a key counts under ''.

    Perf (SPEC §13): this runs on the event loop once a second over every row of the
    second, so per row it only files the row under its two identities; the sums are taken
    per identity, column by column, by `sum` itself."""
    by_key: dict[tuple[Any, ...], list[Sequence[Any]]] = {}
    by_model: dict[tuple[Any, ...], list[Sequence[Any]]] = {}
    for row in rows:
        hour = int(row[_T]) // 3600 * 3600
        by_key.setdefault((hour, row[_KEY] or "", row[_GRP]), []).append(row)
        by_model.setdefault((hour, row[_GRP], row[_MODEL]), []).append(row)
    # In key order: writers sharing a store lock the rollup rows they add to in the same
    # order, so two flushes at once wait for each other instead of deadlocking.
    return (
        [(*identity, *_sums(members)) for identity, members in sorted(by_key.items(), key=_order)],
        [
            (*identity, *_sums(members))
            for identity, members in sorted(by_model.items(), key=_order)
        ],
    )


def _sums(rows: list[Sequence[Any]]) -> tuple[Any, ...]:
    """What `rows` add to their rollup row, in the order of _SUMS."""
    columns = list(zip(*rows, strict=True))
    requests = list(map(eq, columns[_KIND], repeat("request")))
    return (
        sum(requests),
        *(sum(columns[i]) for i in _ADDED),
        sum(compress(columns[_DWELL], requests)),
    )


def _order(item: tuple[tuple[Any, ...], list[Any]]) -> tuple[str, ...]:
    return tuple(map(str, item[0]))  # any total order does (a bad row may hold a None)


async def write(store: Store, rows: Sequence[Sequence[Any]]) -> None:
    """Activity rows and what they add to the rollups, in one transaction."""
    by_key, by_model = rollups(rows)
    await store.execute_batches(
        [(INSERT, rows), (UPSERT_KEY_HOUR, by_key), (UPSERT_MODEL_HOUR, by_model)]
    )


class ActivityLog:
    """A process's writer of the activity table."""

    def __init__(self, store: Store, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.store = store
        self.flush_seconds = flush_seconds
        self._pending: list[Sequence[Any]] = []  # rows' values, in the order of COLUMNS

    def record(self, row: Activity) -> None:
        self._pending.append(values(row))

    def add(self, row: Sequence[Any]) -> None:
        """A row's values, as `values()` gives them (cost/ledger.py's `activity_row`)."""
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
            await write(self.store, rows)
        except Exception:
            self._pending[:0] = rows  # nothing is lost: they go first next time
            raise
