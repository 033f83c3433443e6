"""The live event stream (SPEC §10 P4): lifecycle transitions, admission load, queue depth,
usage, log lines and reservation changes, fanned out to SSE subscribers.

Publishing never waits: each subscriber has a bounded buffer, and when a slow consumer
falls behind its oldest events are dropped and counted (the count is sent to it), so a
stalled dashboard can never slow the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

BUFFER = 1000  # events kept per subscriber
HEARTBEAT_SECONDS = 15.0


@dataclass(eq=False)  # identity: each subscription is its own
class Subscription:
    kinds: frozenset[str] | None = None  # None: every kind
    buffer: deque[bytes] = field(default_factory=lambda: deque(maxlen=BUFFER))
    dropped: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, kind: str, frame: bytes) -> None:
        if self.kinds is not None and kind not in self.kinds:
            return
        if len(self.buffer) == self.buffer.maxlen:
            self.dropped += 1  # deque drops the oldest itself
        self.buffer.append(frame)
        self.wake.set()


class EventBus:
    def __init__(self) -> None:
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
        for sub in self._subscribers:
            sub.offer(kind, frame)

    async def stream(
        self, kinds: frozenset[str] | None = None, heartbeat: float = HEARTBEAT_SECONDS
    ) -> AsyncIterator[bytes]:
        """SSE frames for one subscriber, with heartbeats, until the consumer goes away."""
        sub = Subscription(kinds)
        self._subscribers.add(sub)
        try:
            yield b"retry: 2000\n: connected\n\n"
            while True:
                if not sub.buffer:
                    sub.wake.clear()
                    try:
                        await asyncio.wait_for(sub.wake.wait(), heartbeat)
                    except TimeoutError:
                        yield b": heartbeat\n\n"
                        continue
                if sub.dropped:
                    note = orjson.dumps({"t": time.time(), "dropped": sub.dropped})
                    sub.dropped = 0
                    yield b"event: dropped\ndata: " + note + b"\n\n"
                while sub.buffer:
                    yield sub.buffer.popleft()
        finally:
            self._subscribers.discard(sub)
