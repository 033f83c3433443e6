"""Where the store is (`--db`, SPEC §19 X5): a `postgresql://` (or `postgres://`) URL is a
shared PostgreSQL store, anything else the path of an SQLite file. A module of its own so
that neither store's module imports the other."""

from __future__ import annotations

from pathlib import Path

from corrallm.store.db import URL_SCHEMES, Store


class MissingExtra(Exception):
    """The store asked for needs an optional extra that is not installed; the message is
    the one line to show, naming the extra and how to install it."""


def store_at(db: Path | str) -> Store:
    if isinstance(db, str) and db.startswith(URL_SCHEMES):
        try:
            from corrallm.store.postgres import PostgresStore  # psycopg: the `postgres` extra
        except ImportError as exc:
            if not (exc.name or "psycopg").startswith("psycopg"):
                raise
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise MissingExtra(
                f"--db {db.split(':', 1)[0]}://… needs the PostgreSQL driver psycopg, which "
                f"could not be loaded ({reason}): install the postgres extra, "
                "pip install 'corrallm[postgres]'"
            ) from None
        return PostgresStore(db)
    return Store(Path(db).expanduser())
