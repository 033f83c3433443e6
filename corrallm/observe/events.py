"""The live event stream (SPEC §10 P4): lifecycle transitions, admission load, queue depth,
usage, log lines and reservation changes, fanned out to SSE subscribers.

Publishing never waits, and a subscriber that cannot keep up never grows corrallm's
memory past a bound (SPEC §22 T5): the serialized events queued inside corrallm for one
subscriber are at most `limit` bytes (`CORRALLM_EVENT_BUFFER_MB`, 8 MB by default, read
once at startup). A subscriber that falls further behind has its queue freed at once,
is sent a last `event: overflow`, and its stream ends (an `EventSource` reconnects by
itself after `retry`; a following gateway reconnects and reads the overview again).
A bound in bytes rather than in events: one log line may be 64 kB.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from corrallm.config.units import env_value

DEFAULT_BUFFER_MB = 8.0
HEARTBEAT_SECONDS = 15.0


def buffer_from_env(env: Mapping[str, str]) -> int:
    """Bytes a subscriber may have queued, from `CORRALLM_EVENT_BUFFER_MB` (MB = 10^6
    bytes, as everywhere in corrallm); ValueError naming the variable when it is bad."""
    mb = env_value(env, "CORRALLM_EVENT_BUFFER_MB", float, "a positive number of MB")
    return max(1, int((DEFAULT_BUFFER_MB if mb is None else mb) * 10**6))


@dataclass(eq=False)  # identity: each subscription is its own
class Subscription:
    limit: int  # bytes it may have queued
    kinds: frozenset[str] | None = None  # None: every kind
    buffer: deque[bytes] = field(default_factory=deque)
    queued: int = 0  # bytes in `buffer`
    overflowed: int = 0  # when it fell behind: the bytes it would have had queued
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, kind: str, frame: bytes) -> bool:
        """Queue `frame` if of a wanted kind; False when that would pass the limit: the
        queue is freed and the subscription ends (`overflowed`)."""
        if self.kinds is not None and kind not in self.kinds:
            return True
        queued = self.queued + len(frame)
        if queued > self.limit:
            self.buffer.clear()
            self.queued, self.overflowed = 0, queued
            self.wake.set()
            return False
        self.buffer.append(frame)
        self.queued = queued
        self.wake.set()
        return True

    def take(self) -> bytes:
        frame = self.buffer.popleft()
        self.queued -= len(frame)
        return frame


class EventBus:
    def __init__(self, limit: int = int(DEFAULT_BUFFER_MB * 10**6)) -> None:
        self.limit = limit  # per subscriber, in bytes (`corrallm serve` sets it from env)
        self._subscribers: set[Subscription] = set()
        self._ids = itertools.count(1)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, kind: str, data: dict[str, Any]) -> None:
        if not self._subscribers:
            return
        payload = {"t": time.time(), **data}
        frame = (
            f"id: {next(self._ids)}\nevent: {kind}\ndata: ".encode()
            + orjson.dumps(payload)
            + b"\n\n"
        )
        behind = [sub for sub in self._subscribers if not sub.offer(kind, frame)]
        for sub in behind:  # T5: no more events for it; its stream ends with `overflow`
            self._subscribers.discard(sub)

    async def stream(
        self, kinds: frozenset[str] | None = None, heartbeat: float = HEARTBEAT_SECONDS
    ) -> AsyncIterator[bytes]:
        """SSE frames for one subscriber, with heartbeats, until the consumer goes away
        or falls more than `limit` bytes behind (then a last `overflow` event)."""
        sub = Subscription(self.limit, kinds)
        self._subscribers.add(sub)
        try:
            yield b"retry: 2000\n: connected\n\n"
            while True:
                if not sub.buffer and not sub.overflowed:
                    sub.wake.clear()
                    try:
                        await asyncio.wait_for(sub.wake.wait(), heartbeat)
                    except TimeoutError:
                        yield b": heartbeat\n\n"
                        continue
                if sub.overflowed:
                    note = {"t": time.time(), "queued_bytes": sub.overflowed, "limit": sub.limit}
                    yield b"event: overflow\ndata: " + orjson.dumps(note) + b"\n\n"
                    return
                while sub.buffer and not sub.overflowed:
                    yield sub.take()
        finally:
            self._subscribers.discard(sub)
