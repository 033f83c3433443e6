"""The store: what must outlive a request and a restart (SPEC §9, §10 P1, §19 X5).

`Store` is the one API every caller uses (`open`, `close`, `execute`, `execute_many`,
`execute_batches`, `transact`, `query`, `listen`; rows read as `row["col"]`), and this
class is its embedded implementation: one SQLite file under the home folder (WAL mode),
one owner thread per process. Every statement runs on that thread, so the event loop
never blocks on disk and a process has one writer (under `serve --workers N` each
worker writes its own requests' activity rows too: SQLite takes the processes' write
transactions in turn, each waiting up to its busy timeout). `PostgresStore`
(store/postgres.py) is the shared one, for several gateways: same methods, same
statements, its dialect translating them.
`store/location.py`'s `store_at(db)` picks one from `--db`.

The schema is versioned: `MIGRATIONS[i]` takes the file from version i to i+1 (kept in
`PRAGMA user_version`), applied in order at open, each in one transaction; they are
`store/schema.py`'s migrations as SQLite runs them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from corrallm.store.dialect import SQLITE, SqlDialect
from corrallm.store.home import make_private, open_private
from corrallm.store.schema import migrations

T = TypeVar("T")

MIGRATIONS = migrations(SQLITE)
URL_SCHEMES = ("postgresql://", "postgres://")


class Row(Protocol):
    """A result row, as both stores give it: by column name (`row["col"]`) or position."""

    def __getitem__(self, key: int | str, /) -> Any: ...
    def keys(self) -> list[str]: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...


class StoreUnavailable(Exception):
    """The store could not carry out a statement (disk full, file unwritable, I/O error,
    database server unreachable): nothing of that statement was kept. The message names
    the store (`path`: the file, or the URL without its password), the reason and what to
    do about it (`fix`)."""

    def __init__(self, path: Path | str, error: BaseException, fix: str | None = None) -> None:
        self.path = path
        self.reason = " ".join(str(error).split()) or type(error).__name__
        self.fix = fix if fix is not None else _file_fix(Path(path), self.reason.lower())
        super().__init__(f"the store {path} failed: {self.reason}; {self.fix}")


def _file_fix(path: Path, reason: str) -> str:
    if "full" in reason:
        return f"free space on the disk holding {path.parent} (or point --db elsewhere)"
    if "readonly" in reason or "read-only" in reason or "permission" in reason:
        return f"make {path} and its folder writable by corrallm"
    return f"check the disk and the file {path}"


def newer_schema(where: object, found: int) -> RuntimeError:
    return RuntimeError(
        f"{where} has schema version {found}, newer than this corrallm "
        f"({len(MIGRATIONS)}); upgrade corrallm or point --db at another "
        f"{'file' if isinstance(where, Path) else 'database'}"
    )


class Store:
    dialect: SqlDialect = SQLITE
    path: Path | str  # what messages call it: the file, or the URL without its password

    def __init__(self, path: Path) -> None:
        self.path = self.file = path
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

    async def transact(self, steps: Sequence[tuple[str, Sequence[Any]]]) -> list[Row]:
        """Statements in order, in one transaction (each sees what the ones before did);
        the rows the last one returns."""

        def run() -> list[Row]:
            rows: list[Row] = []
            with self._conn:
                self._conn.execute("BEGIN")
                for sql, args in steps:
                    rows = self._conn.execute(sql, args).fetchall()
            return rows

        return await self._run(run)

    async def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return await self._run(lambda: self._conn.execute(sql, args).fetchall())

    async def listen(self, channel: str) -> AsyncGenerator[None, None]:
        """On a shared store: once when listening starts (and again after each
        reconnection), then once per notice on `channel` from any gateway sharing it. An
        embedded store has no other writer: the iteration ends at once, yielding nothing."""
        for _ in ():
            yield

    @property
    def _conn(self) -> sqlite3.Connection:
        assert self._db is not None, "store not open"
        return self._db

    def _open(self) -> None:
        # T5: the file is made 0600 before SQLite opens it; SQLite gives its -wal and
        # -shm files the database file's mode, and ones left by an older version are
        # tightened below.
        os.close(open_private(self.file, os.O_RDWR))
        db = sqlite3.connect(self.file, check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.create_function("sha256_hex", 1, _sha256_hex, deterministic=True)
        db.execute("PRAGMA journal_mode=WAL")
        for suffix in ("-wal", "-shm"):
            make_private(self.file.with_name(self.file.name + suffix))
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=5000")
        current = db.execute("PRAGMA user_version").fetchone()[0]
        if current > len(MIGRATIONS):
            db.close()
            raise newer_schema(self.file, current)
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
            raise StoreUnavailable(self.file, exc) from exc


def _sha256_hex(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()
