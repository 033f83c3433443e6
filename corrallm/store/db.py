"""The store: one SQLite file under the home folder (WAL mode), one owner thread.

Every statement runs on the store's own single thread, so the event loop never blocks
on disk and there is exactly one writer. The schema is versioned: `MIGRATIONS[i]` takes
the file from version i to i+1 (kept in `PRAGMA user_version`), applied in order at
open, each in one transaction.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

MIGRATIONS: Sequence[Sequence[str]] = (
    # 1: pauses (SPEC §10 P1, §9 C5): what must survive a restart.
    (
        """
        CREATE TABLE pauses (
            kind TEXT NOT NULL CHECK (kind IN ('model', 'extension')),
            name TEXT NOT NULL,
            until REAL,            -- unix seconds; NULL: until unpaused
            paused_at REAL NOT NULL,
            PRIMARY KEY (kind, name)
        )
        """,
    ),
    # 2: activity (SPEC §9 C3/C4, §14): one row per request or load, and queue samples.
    (
        """
        CREATE TABLE activity (
            id INTEGER PRIMARY KEY,
            t REAL NOT NULL,               -- unix seconds when the request arrived
            kind TEXT NOT NULL,            -- 'request' | 'load'
            key TEXT,                      -- the caller's configured key name, or NULL
            grp TEXT NOT NULL,
            model TEXT NOT NULL,
            backend TEXT,
            endpoint TEXT NOT NULL,
            status INTEGER NOT NULL,
            dwell_ms REAL NOT NULL DEFAULT 0,
            duration_ms REAL NOT NULL DEFAULT 0,
            ttfb_ms REAL,
            prompt_tokens INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0,
            bytes INTEGER NOT NULL DEFAULT 0,
            energy_wh REAL NOT NULL DEFAULT 0,
            cost_usd REAL NOT NULL DEFAULT 0,
            estimated INTEGER NOT NULL DEFAULT 0,
            degraded INTEGER NOT NULL DEFAULT 0,
            spilled INTEGER NOT NULL DEFAULT 0,
            preempted INTEGER NOT NULL DEFAULT 0,
            error TEXT
        )
        """,
        "CREATE INDEX activity_t ON activity (t)",
        "CREATE INDEX activity_key_t ON activity (key, t)",
        "CREATE INDEX activity_grp_t ON activity (grp, t)",
        "CREATE INDEX activity_model_t ON activity (model, t)",
        """
        CREATE TABLE queue_depth (
            t REAL NOT NULL,
            backend TEXT NOT NULL,
            waiting INTEGER NOT NULL,
            in_flight INTEGER NOT NULL
        )
        """,
        "CREATE INDEX queue_depth_t ON queue_depth (t)",
    ),
)


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corrallm-store")
        self._db: sqlite3.Connection | None = None

    async def open(self) -> None:
        await self._run(self._open)

    async def close(self) -> None:
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._thread.shutdown(wait=True)

    @property
    def version(self) -> int:
        return len(MIGRATIONS)

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        def run() -> None:
            with self._conn:
                self._conn.execute(sql, args)

        await self._run(run)

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Many rows in one transaction: how batched writes reach the file."""

        def run() -> None:
            with self._conn:
                self._conn.executemany(sql, rows)

        await self._run(run)

    async def query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        return await self._run(lambda: self._conn.execute(sql, args).fetchall())

    @property
    def _conn(self) -> sqlite3.Connection:
        assert self._db is not None, "store not open"
        return self._db

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=5000")
        current = db.execute("PRAGMA user_version").fetchone()[0]
        if current > len(MIGRATIONS):
            db.close()
            raise RuntimeError(
                f"{self.path} has schema version {current}, newer than this corrallm "
                f"({len(MIGRATIONS)}); upgrade corrallm or point --db at another file"
            )
        for version in range(current, len(MIGRATIONS)):
            db.execute("BEGIN")
            for statement in MIGRATIONS[version]:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {version + 1}")
            db.execute("COMMIT")
        self._db = db

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)
