"""Where the store is (`--db`, SPEC §19 X5): a `postgresql://` (or `postgres://`) URL is a
shared PostgreSQL store, anything else the path of an SQLite file. A module of its own so
that neither store's module imports the other."""

from __future__ import annotations

from pathlib import Path

from corrallm.extras import missing_extra
from corrallm.store.db import URL_SCHEMES, Store


def store_at(db: Path | str) -> Store:
    if isinstance(db, str) and db.startswith(URL_SCHEMES):
        try:
            from corrallm.store.postgres import PostgresStore  # psycopg: the `postgres` extra
        except ImportError as exc:
            missing = missing_extra(
                exc,
                "psycopg",
                f"--db {db.split(':', 1)[0]}://… needs the PostgreSQL driver psycopg",
                "postgres",
            )
            if missing is None:
                raise
            raise missing from None
        return PostgresStore(db)
    return Store(Path(db).expanduser())
