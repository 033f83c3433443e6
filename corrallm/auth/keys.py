"""Keys as identities (SPEC §22 T1): a name everyone sees, a secret nobody sees, a policy.

A key is held only as the SHA-256 digest of its secret. A request's key is hashed once
and looked up by digest (a dict lookup, then a constant-time compare of the digests), so
the hot path pays one hash and nothing that depends on how many keys there are.

Two sources feed one table: the config's keys (rebuilt on a reload) and the keys made at
runtime through the management API (T2, kept in the store as digests). A name is unique
across both.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Literal

from corrallm.auth.limits import Ask, limited
from corrallm.config.schema import ApiKey, KeyLimits, SpendLimit

Source = Literal["config", "api"]
UNKNOWN = "unknown"  # the name of a key that is not configured (T1)
SECRET_PREFIX = "ck-"  # what the keys made at runtime start with (T2)
PREFIX_CHARS = 7  # how much of a runtime secret is shown: "ck-" and 4 more


def digest_of(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def hash_text(secret: str) -> str:
    """`sha256:<hex>`: what `secretHash` takes and `corrallm keys hash` prints."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def parse_hash(text: str) -> bytes:
    return bytes.fromhex(text.removeprefix("sha256:"))


def new_secret() -> str:
    """A runtime key's secret: `ck-` and 43 URL-safe characters (256 random bits)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def expiry(value: date | datetime | None) -> float | None:
    """The epoch second from which the key is refused: a date is valid through its whole
    day (UTC), a time without a zone is UTC."""
    if value is None:
        return None
    if isinstance(value, datetime):
        when = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return when.timestamp()
    return datetime.combine(value + timedelta(days=1), time(), UTC).timestamp()


@dataclass(frozen=True, slots=True)
class Identity:
    """One key: who it is and what it may do. Holds no secret."""

    name: str
    group: str | None  # None: the scheduler's default group
    digest: bytes = field(repr=False)
    source: Source = "config"
    models: tuple[str, ...] = ()  # allowlist globs; empty: every model
    limits: KeyLimits | None = None
    spend_limit: SpendLimit | None = None
    expires: float | None = None  # epoch seconds; refused from then on
    trust_user_header: bool = False
    prefix: str | None = None  # the secret's first characters (runtime keys only)
    created: float | None = None
    short: bool = False  # written in the config as `<secret>: <group>`
    # The allowlist's globs as one compiled pattern: one match per name on the hot path,
    # not one glob after another (20 globs cost a request ~8 % of its throughput).
    _allowed: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)
    # T3: what the key's own limits count it in, made once (auth/throttle.asks_of).
    asks: tuple[Ask, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if limited(self.limits):
            assert self.limits is not None
            object.__setattr__(self, "asks", (Ask("key:" + self.name, self.limits),))
        if self.models:
            joined = "|".join(f"(?:{fnmatch.translate(glob)})" for glob in self.models)
            object.__setattr__(self, "_allowed", re.compile(joined))

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires

    def allows(self, names: Iterable[str]) -> bool:
        """T3: whether a model known by these names (its own and its aliases) is allowed."""
        allowed = self._allowed
        return allowed is None or any(allowed.match(n) is not None for n in names)

    @classmethod
    def of_config(cls, name: str, key: ApiKey) -> Identity:
        assert key.secret_hash is not None, "validated config"
        return cls(
            name,
            key.group,
            parse_hash(key.secret_hash),
            "config",
            tuple(key.models),
            key.limits,
            key.spend_limit,
            expiry(key.expires),
            key.trust_user_header,
            short=key.short,
        )


@dataclass(frozen=True, slots=True)
class RevokedSecret:
    """A secret that was a runtime key's until it was revoked or rotated away (T2): refused
    as such, even where unknown keys are served, so it never falls into the default lane."""

    name: str  # the key it belonged to
    reason: Literal["revoked", "rotated"]
    at: float  # unix seconds


class KeyRing:
    """Every key in force, by digest and by name: the config's and the runtime ones; and
    the secrets refused (revoked or rotated away), by digest."""

    def __init__(self) -> None:
        self._config: dict[str, Identity] = {}
        self._api: dict[str, Identity] = {}
        self._by_digest: dict[bytes, Identity] = {}
        self._refused: dict[bytes, RevokedSecret] = {}
        self.version = 0  # bumped by every change, for the callers cached on it
        # Who hears of every change (`serve --workers`: the owner sends the runtime keys
        # on to its workers, corrallm/workers/owner.py).
        self.changed: list[Callable[[], None]] = []

    def reconfigure(self, keys: Mapping[str, ApiKey]) -> None:
        self._config = {name: Identity.of_config(name, key) for name, key in keys.items()}
        self._rebuild()

    def load(
        self, identities: Iterable[Identity], refused: Mapping[bytes, RevokedSecret] | None = None
    ) -> None:
        """The runtime keys, as the store holds them now (all of them), and the digests it
        refuses (when given: all of them)."""
        self._api = {i.name: i for i in identities}
        if refused is not None:
            self._refused = dict(refused)
        self._rebuild()

    def put(self, identity: Identity, refused: Mapping[bytes, RevokedSecret] | None = None) -> None:
        """A runtime key made or rotated here (`refused`: the secret it replaced)."""
        self._api[identity.name] = identity
        self._refused.update(refused or {})
        self._rebuild()

    def drop(
        self, name: str, refused: Mapping[bytes, RevokedSecret] | None = None
    ) -> Identity | None:
        """A runtime key revoked here (`refused`: its secret, refused from now on)."""
        gone = self._api.pop(name, None)
        self._refused.update(refused or {})
        self._rebuild()
        return gone

    def _rebuild(self) -> None:
        table: dict[bytes, Identity] = {}
        for identity in self._api.values():
            if identity.name not in self._config:  # a config key shadows its runtime namesake
                table[identity.digest] = identity
        for identity in self._config.values():
            table[identity.digest] = identity  # a config key wins a (freak) digest clash
        self._by_digest = table
        self.version += 1
        for hear in self.changed:
            hear()

    def runtime(self) -> tuple[list[Identity], dict[bytes, RevokedSecret]]:
        """The runtime keys and the refused secrets, as `load` takes them."""
        return list(self._api.values()), dict(self._refused)

    def refused(self, digest: bytes) -> RevokedSecret | None:
        """Why a secret that is no key is refused (revoked or rotated away), if it was one."""
        return self._refused.get(digest)

    def resolve(self, secret: str) -> Identity | None:
        """The key whose secret this is, or None. Looked up by digest, then compared in
        constant time, so neither step tells an attacker how close a guess came."""
        return self.find(digest_of(secret))

    def find(self, digest: bytes) -> Identity | None:
        found = self._by_digest.get(digest)
        if found is not None and hmac.compare_digest(found.digest, digest):
            return found
        return None

    def named(self, name: str) -> Identity | None:
        return self._config.get(name) or self._api.get(name)

    def in_config(self, name: str) -> bool:
        return name in self._config

    def all(self) -> list[Identity]:
        """Config keys first (in config order), then runtime ones by name (those a config
        key of the same name shadows left out)."""
        api = [i for i in self._api.values() if i.name not in self._config]
        return [*self._config.values(), *sorted(api, key=lambda i: i.name)]

    def __len__(self) -> int:
        return len(self._by_digest)
