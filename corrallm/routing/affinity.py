"""Which conversation a request belongs to, and where that conversation last ran (SPEC §16
K6). Pure: no clock, no I/O.

The scheduling core prefers, among the equal backends of a tier, the one a conversation
last ran on (its prompt cache is warm); `Admission` keeps the memory of that in an
`Affinity` (a bounded LRU) and passes the preferred backend to `Scheduler.submit`.

The key (`session_key`), first found wins:

1. the `X-Corrallm-Session` header, as the client names its conversation;
2. the request's `user` field (one end user, all their conversations: one backend);
3. a hash of the conversation's opening: its first 2 messages, cut before the first
   message the model wrote (`assistant`, or a `tool` result). Turn 1 of a chat is
   `[user1]` or `[system, user1]`; turn 2 is the same messages followed by the
   assistant's answer and the next user message, so both hash the same opening: `[user1]`
   or `[system, user1]`. Taking more than the opening would split the turns; taking only
   the first message would put every conversation sharing a system prompt on one backend.

No `messages` (completions, embeddings, uploads): no key, the normal choice. Every key is a
fixed-size digest of its source (tagged, so a header `x` and a user `x` differ), so the
memory an `Affinity` holds stays bounded whatever clients send.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import orjson

SESSION_HEADER = b"x-corrallm-session"
OPENING = 2  # messages of a conversation's opening that key it
MODEL_ROLES = frozenset({"assistant", "tool", "function"})  # what turn 1 cannot contain yet
DEFAULT_ENTRIES = 10_000


def session_key(headers: Iterable[tuple[bytes, bytes]], payload: Mapping[str, Any]) -> str | None:
    """The conversation a request belongs to (K6), or None when it says nothing of one."""
    for name, value in headers:
        if name.lower() == SESSION_HEADER and value.strip():
            return _digest(b"h", value.strip())
    user = payload.get("user")
    if isinstance(user, str) and user:
        return _digest(b"u", user.encode("utf-8", "surrogatepass"))
    opening = conversation_opening(payload.get("messages"))
    if not opening:
        return None
    return _digest(b"m", orjson.dumps(opening, option=orjson.OPT_SORT_KEYS))


def conversation_opening(messages: object) -> list[Any]:
    """The first `OPENING` messages, cut before the first one the model wrote."""
    if not isinstance(messages, list):
        return []
    opening: list[Any] = []
    for message in messages[:OPENING]:
        if isinstance(message, dict) and message.get("role") in MODEL_ROLES:
            break
        opening.append(message)
    return opening


def _digest(kind: bytes, source: bytes) -> str:
    return kind.decode() + ":" + hashlib.blake2b(source, digest_size=16).hexdigest()


class Affinity:
    """Session key -> the backend it last ran on; the least recently used goes first."""

    def __init__(self, entries: int = DEFAULT_ENTRIES) -> None:
        if entries < 1:
            raise ValueError(f"an affinity memory needs at least 1 entry, not {entries}")
        self.entries = entries
        self._backends: OrderedDict[Hashable, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._backends)

    def get(self, key: Hashable | None) -> str | None:
        """Where `key` last ran (and it is now the most recently used), or None."""
        if key is None:
            return None
        backend = self._backends.get(key)
        if backend is not None:
            self._backends.move_to_end(key)
        return backend

    def put(self, key: Hashable | None, backend: str) -> None:
        """`key` now runs on `backend`; past the bound, the least recently used is dropped."""
        if key is None:
            return
        self._backends[key] = backend
        self._backends.move_to_end(key)
        if len(self._backends) > self.entries:
            self._backends.popitem(last=False)
