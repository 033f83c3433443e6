"""Keys made at runtime (SPEC §22 T2): the one owner of the keys the management API
creates, rotates and revokes, and of every key's `last_used`.

The store is the truth: a key lives in `api_keys` as the digest of its secret (the secret
itself is shown once, to whoever created or rotated it, and kept nowhere), and a secret
revoked or rotated away lives in `revoked_keys`, refused as such. This owner loads both
into the gateway's `KeyRing` at boot; on a shared store it follows the store's channel and
reloads every runtime key on each change any gateway made (and after a reconnection), so a
key created, rotated or revoked through one gateway is in force on all within a second.

Durable first: a change is written to the store, and only then to the ring, so it is in
force on this gateway when the API answers, and a write the store refuses changes
nothing. A lock keeps a reload from racing a change made here (read-then-apply is atomic
against write-then-apply), as for pauses (`lifecycle/pauses.py`).

`last_used` (every key's, config and runtime) is kept in memory and set when a request of
the key settles: two dict writes, no I/O on the request path. A background task writes the
runtime keys' to the store every few seconds (and at stop); config keys' are seeded at
boot from the activity rows, which already say when each key was last used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import pydantic

from corrallm.auth.keys import (
    PREFIX_CHARS,
    UNKNOWN,
    Identity,
    KeyRing,
    RevokedSecret,
    expiry,
    hash_text,
    new_secret,
    parse_hash,
)
from corrallm.config.schema import KeyPolicy
from corrallm.store import keys as table
from corrallm.store.db import Store, StoreUnavailable

log = logging.getLogger("corrallm.auth")

FLUSH_SECONDS = 5.0  # how often the runtime keys' last_used reach the store


class KeyExists(Exception):
    def __init__(self, name: str, source: str) -> None:
        super().__init__(name)
        self.name, self.source = name, source


class KeyInConfig(Exception):
    pass


class KeyNotFound(Exception):
    pass


@dataclass(frozen=True, slots=True)
class RuntimeKeyRecord:
    """A runtime key as the management API shows it: no secret, no digest."""

    name: str
    policy: KeyPolicy
    prefix: str
    created: float


class RuntimeKeys:
    def __init__(
        self,
        store: Store,
        ring: KeyRing,
        wall_clock: Callable[[], float] = time.time,
        flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        self.store = store
        self.ring = ring
        self.wall_clock = wall_clock
        self.flush_seconds = flush_seconds
        self.records: dict[str, RuntimeKeyRecord] = {}  # the runtime keys, by name
        self.last_used: dict[str, float] = {}  # every key's (config and runtime), by name
        self._unwritten: dict[str, float] = {}  # runtime keys' last_used not yet stored
        self._lock = asyncio.Lock()

    # -- the request path ------------------------------------------------------------

    def used(self, name: str | None, now: float) -> None:
        """A request of the key named `name` settled (None: no key)."""
        if name is None or name == UNKNOWN:
            return
        self.last_used[name] = now
        if name in self.records:
            self._unwritten[name] = now

    # -- boot and following ----------------------------------------------------------

    async def restore(self) -> None:
        """At boot: the stored keys in force; config keys' last use from the activity."""
        await self.reload()
        config = [i.name for i in self.ring.all() if i.source == "config"]
        for name, t in (await table.last_requests(self.store, config)).items():
            self.last_used[name] = max(self.last_used.get(name, 0.0), t)

    async def follow(self) -> None:
        """X5: the keys other gateways sharing the store create, rotate and revoke, for as
        long as the gateway runs. Returns at once on an embedded store."""
        async with contextlib.aclosing(table.follow(self.store)) as changes:
            async for _ in changes:
                while True:
                    try:
                        await self.reload()
                        break
                    except StoreUnavailable as exc:
                        log.warning("keys: re-reading the shared store failed: %s", exc)
                        await asyncio.sleep(1.0)

    async def reload(self) -> None:
        """Every runtime key and refused digest, as the store holds them now."""
        async with self._lock:
            stored, revoked = await table.read(self.store)
            records: dict[str, RuntimeKeyRecord] = {}
            identities = []
            for row in stored:
                record = _record(row)
                if record is None:
                    continue
                records[row.name] = record
                identities.append(_identity(record, parse_hash(row.digest)))
                if row.last_used is not None:
                    self.last_used[row.name] = max(self.last_used.get(row.name, 0.0), row.last_used)
            refused = {parse_hash(r.digest): _refused(r) for r in revoked}
            self.records = records
            self.ring.load(identities, refused)
            for name in [n for n in self.last_used if self.ring.named(n) is None]:
                del self.last_used[name]  # revoked, or gone from the config
                self._unwritten.pop(name, None)

    # -- changes (the management API's) ------------------------------------------------

    async def create(self, name: str, policy: KeyPolicy) -> tuple[RuntimeKeyRecord, str]:
        """A new key: kept in the store, then in force here. Returns it with its secret
        (shown this once). Raises `KeyExists` for a name in use, `StoreUnavailable`."""
        if self.ring.in_config(name):
            raise KeyExists(name, "config")
        if name in self.records:
            raise KeyExists(name, "api")
        secret = new_secret()
        record = RuntimeKeyRecord(name, policy, secret[:PREFIX_CHARS], self.wall_clock())
        row = table.StoredKey(
            name,
            hash_text(secret),
            record.prefix,
            policy.group,
            _policy_json(policy),
            record.created,
        )
        async with self._lock:
            if not await table.create(self.store, row):
                raise KeyExists(name, "api")  # made through another gateway
            self.records[name] = record
            self.ring.put(_identity(record, parse_hash(row.digest)))
        log.info("key %s created (group %s, prefix %s)", name, policy.group, record.prefix)
        return record, secret

    async def rotate(self, name: str) -> tuple[RuntimeKeyRecord, str]:
        """A new secret for the key; the old one refused from now on. Raises
        `KeyInConfig`, `KeyNotFound`, `StoreUnavailable`."""
        if self.ring.in_config(name):
            raise KeyInConfig(name)
        secret = new_secret()
        digest, now = hash_text(secret), self.wall_clock()
        async with self._lock:
            row = await table.rotate(self.store, name, digest, secret[:PREFIX_CHARS], now)
            if row is None:
                raise KeyNotFound(name)
            record = _record(row)
            if record is None:
                raise KeyNotFound(name)  # a policy this version cannot read (logged)
            old = self.ring.named(name)
            refused = {old.digest: RevokedSecret(name, "rotated", now)} if old is not None else {}
            self.records[name] = record
            self.ring.put(_identity(record, parse_hash(digest)), refused)
        log.info("key %s rotated (new prefix %s)", name, record.prefix)
        return record, secret

    async def revoke(self, name: str) -> None:
        """The key is refused from the next request on. Raises `KeyInConfig`,
        `KeyNotFound`, `StoreUnavailable`."""
        if self.ring.in_config(name):
            raise KeyInConfig(name)
        now = self.wall_clock()
        async with self._lock:
            digest = await table.delete(self.store, name, now)
            if digest is None:
                raise KeyNotFound(name)
            self.records.pop(name, None)
            self.last_used.pop(name, None)
            self._unwritten.pop(name, None)
            self.ring.drop(name, {parse_hash(digest): RevokedSecret(name, "revoked", now)})
        log.info("key %s revoked", name)

    # -- last_used, written off the request path ---------------------------------------

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            try:
                await self.flush()
            except Exception:  # the store down must not end the loop; the times wait
                log.exception("keys: writing last_used failed; kept for the next try")

    async def flush(self) -> None:
        if not self._unwritten:
            return
        batch, self._unwritten = self._unwritten, {}
        try:
            await table.record_used(self.store, batch)
        except Exception:
            for name, t in batch.items():  # back, unless a newer use came meanwhile
                self._unwritten[name] = max(t, self._unwritten.get(name, t))
            raise


def _policy_json(policy: KeyPolicy) -> str:
    """What `api_keys.policy` holds: the policy as the config would spell it, without the
    group (its own column)."""
    return policy.model_dump_json(by_alias=True, exclude={"group"}, exclude_defaults=True)


def _record(row: table.StoredKey) -> RuntimeKeyRecord | None:
    try:
        policy = KeyPolicy.model_validate_json(row.policy).model_copy(update={"group": row.grp})
    except pydantic.ValidationError as exc:
        # Written by a newer corrallm sharing the store: not served here, and said so.
        log.error("key %s in the store has a policy this corrallm cannot read: %s", row.name, exc)
        return None
    return RuntimeKeyRecord(row.name, policy, row.prefix, row.created)


def _identity(record: RuntimeKeyRecord, digest: bytes) -> Identity:
    policy = record.policy
    return Identity(
        record.name,
        policy.group,
        digest,
        "api",
        tuple(policy.models),
        policy.limits,
        policy.spend_limit,
        expiry(policy.expires),
        policy.trust_user_header,
        prefix=record.prefix,
        created=record.created,
    )


def _refused(row: table.RevokedKey) -> RevokedSecret:
    return RevokedSecret(row.name, "rotated" if row.reason == "rotated" else "revoked", row.at)
