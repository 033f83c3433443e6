"""The economics ledger (SPEC §11 D1, §14): what sleeping backends gave back to the pool.

Per backend: wakes, sleeps, time asleep, wake latencies observed, and GPU-hours returned
= sum(hours asleep * the GPU memory its sleep hands back) / total GPU capacity (pools whose
name starts with `gpu`). A backend that has never loaded (no wake counted, in this run or an
earlier one) returns nothing, and so avoids no cost: it never held what it would give back;
its time asleep is still shown. Sleeps and wakes are of two kinds, counted alike: a stop and the
next start (stopped, paused or failed is asleep), and a real sleep (W1: `asleep`, which
hands back its GPU footprint less what its `sleepUsage` keeps in GPU pools) and the wake
that ends it, timed by the supervisor. Counters start at install and live in the store
(migration 4).

A long-lived owner: built once with the gateway, it subscribes once to the transition bus
(a plain, synchronous listener that only updates memory) and asks the residency, at each
use, which backends the config in force has and what they hold. So a config reload needs
nothing from it: every backend of the current config has a row, the ones a reload added
included, and the counters of a backend that stays carry on. A backend is first seen at
start, at a transition, a view or a checkpoint (every 30 s), whichever comes first after
the config that added it; its time asleep counts from then. Writes happen in a
background task, never on the request path. Time asleep is folded into the counters at
each transition and each checkpoint, so a restart loses at most one checkpoint of it; the
gateway's downtime is never counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, Protocol, TypeVar

from corrallm.lifecycle.state import State
from corrallm.lifecycle.transitions import Transitions
from corrallm.store import economics as table
from corrallm.store.db import Store

log = logging.getLogger("corrallm.cost")

ASLEEP = frozenset({State.STOPPED, State.PAUSED, State.FAILED, State.ASLEEP})
# Transitions that end a wake, and which of the supervisor's timings measured it.
WAKES = {
    (State.STARTING, State.READY): "last_load_seconds",
    (State.WAKING, State.READY): "last_wake_seconds",
}
CHECKPOINT_SECONDS = 30.0
GPU_PREFIX = "gpu"


# -- what the ledger reads of the config in force (the residency provides all of it) ----


class Process(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def state(self) -> State: ...
    @property
    def last_load_seconds(self) -> float | None: ...
    @property
    def last_wake_seconds(self) -> float | None: ...


P = TypeVar("P", bound=Process)  # what the bus carries: a Supervisor


class Holding(Protocol):
    """A supervised process and the pools it declares (`residency.manager.Tenancy`)."""

    @property
    def supervisor(self) -> Process: ...
    @property
    def need(self) -> Mapping[str, int]: ...  # what it holds awake
    @property
    def sleep_usage(self) -> Mapping[str, int] | None: ...  # what it keeps asleep (W1)


class Pools(Protocol):
    @property
    def pools(self) -> Mapping[str, int]: ...


class Holdings(Protocol):
    """The current backends and servers (`residency.manager.Residency`)."""

    @property
    def tenancies(self) -> Mapping[str, Holding]: ...
    @property
    def servers(self) -> Mapping[str, Pools]: ...


def gpu_bytes(pools: Mapping[str, int]) -> int:
    """The part of a pool vector in GPU pools."""
    return sum(v for pool, v in pools.items() if pool.startswith(GPU_PREFIX))


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

    def merge(self, stored: Mapping[str, Any]) -> None:
        """Add what the store kept (earlier runs) to what this run counted so far."""
        self.first_seen = min(self.first_seen, stored["first_seen"])
        self.wakes += stored["wakes"]
        self.sleeps += stored["sleeps"]
        self.asleep_seconds += stored["asleep_seconds"]
        self.wake_count += stored["wake_count"]
        self.wake_seconds_total += stored["wake_seconds_total"]
        self.gpu_hours += stored["gpu_hours"]
        self.wake_seconds_max = max(self.wake_seconds_max, stored["wake_seconds_max"])
        if self.wake_seconds_last is None:
            self.wake_seconds_last = stored["wake_seconds_last"]

    def values(self) -> list[Any]:
        return [getattr(self, name) for name in table.COLUMNS]


assert tuple(f.name for f in fields(Counters)) == table.COLUMNS, "the store's columns"


class Economics(Generic[P]):
    def __init__(
        self,
        bus: Transitions[P],
        store: Store,
        holdings: Holdings,
        gpu_hour_price: Callable[[], float | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.holdings = holdings
        self.gpu_hour_price = gpu_hour_price
        self.clock = clock
        self.counters: dict[str, Counters] = {}
        self._seen: set[str] = set()  # backends whose first state has been looked at
        self._asleep_since: dict[str, float] = {}
        self._kept: dict[str, int] = {}  # GPU bytes a real sleep (W1) keeps, while it lasts
        self._woke: set[str] = set()  # awake since the last counted sleep
        self._restored = False
        self._flushing: asyncio.Task[None] | None = None
        self._dirty = False
        self._checkpoints: asyncio.Task[None] | None = None
        bus.subscribe(moved=self.on_transition)
        self._sync(clock())

    # -- the config in force --------------------------------------------------------

    def footprint(self, backend: str) -> int:
        """Bytes the backend holds awake in GPU pools."""
        holding = self.holdings.tenancies.get(backend)
        return 0 if holding is None else gpu_bytes(holding.need)

    def returned(self, backend: str) -> int:
        """GPU bytes its open sleep hands back: all of them, but for what a real sleep (W1)
        keeps in GPU pools."""
        return max(0, self.footprint(backend) - self._kept.get(backend, 0))

    def gpu_capacity(self) -> int:
        return sum(gpu_bytes(server.pools) for server in self.holdings.servers.values())

    def _sync(self, now: float) -> Mapping[str, Holding]:
        """Give every backend of the current config its counters (a reload may have added
        some: they start asleep or awake as they are now); stop the clock of removed ones."""
        current = self.holdings.tenancies
        for backend, holding in current.items():
            if backend not in self._seen:
                self._first_seen(backend, holding.supervisor.state, now)
        for backend in (self._seen | self._asleep_since.keys() | self._woke) - current.keys():
            self._fold(backend, now)
            self._close(backend)
            self._woke.discard(backend)
            self._seen.discard(backend)
        return current

    def _first_seen(self, backend: str, state: State, now: float) -> None:
        self._seen.add(backend)
        self.counters.setdefault(backend, Counters(backend, now))
        if backend in self._asleep_since or backend in self._woke:
            return  # its transitions were heard before the reload made it current
        if state in ASLEEP:
            self._open(backend, state, now)
        else:
            self._woke.add(backend)

    # -- the listener (synchronous, memory only) ------------------------------------

    def on_transition(self, sup: Process, old: State, new: State) -> None:
        now = self.clock()
        if sup.id not in self._seen and sup.id in self.holdings.tenancies:
            self._first_seen(sup.id, old, now)  # as it was before this move
        self._sync(now)
        c = self.counters.setdefault(sup.id, Counters(sup.id, now))
        if old in ASLEEP and new not in ASLEEP:
            self._fold(sup.id, now)
            self._close(sup.id)
        elif old not in ASLEEP and new in ASLEEP:
            if sup.id in self._woke:  # a failed start or wake is not a sleep
                c.sleeps += 1
                self._woke.discard(sup.id)
            self._open(sup.id, new, now)
        timing = WAKES.get((old, new))
        if timing is not None:
            c.wakes += 1
            self._woke.add(sup.id)
            latency = getattr(sup, timing)
            if latency is not None:
                c.wake_count += 1
                c.wake_seconds_total += latency
                c.wake_seconds_max = max(c.wake_seconds_max, latency)
                c.wake_seconds_last = latency
        self._schedule_flush()

    def _open(self, backend: str, state: State, now: float) -> None:
        self._asleep_since[backend] = now
        holding = self.holdings.tenancies.get(backend)
        if state is State.ASLEEP and holding is not None and holding.sleep_usage:
            self._kept[backend] = gpu_bytes(holding.sleep_usage)

    def _close(self, backend: str) -> None:
        self._asleep_since.pop(backend, None)
        self._kept.pop(backend, None)

    def _fold(self, backend: str, now: float) -> None:
        """Move the open asleep interval into the counters (it stays open if still asleep)."""
        since = self._asleep_since.get(backend)
        if since is None:
            return
        seconds = max(0.0, now - since)
        c = self.counters[backend]
        c.asleep_seconds += seconds
        capacity = self.gpu_capacity()
        if capacity and c.wakes:  # never loaded: it held nothing, so it gave nothing back
            c.gpu_hours += seconds / 3600 * self.returned(backend) / capacity
        self._asleep_since[backend] = now

    # -- persistence (off the request path) -----------------------------------------

    async def start(self) -> None:
        """Once the store is open: add earlier runs' counters, then checkpoint regularly."""
        now = self.clock()
        self._sync(now)
        for stored in await table.read(self.store):
            backend = stored["backend"]
            self.counters.setdefault(backend, Counters(backend, now)).merge(stored)
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
        self._sync(now)
        for backend in list(self._asleep_since):
            self._fold(backend, now)
        self._dirty = False
        await table.write(self.store, [c.values() for c in self.counters.values()])

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
        """The ledger now (times in unix seconds; the service layer formats them): one row
        per backend of the config in force."""
        now = self.clock()
        current = self._sync(now)
        capacity = self.gpu_capacity()
        rows: list[dict[str, Any]] = []
        for backend in sorted(current):
            c = self.counters[backend]
            since = self._asleep_since.get(backend)
            open_seconds = max(0.0, now - since) if since is not None else 0.0
            footprint = self.footprint(backend)
            gpu_hours = c.gpu_hours
            if capacity and open_seconds and c.wakes:
                gpu_hours += open_seconds / 3600 * self.returned(backend) / capacity
            rows.append(
                {
                    "backend": backend,
                    "asleep_now": since is not None,
                    "wakes": c.wakes,
                    "sleeps": c.sleeps,
                    "asleep_seconds": c.asleep_seconds + open_seconds,
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
        total = sum(float(r["gpu_hours"]) for r in rows)
        price = self.gpu_hour_price()
        return {
            "rows": rows,
            "since": min((float(r["first_seen"]) for r in rows), default=now),
            "gpu_capacity": capacity,
            "gpu_hours": total,
            "gpu_hour_price": price,
            "avoided_usd": total * price if price is not None else None,
        }
