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


class StoreUnavailable(Exception):
    """The store could not carry out a statement (disk full, file unwritable, I/O error):
    nothing of that statement was kept. The message names the file, SQLite's reason and
    what to do about it."""

    def __init__(self, path: Path, error: sqlite3.Error) -> None:
        self.path = path
        self.reason = str(error) or type(error).__name__
        reason = self.reason.lower()
        if "full" in reason:
            fix = f"free space on the disk holding {path.parent} (or point --db elsewhere)"
        elif "readonly" in reason or "read-only" in reason or "permission" in reason:
            fix = f"make {path} and its folder writable by corrallm"
        else:
            fix = f"check the disk and the file {path}"
        self.fix = fix
        super().__init__(f"the store {path} failed: {self.reason}; {fix}")


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
    # 3: hourly usage rollups (SPEC §9 C4): dashboard ranges of days read thousands of
    # rows, not millions. A trigger kept them in the same transaction as each insert (until
    # migration 5); queries add the raw rows of partial hours.
    # `key` is '' for requests without one (primary-key columns cannot be NULL here).
    (
        """
        CREATE TABLE usage_key_hour (
            hour INTEGER NOT NULL,         -- unix seconds at the start of the UTC hour
            key TEXT NOT NULL,
            grp TEXT NOT NULL,
            requests INTEGER NOT NULL,     -- kind = 'request' rows only
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            bytes INTEGER NOT NULL,
            energy_wh REAL NOT NULL,       -- request and load rows
            cost_usd REAL NOT NULL,
            dwell_ms REAL NOT NULL,        -- summed over request rows
            PRIMARY KEY (hour, key, grp)
        ) WITHOUT ROWID
        """,
        """
        CREATE TABLE usage_model_hour (
            hour INTEGER NOT NULL,         -- unix seconds at the start of the UTC hour
            grp TEXT NOT NULL,
            model TEXT NOT NULL,
            requests INTEGER NOT NULL,     -- kind = 'request' rows only
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            bytes INTEGER NOT NULL,
            energy_wh REAL NOT NULL,       -- request and load rows
            cost_usd REAL NOT NULL,
            dwell_ms REAL NOT NULL,        -- summed over request rows
            PRIMARY KEY (hour, grp, model)
        ) WITHOUT ROWID
        """,
        """
        INSERT INTO usage_key_hour
        SELECT CAST(t AS INTEGER) / 3600 * 3600, IFNULL(key, ''), grp,
               SUM(kind = 'request'), SUM(prompt_tokens), SUM(completion_tokens), SUM(bytes),
               SUM(energy_wh), SUM(cost_usd),
               SUM(CASE WHEN kind = 'request' THEN dwell_ms ELSE 0 END)
        FROM activity GROUP BY 1, 2, 3
        """,
        """
        INSERT INTO usage_model_hour
        SELECT CAST(t AS INTEGER) / 3600 * 3600, grp, model,
               SUM(kind = 'request'), SUM(prompt_tokens), SUM(completion_tokens), SUM(bytes),
               SUM(energy_wh), SUM(cost_usd),
               SUM(CASE WHEN kind = 'request' THEN dwell_ms ELSE 0 END)
        FROM activity GROUP BY 1, 2, 3
        """,
        """
        CREATE TRIGGER activity_rollup AFTER INSERT ON activity BEGIN
            INSERT INTO usage_key_hour VALUES (
                CAST(NEW.t AS INTEGER) / 3600 * 3600, IFNULL(NEW.key, ''), NEW.grp,
                NEW.kind = 'request', NEW.prompt_tokens, NEW.completion_tokens, NEW.bytes,
                NEW.energy_wh, NEW.cost_usd,
                CASE WHEN NEW.kind = 'request' THEN NEW.dwell_ms ELSE 0 END
            ) ON CONFLICT (hour, key, grp) DO UPDATE SET
                requests = requests + excluded.requests,
                prompt_tokens = prompt_tokens + excluded.prompt_tokens,
                completion_tokens = completion_tokens + excluded.completion_tokens,
                bytes = bytes + excluded.bytes,
                energy_wh = energy_wh + excluded.energy_wh,
                cost_usd = cost_usd + excluded.cost_usd,
                dwell_ms = dwell_ms + excluded.dwell_ms;
            INSERT INTO usage_model_hour VALUES (
                CAST(NEW.t AS INTEGER) / 3600 * 3600, NEW.grp, NEW.model,
                NEW.kind = 'request', NEW.prompt_tokens, NEW.completion_tokens, NEW.bytes,
                NEW.energy_wh, NEW.cost_usd,
                CASE WHEN NEW.kind = 'request' THEN NEW.dwell_ms ELSE 0 END
            ) ON CONFLICT (hour, grp, model) DO UPDATE SET
                requests = requests + excluded.requests,
                prompt_tokens = prompt_tokens + excluded.prompt_tokens,
                completion_tokens = completion_tokens + excluded.completion_tokens,
                bytes = bytes + excluded.bytes,
                energy_wh = energy_wh + excluded.energy_wh,
                cost_usd = cost_usd + excluded.cost_usd,
                dwell_ms = dwell_ms + excluded.dwell_ms;
        END
        """,
    ),
    # 4: the economics ledger (SPEC §11 D1): per backend, counters kept from install on.
    (
        """
        CREATE TABLE economics (
            backend TEXT PRIMARY KEY,
            first_seen REAL NOT NULL,      -- unix seconds: when counting began
            wakes INTEGER NOT NULL DEFAULT 0,
            sleeps INTEGER NOT NULL DEFAULT 0,
            asleep_seconds REAL NOT NULL DEFAULT 0,
            wake_count INTEGER NOT NULL DEFAULT 0,  -- wakes with a measured latency
            wake_seconds_total REAL NOT NULL DEFAULT 0,
            wake_seconds_max REAL NOT NULL DEFAULT 0,
            wake_seconds_last REAL,
            gpu_hours REAL NOT NULL DEFAULT 0   -- sum of hours asleep * GPU footprint / capacity
        ) WITHOUT ROWID
        """,
    ),
    # 5: the rollups are summed per flush by the one writer (store/activity.py), one upsert
    # per hour and key or model in the batch, instead of two by the trigger for every row:
    # the writer's SQLite time halves (bench/store_queries.py's writer line).
    ("DROP TRIGGER activity_rollup",),
    # 6: learned footprints (SPEC §17 M2): what each backend's process held after a load,
    # per pool, keyed by the backend and its command line (a changed cmd is a new key).
    (
        """
        CREATE TABLE footprints (
            backend TEXT NOT NULL,
            command TEXT NOT NULL,         -- a hash of the placement-independent spec
            pool TEXT NOT NULL,            -- `gpu`: whichever GPU it was placed on (M3)
            bytes INTEGER NOT NULL,
            measured_at REAL NOT NULL,     -- unix seconds
            PRIMARY KEY (backend, command, pool)
        ) WITHOUT ROWID
        """,
    ),
    # 7: each request row names its request (SPEC §21 O1: X-Corrallm-Request-Id), so the
    # dashboard links a row to its capture; NULL for load rows and rows written before.
    (
        "ALTER TABLE activity ADD COLUMN request_id TEXT",
        "CREATE INDEX activity_request_id ON activity (request_id)",
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

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        def run() -> None:
            with self._conn:
                self._conn.execute(sql, args)

        await self._run(run)

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Many rows in one transaction: how batched writes reach the file."""
        await self.execute_batches([(sql, rows)])

    async def execute_batches(self, batches: Sequence[tuple[str, Sequence[Sequence[Any]]]]) -> None:
        """Several statements' rows in one transaction: all of them are written, or none."""

        def run() -> None:
            with self._conn:  # commits, or rolls back on error
                self._conn.execute("BEGIN")  # autocommit mode: else one transaction a row
                for sql, rows in batches:
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
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn)
        except sqlite3.Error as exc:
            raise StoreUnavailable(self.path, exc) from exc
