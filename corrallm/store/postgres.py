"""The shared store: PostgreSQL, for several gateways at once (SPEC §19 X5).

The same API as the embedded store (`store/db.py`) and the same statements: each is
translated by the PostgreSQL dialect (`?` -> `%s`) and run on a connection from an async
psycopg pool, so nothing needs a thread of its own. A statement is one transaction;
`execute_batches` and `transact` put several in one. Rows read by name or position, as
SQLite's do, and `numeric` results (PostgreSQL's SUM of a BIGINT) come back as int or
float, as SQLite gives them.

Migrations are the embedded store's (`store/schema.py`), tracked in `schema_version` (one
row per version applied), each applied in one transaction, all under an advisory lock: a
second gateway starting at the same time waits, then finds nothing left to do.

`listen` follows a notification channel on a connection of its own (LISTEN/NOTIFY): the
pauses table is followed that way, so a pause written by one gateway is enforced by all
(lifecycle/pauses.py). A dropped connection is reconnected with back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg.adapt import Buffer, Loader
from psycopg.rows import RowMaker
from psycopg_pool import AsyncConnectionPool

from corrallm.store.db import Row, Store, StoreUnavailable, newer_schema
from corrallm.store.dialect import POSTGRES
from corrallm.store.schema import migrations

log = logging.getLogger("corrallm.store")

MIGRATIONS = migrations(POSTGRES)
MIGRATION_LOCK = 0x636F72_72616C6C  # pg_advisory_lock key: "corrall"
POOL_SIZE = 10
CONNECT_SECONDS = 5  # to reach the server at all
POOL_WAIT_SECONDS = 2.0  # for a free connection, before a statement fails as unavailable
STATEMENT_TIMEOUT_MS = 30_000
LISTEN_PING_SECONDS = 10.0  # a quiet listening connection is checked this often
RECONNECT_SECONDS = (0.25, 10.0)  # back-off of the listening connection: first, longest


class PostgresStore(Store):
    dialect = POSTGRES

    def __init__(self, url: str) -> None:  # no SQLite thread: hence no super().__init__
        self.url = url
        self.path = redact(url)
        self._pool: AsyncConnectionPool | None = None

    async def open(self) -> None:
        try:
            await self._migrate()
            pool = AsyncConnectionPool(
                self.url,
                min_size=1,
                max_size=POOL_SIZE,
                open=False,
                timeout=POOL_WAIT_SECONDS,
                kwargs={
                    "connect_timeout": CONNECT_SECONDS,
                    "application_name": "corrallm",
                    "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
                },
                configure=_configure,
                name="corrallm-store",
            )
            try:
                await pool.open(wait=True, timeout=CONNECT_SECONDS)
            except BaseException:
                await pool.close()
                raise
        except psycopg.Error as exc:
            raise self._unavailable(exc) from exc
        self._pool = pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        async with self._connection() as conn:
            await conn.execute(self.dialect.translate(sql), args)

    async def execute_batches(self, batches: Sequence[tuple[str, Sequence[Sequence[Any]]]]) -> None:
        async with self._connection() as conn, conn.transaction():
            cursor = conn.cursor()
            for sql, rows in batches:
                if rows:
                    await cursor.executemany(self.dialect.translate(sql), rows)

    async def transact(self, steps: Sequence[tuple[str, Sequence[Any]]]) -> list[Row]:
        async with self._connection() as conn, conn.transaction():
            cursor = conn.cursor(row_factory=_records)
            for sql, args in steps:
                await cursor.execute(self.dialect.translate(sql), args)
            return list(await cursor.fetchall()) if cursor.description else []

    async def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        async with self._connection() as conn:
            cursor = conn.cursor(row_factory=_records)
            await cursor.execute(self.dialect.translate(sql), args)
            return list(await cursor.fetchall()) if cursor.description else []

    async def listen(self, channel: str) -> AsyncGenerator[None, None]:
        if not channel.isidentifier():
            raise ValueError(f"not a channel name: {channel!r}")
        first, longest = RECONNECT_SECONDS
        delay = first
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.url,
                    autocommit=True,
                    connect_timeout=CONNECT_SECONDS,
                    application_name="corrallm-listen",
                    keepalives=1,
                    keepalives_idle=10,
                    keepalives_interval=5,
                    keepalives_count=3,
                )
                async with conn:
                    await conn.execute(f"LISTEN {channel}")
                    delay = first
                    yield  # listening: the caller reads what it may have missed
                    while True:
                        async for _ in conn.notifies(timeout=LISTEN_PING_SECONDS):
                            yield
                        await conn.execute("SELECT 1")  # quiet: is the server still there?
            except psycopg.Error as exc:
                log.warning(
                    "store %s: listening on %s failed (%s); reconnecting in %.2gs",
                    self.path,
                    channel,
                    " ".join(str(exc).split()),
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, longest)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        assert self._pool is not None, "store not open"
        try:
            async with self._pool.connection() as conn:  # commits on the way out, or rolls back
                yield conn
        except psycopg.Error as exc:
            raise self._unavailable(exc) from exc

    async def _migrate(self) -> None:
        conn = await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, connect_timeout=CONNECT_SECONDS
        )
        async with conn:
            await conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
            try:
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_version ("
                    "version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
                )
                cursor = await conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version")
                found = await cursor.fetchone()
                current = int(found[0]) if found else 0
                if current > len(MIGRATIONS):
                    raise newer_schema(self.path, current)
                for version in range(current, len(MIGRATIONS)):
                    async with conn.transaction():
                        for statement in MIGRATIONS[version]:
                            await conn.execute(statement)
                        await conn.execute(
                            "INSERT INTO schema_version (version, applied_at) VALUES (%s, %s)",
                            (version + 1, time.time()),
                        )
                if current < len(MIGRATIONS):
                    log.info(
                        "store %s: schema version %d -> %d", self.path, current, len(MIGRATIONS)
                    )
            finally:
                await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))

    def _unavailable(self, exc: psycopg.Error) -> StoreUnavailable:
        return StoreUnavailable(self.path, exc, fix_for(self.url, str(exc)))


def redact(url: str) -> str:
    """The URL as messages may show it: no password, no parameters."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{user}{parts.hostname or 'localhost'}{port}{parts.path}"


def fix_for(url: str, reason: str) -> str:
    """What an operator can do about a PostgreSQL error."""
    parts = urlsplit(url)
    server = f"{parts.hostname or 'localhost'}:{parts.port or 5432}"
    database = parts.path.lstrip("/") or "corrallm"
    reason = reason.lower()
    if "database" in reason and "does not exist" in reason:
        return f"create the database (createdb -O {parts.username or 'corrallm'} {database})"
    if "password" in reason or "pg_hba" in reason or "role" in reason:
        return "check the user and password in --db, and that pg_hba.conf lets this host in"
    if "permission denied" in reason:
        return f"grant the --db user rights on the database {database} (docs/config.md)"
    if "no space" in reason or "could not extend" in reason or "disk full" in reason:
        return f"free space on the disk of the PostgreSQL server {server}"
    if "couldn't get a connection" in reason or "timeout" in reason:
        return f"check that the PostgreSQL server {server} is up and answering"
    return f"check that PostgreSQL is running at {server} (or fix the host and port in --db)"


class PgRow:
    """One row: by column name or position, like sqlite3.Row."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values: Sequence[Any]) -> None:
        self._index = index
        self._values = values

    def __getitem__(self, key: int | str, /) -> Any:
        return self._values[self._index[key] if isinstance(key, str) else key]

    def keys(self) -> list[str]:
        return list(self._index)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Record({dict(zip(self._index, self._values, strict=True))!r})"


def _records(cursor: psycopg.AsyncCursor[Any]) -> RowMaker[PgRow]:
    index = {column.name: i for i, column in enumerate(cursor.description or ())}

    def make(values: Sequence[Any]) -> PgRow:
        return PgRow(index, values)

    return make


class _Number(Loader):
    """`numeric` as int or float (what SQLite gives for the same sums)."""

    def load(self, data: Buffer) -> int | float:
        text = bytes(data)
        try:
            return int(text)
        except ValueError:
            return float(text)


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    conn.adapters.register_loader("numeric", _Number)
