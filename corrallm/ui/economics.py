"""The economics ledger (SPEC §11 D1): what sleeping backends gave back to the pool.

Per backend: wakes, sleeps, time asleep, wake latencies observed, and GPU-hours returned
= sum(hours asleep * the backend's GPU pool footprint) / total GPU capacity (pools whose
name starts with `gpu`). Counters start at install and live in the store (migration 4).

The ledger listens to every supervisor's transitions (a plain, synchronous callback that
only updates memory); writes happen in a background task, never on the request path.
Time asleep is folded into the counters at each transition and at each checkpoint, so a
restart loses at most one checkpoint of it; the gateway's downtime is never counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from corrallm.lifecycle.state import State

if TYPE_CHECKING:
    from corrallm.gateway import Gateway
    from corrallm.lifecycle.supervisor import Supervisor

log = logging.getLogger("corrallm.ui")

ASLEEP = frozenset({State.STOPPED, State.PAUSED, State.FAILED})
CHECKPOINT_SECONDS = 30.0
GPU_PREFIX = "gpu"


@dataclass
class Counters:
    backend: str
    first_seen: float
    wakes: int = 0
    sleeps: int = 0
    asleep_seconds: float = 0.0
    wake_count: int = 0
    wake_seconds_total: float = 0.0
    wake_seconds_max: float = 0.0
    wake_seconds_last: float | None = None
    gpu_hours: float = 0.0

    def merge(self, stored: dict[str, Any]) -> None:
        """Add what the store kept (earlier runs) to what this run counted so far."""
        self.first_seen = min(self.first_seen, stored["first_seen"])
        for name in ("wakes", "sleeps", "asleep_seconds", "wake_count", "wake_seconds_total"):
            setattr(self, name, getattr(self, name) + stored[name])
        self.gpu_hours += stored["gpu_hours"]
        self.wake_seconds_max = max(self.wake_seconds_max, stored["wake_seconds_max"])
        if self.wake_seconds_last is None:
            self.wake_seconds_last = stored["wake_seconds_last"]


COLUMNS = [f.name for f in fields(Counters)]
UPSERT = (
    f"INSERT INTO economics ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
    "ON CONFLICT (backend) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in COLUMNS if c != "backend")
)


class Economics:
    def __init__(self, gateway: Gateway, clock: Callable[[], float] = time.time) -> None:
        self.gw = gateway
        self.clock = clock
        self.counters: dict[str, Counters] = {}
        self._asleep_since: dict[str, float] = {}
        self._woke: set[str] = set()  # awake since the last counted sleep
        self._restored = False
        self._flushing: asyncio.Task[None] | None = None
        self._dirty = False
        self._checkpoints: asyncio.Task[None] | None = None
        now = clock()
        gateway.bus.subscribe(moved=self.on_transition)
        for sup in gateway.supervisors.values():
            self.counters[sup.id] = Counters(sup.id, now)
            if sup.state in ASLEEP:
                self._asleep_since[sup.id] = now
            else:
                self._woke.add(sup.id)

    # -- footprints -----------------------------------------------------------------

    def footprint(self, backend: str) -> int:
        """Bytes the backend declares in GPU pools (what its sleep hands back)."""
        tenancy = self.gw.residency.tenancies.get(backend)
        if tenancy is None:
            return 0
        return sum(v for pool, v in tenancy.usage.items() if pool.startswith(GPU_PREFIX))

    def gpu_capacity(self) -> int:
        return sum(
            capacity
            for server in self.gw.config.servers.values()
            for pool, capacity in server.pools.items()
            if pool.startswith(GPU_PREFIX)
        )

    # -- the listener (synchronous, memory only) ------------------------------------

    def on_transition(self, sup: Supervisor, old: State, new: State) -> None:
        now = self.clock()
        c = self.counters.setdefault(sup.id, Counters(sup.id, now))
        if old in ASLEEP and new not in ASLEEP:
            self._fold(sup.id, now)
            self._asleep_since.pop(sup.id, None)
        elif old not in ASLEEP and new in ASLEEP:
            if sup.id in self._woke:  # a failed start is not a sleep
                c.sleeps += 1
                self._woke.discard(sup.id)
            self._asleep_since[sup.id] = now
        if old is State.STARTING and new is State.READY:
            c.wakes += 1
            self._woke.add(sup.id)
            latency = sup.last_load_seconds
            if latency is not None:
                c.wake_count += 1
                c.wake_seconds_total += latency
                c.wake_seconds_max = max(c.wake_seconds_max, latency)
                c.wake_seconds_last = latency
        self._schedule_flush()

    def _fold(self, backend: str, now: float) -> None:
        """Move the open asleep interval into the counters (it stays open if still asleep)."""
        since = self._asleep_since.get(backend)
        if since is None:
            return
        seconds = max(0.0, now - since)
        c = self.counters[backend]
        c.asleep_seconds += seconds
        capacity = self.gpu_capacity()
        if capacity:
            c.gpu_hours += seconds / 3600 * self.footprint(backend) / capacity
        self._asleep_since[backend] = now

    # -- persistence (off the request path) -----------------------------------------

    async def start(self) -> None:
        """Once the store is open: add earlier runs' counters, then checkpoint regularly."""
        rows = await self.gw.store.query(f"SELECT {', '.join(COLUMNS)} FROM economics")
        now = self.clock()
        for row in rows:
            stored = dict(row)
            self.counters.setdefault(stored["backend"], Counters(stored["backend"], now)).merge(
                stored
            )
        self._restored = True
        await self.flush()
        self._checkpoints = asyncio.create_task(self._checkpoint_loop())

    async def stop(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checkpoints
        if self._flushing is not None:
            with contextlib.suppress(Exception):
                await self._flushing
        if self._restored:
            await self.flush()

    async def flush(self) -> None:
        now = self.clock()
        for backend in list(self._asleep_since):
            self._fold(backend, now)
        self._dirty = False
        rows = [[getattr(c, name) for name in COLUMNS] for c in self.counters.values()]
        await self.gw.store.execute_many(UPSERT, rows)

    def _schedule_flush(self) -> None:
        self._dirty = True
        if not self._restored or (self._flushing is not None and not self._flushing.done()):
            return
        with contextlib.suppress(RuntimeError):  # no loop: the next checkpoint writes it
            self._flushing = asyncio.get_running_loop().create_task(self._flush_dirty())

    async def _flush_dirty(self) -> None:
        while self._dirty:
            try:
                await self.flush()
            except Exception:
                log.exception("economics ledger write failed; the next checkpoint retries")
                return

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_SECONDS)
            try:
                await self.flush()
            except Exception:
                log.exception("economics checkpoint failed; trying again")

    # -- the view -------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        now = self.clock()
        capacity = self.gpu_capacity()
        rows = []
        for backend, c in sorted(self.counters.items()):
            open_seconds = now - self._asleep_since[backend] if backend in self._asleep_since else 0
            footprint = self.footprint(backend)
            gpu_hours = c.gpu_hours
            if capacity and open_seconds:
                gpu_hours += open_seconds / 3600 * footprint / capacity
            rows.append(
                {
                    "backend": backend,
                    "asleep_now": backend in self._asleep_since,
                    "wakes": c.wakes,
                    "sleeps": c.sleeps,
                    "asleep_seconds": c.asleep_seconds + max(0.0, open_seconds),
                    "wake_count": c.wake_count,
                    "wake_seconds_last": c.wake_seconds_last,
                    "wake_seconds_avg": (
                        c.wake_seconds_total / c.wake_count if c.wake_count else None
                    ),
                    "wake_seconds_max": c.wake_seconds_max if c.wake_count else None,
                    "gpu_footprint": footprint,
                    "gpu_hours": gpu_hours,
                    "first_seen": c.first_seen,
                }
            )
        total = sum(r["gpu_hours"] for r in rows)
        price = self.gw.config.ledger.gpu_hour_price
        return {
            "rows": rows,
            "since": min((c.first_seen for c in self.counters.values()), default=now),
            "gpu_capacity": capacity,
            "gpu_hours": total,
            "gpu_hour_price": price,
            "avoided_usd": total * price if price is not None else None,
        }
