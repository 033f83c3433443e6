"""The caller a request is served as (SPEC §6 S1, §22 T1): its key's identity and lane;
and the user behind it, where its key may name one (T4).

Made from the request head alone, before any body byte is read (T5), and cached per key
(by digest) until the config or the runtime keys change, so the hot path pays one hash
and a dict lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from corrallm.auth.keys import UNKNOWN, Identity, KeyRing, RevokedSecret, digest_of
from corrallm.config import Config
from corrallm.config.schema import PriorityGroup


@dataclass(frozen=True, slots=True)
class Caller:
    name: str | None  # the key's name; `unknown` for a key not configured; None: no key
    group_name: str
    group: PriorityGroup | None
    known: bool  # a configured (or runtime) key, or a lane a peer signed (X3)
    identity: Identity | None = None
    refused: RevokedSecret | None = None  # a secret revoked or rotated away (T2): always 401
    # T3: the key's allowlist verdict per served model, decided once: a caller lives as
    # long as the config and keys it was made under (`Callers` makes new ones after a
    # change), and only served models' names are asked, so it holds a few entries.
    allowed: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)


class Callers:
    def __init__(self, config: Config, ring: KeyRing) -> None:
        self.ring = ring
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        # T4: the header a trusted key names its user in, as the head holds it (lower case).
        header = config.auth.user_header
        self.user_header = header.lower().encode("latin-1") if header else None
        self._groups = config.priority_groups
        self._default = config.scheduler.default_group
        self._cache: dict[bytes, Caller] = {}
        self._version = self.ring.version
        self._anonymous = Caller(None, self._default, self._groups.get(self._default), False)
        self._unknown = Caller(UNKNOWN, self._default, self._groups.get(self._default), False)

    def __call__(self, key: str | None, signed: str | None = None) -> Caller:
        """S1: the caller's lane from its key (unknown and missing keys: the default).
        `signed`: the lane a gateway signed for a request it forwarded (X3), which stands
        for the caller's key (it never crosses the hop); a lane not configured here is
        the default."""
        if signed is not None:
            name = signed if signed in self._groups else self._default
            return Caller(None, name, self._groups.get(name), signed in self._groups)
        if key is None:
            return self._anonymous
        if self._version != self.ring.version:
            self._cache, self._version = {}, self.ring.version
        digest = digest_of(key)
        caller = self._cache.get(digest)
        if caller is not None:
            return caller
        identity = self.ring.find(digest)
        if identity is None:
            refused = self.ring.refused(digest)
            if refused is None:
                return self._unknown  # never cached: unknown keys are anybody's to invent
            # Cached: refused digests are the store's, as few as the keys ever revoked.
            caller = Caller(refused.name, self._default, None, False, refused=refused)
            self._cache[digest] = caller
            return caller
        group = identity.group or self._default
        if identity.source == "api" and group not in self._groups:
            # A runtime key's group that this config lacks (another gateway's, on a shared
            # store, or one a reload removed): its caller is served in the default lane.
            group = self._default
        caller = Caller(identity.name, group, self._groups.get(group), True, identity)
        self._cache[digest] = caller
        return caller


USER_CHARS = 128  # T4: a user header's value is cut to this many characters


def trusts_user(caller: Caller) -> bool:
    """T4: whether the caller's key may name the user behind it."""
    return caller.identity is not None and caller.identity.trust_user_header


def user_named(raw: bytes) -> str | None:
    """T4: the user a header value names: UTF-8 (else Latin-1, as HTTP/1.1 allows), blanks
    trimmed, cut to `USER_CHARS` characters; None when nothing is left."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.strip()[:USER_CHARS] or None
