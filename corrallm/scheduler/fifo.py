"""The interim admission gate: `maxConcurrent` slots per backend, excess waits FIFO.

The weighted-fairshare scheduler replaces this. A waiter that is cancelled (its client
went away) leaves the queue; a slot granted to a waiter cancelled in the same instant is
handed on, so no slot is ever lost.
"""

from __future__ import annotations

import asyncio
from collections import deque


class SlotGate:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.in_use < self.capacity and not self._waiters:
            self.in_use += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted and cancelled at once: pass the slot on
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next waiter
                return
        self.in_use -= 1
