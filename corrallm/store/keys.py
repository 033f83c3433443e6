"""The runtime keys' tables (SPEC §22 T2): `api_keys`, one row per key made through the
management API (its name, policy and the SHA-256 digest of its secret, never the secret),
and `revoked_keys`, the digests of secrets revoked or rotated away, refused as such.

Each change is one transaction that says whether it found what it changed (a name
already taken, a key that is not there), so the caller needs no read before it and two
gateways racing on a shared store cannot both win. On a shared store (SPEC §19 X5) the
same transaction notifies `CHANNEL`, so every gateway following it (`follow`) re-reads
the keys at once; notifications are sent on commit, never for a write that failed.

`last_used` is written in batches by the runtime keys' owner (`auth/runtime.py`), never
on the request path, and never moved back by a gateway whose batch is older.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from corrallm.store.db import Row, Store

CHANNEL = "corrallm_keys"


@dataclass(frozen=True, slots=True)
class StoredKey:
    name: str
    digest: str  # sha256:<hex> of the secret
    prefix: str  # the secret's first characters, for people to tell keys apart
    grp: str | None
    policy: str  # JSON: models, limits, spendLimit, expires, trustUserHeader (camelCase)
    created: float  # unix seconds
    last_used: float | None = None


@dataclass(frozen=True, slots=True)
class RevokedKey:
    digest: str  # sha256:<hex> of a secret no longer valid
    name: str
    reason: str  # 'revoked' | 'rotated'
    at: float


_COLUMNS = "name, digest, prefix, grp, policy, created, last_used"
_CREATE = (
    f"INSERT INTO api_keys ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT DO NOTHING RETURNING name"
)
# The secret a key holds now joins the refused ones (in the transaction that replaces or
# deletes it, so no moment exists where it is neither valid nor refused).
_REFUSE = (
    "INSERT INTO revoked_keys (digest, name, reason, at) "
    "SELECT digest, name, ?, ? FROM api_keys WHERE name = ?"
)
_ROTATE = (
    "UPDATE api_keys SET digest = ?, prefix = ? WHERE name = ? "
    "RETURNING name, grp, policy, created, last_used"
)
_DELETE = "DELETE FROM api_keys WHERE name = ? RETURNING digest"
_USED = "UPDATE api_keys SET last_used = ? WHERE name = ? AND (last_used IS NULL OR last_used < ?)"
_LAST_REQUEST = "SELECT MAX(t) AS t FROM activity WHERE key = ?"


async def read(store: Store) -> tuple[list[StoredKey], list[RevokedKey]]:
    """Every runtime key, and every refused digest."""
    keys = await store.query(f"SELECT {_COLUMNS} FROM api_keys ORDER BY name")
    revoked = await store.query("SELECT digest, name, reason, at FROM revoked_keys")
    return [_key(r) for r in keys], [RevokedKey(*r) for r in revoked]


async def create(store: Store, key: StoredKey) -> bool:
    """Keep a new key; False (and nothing written) when its name is taken."""
    args = (key.name, key.digest, key.prefix, key.grp, key.policy, key.created, key.last_used)
    return bool(await _change(store, [(_CREATE, args)]))


async def rotate(store: Store, name: str, digest: str, prefix: str, now: float) -> StoredKey | None:
    """Give the key a new secret, its old one refused from now on: the key as stored now,
    or None (and nothing written) when there is no such key."""
    rows = await _change(
        store, [(_REFUSE, ("rotated", now, name)), (_ROTATE, (digest, prefix, name))]
    )
    if not rows:
        return None
    r = rows[0]
    return StoredKey(r["name"], digest, prefix, r["grp"], r["policy"], r["created"], r["last_used"])


async def delete(store: Store, name: str, now: float) -> str | None:
    """Revoke the key: its row goes, its secret is refused from now on. The digest it had,
    or None (and nothing written) when there is no such key."""
    rows = await _change(store, [(_REFUSE, ("revoked", now, name)), (_DELETE, (name,))])
    return str(rows[0]["digest"]) if rows else None


async def record_used(store: Store, used: Mapping[str, float]) -> None:
    """When each key was last used, in one transaction (in name order: gateways sharing
    the store lock the rows in the same order)."""
    rows = [(t, name, t) for name, t in sorted(used.items())]
    await store.execute_many(_USED, rows)


async def last_requests(store: Store, names: Iterable[str]) -> dict[str, float]:
    """The newest activity row of each key named (one index lookup each), for the keys
    whose last use is not kept in `api_keys`: the config's."""
    found: dict[str, float] = {}
    for name in names:
        rows = await store.query(_LAST_REQUEST, (name,))
        if rows and rows[0]["t"] is not None:
            found[name] = float(rows[0]["t"])
    return found


def follow(store: Store) -> AsyncGenerator[None, None]:
    """Once when following starts (and after each reconnection), then once per change any
    gateway sharing the store made; ends at once on an embedded store."""
    return store.listen(CHANNEL)


async def _change(store: Store, steps: Sequence[tuple[str, Sequence[Any]]]) -> list[Row]:
    """`steps` in one transaction; the rows the last one returns. The notice goes first:
    it is sent on commit whatever its place, and the last step's rows are the answer."""
    if store.dialect.shared:
        steps = [(f"NOTIFY {CHANNEL}", ()), *steps]
    return await store.transact(steps)


def _key(r: Row) -> StoredKey:
    return StoredKey(
        r["name"], r["digest"], r["prefix"], r["grp"], r["policy"], r["created"], r["last_used"]
    )
