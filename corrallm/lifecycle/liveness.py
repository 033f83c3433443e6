"""Watching a backend's health (SPEC §17 M4, M5): the small decisions, kept apart from the
supervisor that acts on them.

- `StallWatch` decides when a start has stalled: no new output and no change in the
  health answer for `health.stallTimeout` (a load that keeps logging is never stalled).
- `Misses` counts consecutive failed liveness probes of a ready backend.
- `bounded` runs one probe for at most a given time, measured with the injected sleep, so
  a probe that hangs cannot delay the liveness loop beyond its bound.

Nothing here reads the clock or logs; the supervisor passes `now` in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Literal

# Why a backend was marked failed: the `reason` label of corrallm_backend_failures_total
# and of the lifecycle event. The first two are M4 (it was ready), the rest L3/M5 (a start;
# port_taken: another program listens on the port the backend was to bind).
FailureReason = Literal[
    "exited", "unresponsive", "start_exited", "start_timeout", "stalled", "port_taken"
]

# A hung process is killed after this much grace at most (not the full stopGrace): it does
# not answer, so waiting politely only keeps its in-flight requests hanging, and its memory.
HUNG_GRACE: Final = 1.0
# The liveness probe's own bound (HealthProbe's total timeout); never more than the interval.
PROBE_BOUND: Final = 2.0

_UNSEEN: Final = object()


@dataclass
class StallWatch:
    """A start is stalled once nothing changed (output, health answer) for `timeout` seconds."""

    timeout: float
    since: float
    _answer: object = field(default=_UNSEEN)
    _output: int = -1

    def observe(self, now: float, answer: int | None, output: int) -> bool:
        """One health poll: its `answer` and how much output there is so far; True when the
        start has stalled."""
        if answer != self._answer or output != self._output:
            self._answer, self._output, self.since = answer, output, now
        return now - self.since >= self.timeout


@dataclass
class Misses:
    """Consecutive failed liveness probes; `limit` of them make a backend unresponsive."""

    limit: int
    count: int = 0
    last: int | None = None  # the latest failed answer (None: no answer)

    def observe(self, answer: int | None, healthy: bool) -> bool:
        """One probe; True once `limit` probes in a row have failed."""
        if healthy:
            self.count = 0
            return False
        self.count, self.last = self.count + 1, answer
        return self.count >= self.limit

    def describe(self, bound: float) -> str:
        last = f"answered {self.last}" if self.last is not None else f"no answer within {bound:g}s"
        return f"{self.count} health checks in a row failed (the last: {last})"


Sleep = Callable[[float], Coroutine[Any, Any, None]]


async def bounded(
    probe: Callable[[str], Awaitable[int | None]],
    url: str,
    bound: float,
    sleep: Sleep,
    exited: asyncio.Future[int] | None = None,
) -> int | None:
    """One probe that answers within `bound` seconds of `sleep`, else None (no answer). It
    ends early, with None, if `exited` finishes first."""
    asking = asyncio.ensure_future(probe(url))
    timer = asyncio.ensure_future(sleep(bound))
    waits: set[asyncio.Future[Any]] = {asking, timer}
    if exited is not None:
        waits.add(exited)
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not asking.done():
            asking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asking
    if asking.cancelled():
        return None
    return asking.result()
