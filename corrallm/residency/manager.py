"""Residency at run time: who holds memory on which server, and making room for a start.

The decisions are the planner's and the placement's (pure); this wrapper feeds them
snapshots of the supervisors, carries out their evictions, waits (bounded by
`scheduler.maxWait`) for busy residents to go idle, places a start that may run on any
of its server's GPUs (M3) and unloads ttl-expired residents (R4). Each eviction and each
GPU placement is logged with the reason it was chosen, one line per decision.
What a process really holds is learned after each load (M2, `learning.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from corrallm.config.schema import ANY_GPU, Server
from corrallm.config.units import format_size
from corrallm.lifecycle.errors import LifecycleError
from corrallm.lifecycle.starting import Placement
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.lifecycle.transitions import Transitions
from corrallm.residency.learning import Learning, in_pools, mismatches
from corrallm.residency.measure import MemoryReader, command_key, visible_gpu
from corrallm.residency.placement import Choice, gpu_index, place
from corrallm.residency.planner import Resident, free_space, settle_idle
from corrallm.store.db import Store

log = logging.getLogger("corrallm.residency")

MEASURED_MARGIN = 1.05  # M2: a measured footprint is planned with 5 % headroom
HOLDING = frozenset(
    {State.STARTING, State.READY, State.DRAINING, State.STOPPING, State.ASLEEP, State.WAKING}
)
# W1: what bringing a backend back is taken to cost, until it is declared (swap.loadSeconds,
# swap.wakeSeconds) or measured: the planner compares a sleep with a stop by these.
DEFAULT_LOAD_SECONDS = 30.0
DEFAULT_WAKE_SECONDS = 5.0


class Placeable(Protocol):
    """What `could_fit` reads of a process: which one, and its state."""

    @property
    def id(self) -> str: ...
    @property
    def state(self) -> State: ...


class NoRoom(LifecycleError):
    """No eviction can make room now, and none came free within the wait."""

    status = 503
    management_status = 503
    code = "insufficient_capacity"


@dataclass
class Tenancy:
    """What a supervised process asks of a server's pools, and how it may be evicted.

    Planning uses `usage` (SPEC §17 M2): the declared footprint, else the estimate from the
    model file, raised per pool to what was measured of the process times 1.05. A footprint may
    name the pool `gpu` (any of the server's `gpus`, M3): `placed` says which one the
    current process was given. What was measured on that GPU is kept under `gpu` too, so a
    learned footprint follows the backend to whichever GPU it is placed on next."""

    supervisor: Supervisor
    server: str | None  # None: it takes no room in any pool (only its ttl matters)
    declared: dict[str, int] | None = None  # ramUsage as written in the config
    estimated: dict[str, int] | None = None  # from the GGUF file (ramUsage auto/omitted)
    pinned: bool = False
    ttl: float | None = None
    evict_cost: str = "medium"
    measured: dict[str, int] | None = None  # learned: this process, or an earlier one
    gpus: tuple[str, ...] = ()  # the server's interchangeable GPU pools
    placed: str | None = None  # the GPU pool the current process runs on
    granted: bool = False  # make_room let the current start (or wake) in: its memory counts
    sleep_usage: dict[str, int] | None = None  # W1: it can sleep, holding this (may name gpu)

    @property
    def wanted(self) -> dict[str, int]:
        """Declared, else estimated; may still name the placeholder pool `gpu`."""
        if self.declared is not None:
            return self.declared
        return self.estimated or {}

    @property
    def need(self) -> dict[str, int]:
        """What a start asks for, before placement: may name `gpu`."""
        need = dict(self.wanted)
        for pool, held in (self.measured or {}).items():
            need[pool] = max(need.get(pool, 0), math.ceil(held * MEASURED_MARGIN))
        return need

    @property
    def usage(self) -> dict[str, int]:
        """What planning counts now, per concrete pool once placed: asleep (and waking, until
        make_room lets the wake in), its sleepUsage (W1)."""
        return self._here(self.sleep_usage or {} if self.dozing() else self.need)

    @property
    def awake_usage(self) -> dict[str, int]:
        """What it holds awake, on the GPU it was placed on."""
        return self._here(self.need)

    @property
    def asleep_usage(self) -> dict[str, int] | None:
        """What it would hold asleep, on the GPU it was placed on; None if it cannot sleep."""
        return None if self.sleep_usage is None else self._here(self.sleep_usage)

    def _here(self, vector: Mapping[str, int]) -> dict[str, int]:
        usage = dict(vector)
        if ANY_GPU in usage and self.placed is not None:
            usage[self.placed] = usage.get(self.placed, 0) + usage.pop(ANY_GPU)
        return usage

    def dozing(self) -> bool:
        """Asleep, or waking without room granted yet: it holds its sleepUsage."""
        state = self.supervisor.state
        return state is State.ASLEEP or (state is State.WAKING and not self.granted)

    @property
    def measured_here(self) -> dict[str, int] | None:
        """`measured` with its `gpu` part on the GPU the current process was placed on."""
        if self.measured is None or self.placed is None or ANY_GPU not in self.measured:
            return None if self.measured is None else dict(self.measured)
        here = dict(self.measured)
        here[self.placed] = here.get(self.placed, 0) + here.pop(ANY_GPU)
        return here

    @property
    def command(self) -> str:
        """The key its learned footprint is kept under, beside the backend id (M2)."""
        return command_key(self.supervisor.spec)

    def holds(self) -> bool:
        """Counted in its pools: from the moment its start was let in until it stops."""
        state = self.supervisor.state
        return state in HOLDING and (state is not State.STARTING or self.granted)

    def resident(self, now: float) -> Resident:
        sup = self.supervisor
        asleep = sup.state is State.ASLEEP
        swap = sup.spec.swap
        return Resident(
            id=sup.id,
            usage=self.usage,
            idle=(sup.state is State.READY and sup.in_flight == 0) or asleep,
            pinned=self.pinned,
            last_used=sup.last_used,
            ttl_expires_at=self.ttl_expires_at(),
            evict_cost=self.evict_cost,
            asleep=asleep,
            sleep_usage=None if asleep else self.asleep_usage,
            load_seconds=_first(swap.load_seconds, sup.last_load_seconds, DEFAULT_LOAD_SECONDS),
            wake_seconds=_first(swap.wake_seconds, sup.last_wake_seconds, DEFAULT_WAKE_SECONDS),
        )

    def ttl_expires_at(self) -> float | None:
        return None if self.ttl is None else self.supervisor.last_used + self.ttl


@dataclass
class Residency:
    """Long-lived: built once with the gateway, it subscribes once to the transition bus;
    a config reload hands it the new servers and tenancies (`reconfigure`) and keeps its
    memory reader, its locks, what it learned and the placement of processes that stay."""

    servers: dict[str, Server]
    max_wait: float = 60.0
    reader: MemoryReader | None = None
    clock: Callable[[], float] = time.monotonic
    tenancies: dict[str, Tenancy] = field(default_factory=dict)
    bus: Transitions[Supervisor] | None = None

    def __post_init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._changed = asyncio.Event()
        self.learning = Learning()
        self._tasks: set[asyncio.Task[None]] = set()  # measurements under way
        self._warned: set[tuple[str, str, str]] = set()  # R5, once per run
        if self.bus is not None:
            self.bus.subscribe(moved=self._on_transition, idle=lambda _: self._notify())

    async def restore(self, store: Store) -> None:
        """M2: what earlier runs learned (read once, when the store opens) is planned with
        before the first load of this run; each new measurement is written there."""
        await self.learning.restore(store)
        for tenancy in self.tenancies.values():
            self._apply_learned(tenancy)
        self._notify()

    async def close(self) -> None:
        """Shutdown: measurements still under way are dropped (before the store closes)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def reconfigure(
        self, servers: dict[str, Server], max_wait: float, tenancies: list[Tenancy]
    ) -> None:
        """A config reload: the new pools and tenancies replace the old as a whole; what
        was measured of a process that keeps running, and where it runs, are kept."""
        previous = self.tenancies
        self.servers, self.max_wait = servers, max_wait
        self.tenancies = {}
        for tenancy in tenancies:
            old = previous.get(tenancy.supervisor.id)
            if old is not None and old.supervisor is tenancy.supervisor:
                tenancy.measured = old.measured
                tenancy.granted = old.granted
                if old.placed in tenancy.gpus:
                    tenancy.placed = old.placed
            self._apply_learned(tenancy)
            self.track(tenancy)
        self._notify()

    def _apply_learned(self, tenancy: Tenancy) -> None:
        if tenancy.measured is None:
            tenancy.measured = self.learning.get(tenancy.supervisor.id, tenancy.command)

    def track(self, tenancy: Tenancy) -> None:
        self.tenancies[tenancy.supervisor.id] = tenancy

    def residents(self, server: str, exclude: str | None = None) -> list[Tenancy]:
        return [
            t
            for t in self.tenancies.values()
            if t.server == server and t.supervisor.id != exclude and t.holds()
        ]

    def used(self, server: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for tenancy in self.residents(server):
            for pool, n in tenancy.usage.items():
                total[pool] = total.get(pool, 0) + n
        return total

    def could_fit(self, sup: Placeable) -> bool:
        """Whether a start of `sup` could be placed now, evicting idle residents if needed."""
        tenancy = self.tenancies.get(sup.id)
        if tenancy is None or tenancy.server is None:
            return True
        if sup.state in HOLDING and not tenancy.dozing():
            return True
        return self._choose(tenancy).fits

    async def make_room(self, sup: Supervisor) -> Placement:
        """The supervisor's `room` seam: return once `sup` fits, evicting as planned (R2),
        on the GPU chosen for it when it may run on any of its server's (M3)."""
        tenancy = self.tenancies.get(sup.id)
        if tenancy is None or tenancy.server is None:
            return Placement()
        deadline = self.clock() + self.max_wait
        lock = self._locks.setdefault(tenancy.server, asyncio.Lock())
        logged: set[str] = set()  # GPUs whose choice was logged: once each, evictions or not
        async with lock:
            while True:
                choice = self._choose(tenancy)
                if choice.gpu is not None and choice.gpu not in logged:
                    logged.add(choice.gpu)
                    self._log_placement(tenancy, choice)
                if choice.fits and not choice.evict and not choice.sleep:
                    current = self.tenancies.get(sup.id)
                    gpu = choice.gpu or (tenancy.placed if tenancy.dozing() else None)
                    for held in (tenancy, current):  # a reload meanwhile made `current`
                        if held is not None and held.supervisor is sup:
                            held.placed, held.granted = gpu, True
                    if gpu is None:
                        return Placement()
                    return Placement(gpu_index(gpu, tenancy.gpus))
                if choice.fits:
                    await self._evict(tenancy, choice)
                    continue
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise NoRoom(self._no_room_message(tenancy, choice))
                await self._wait_change(remaining)

    async def reap_expired(self) -> None:
        """R4: put to sleep (W1: where its sleepUsage fits and waking is cheaper than loading)
        or unload idle, unpinned residents whose `sticky.ttl` has run out."""
        now = self.clock()
        for tenancy in list(self.tenancies.values()):
            sup = tenancy.supervisor
            expires = tenancy.ttl_expires_at()
            if (
                not tenancy.pinned
                and expires is not None
                and expires <= now
                and sup.state is State.READY
                and sup.in_flight == 0
            ):
                action = "stop"
                resident = tenancy.resident(now)
                if tenancy.sleep_usage is not None and tenancy.server is None:
                    # It takes no room in any pool (no footprint): asleep it takes none either.
                    action = "sleep" if resident.may_sleep() else "stop"
                elif tenancy.sleep_usage is not None:
                    action = settle_idle(self._free(tenancy.server), resident)
                verb = "sleep" if action == "sleep" else "unload"
                log.info(
                    "%s backend=%s reason=ttl-expired idle=%.0fs",
                    verb,
                    sup.id,
                    now - sup.last_used,
                )
                if action != "sleep" or not await sup.fall_asleep():
                    await sup.unload()

    # -- the machinery ---------------------------------------------------------------

    def _free(self, server: str | None) -> dict[str, int]:
        if server is None:
            return {}
        pools = self.servers[server]
        now = self.clock()
        return free_space(
            pools.pools, pools.reserve, [t.resident(now) for t in self.residents(server)]
        )

    def _choose(self, tenancy: Tenancy) -> Choice:
        """Plan a start on any of its GPUs, or a wake (W1) on the GPU it sleeps on."""
        assert tenancy.server is not None, "only tenancies that take room are planned"
        server = self.servers[tenancy.server]
        now = self.clock()
        residents = [t.resident(now) for t in self.residents(tenancy.server, tenancy.supervisor.id)]
        need, gpus = tenancy.need, tenancy.gpus
        if tenancy.dozing():
            need, gpus = tenancy.awake_usage, ()
        return place(server.pools, server.reserve, residents, need, gpus, now)

    def _log_placement(self, tenancy: Tenancy, choice: Choice) -> None:
        assert choice.gpu is not None
        log.info(
            "place backend=%s server=%s gpu=%s index=%s reason=%s needs=%s evicts=%s",
            tenancy.supervisor.id,
            tenancy.server,
            choice.gpu,
            gpu_index(choice.gpu, tenancy.gpus),
            choice.why,
            _sizes(choice.need),
            ",".join(choice.evict) or "-",
        )

    async def _evict(self, tenancy: Tenancy, choice: Choice) -> None:
        """Carry out a plan: its sleepers fall asleep (W1; one whose sleep fails is stopped
        by its supervisor), the rest are stopped."""
        now = self.clock()
        for victim in (*choice.sleep, *choice.evict):
            r = self.tenancies[victim].resident(now)
            slept = victim in choice.sleep
            reason = "ttl-expired" if r.expired(now) else f"evictCost={r.evict_cost}"
            if r.asleep:
                reason = "asleep"
            frees = r.frees("sleep" if slept else "stop")
            log.info(
                "%s backend=%s for=%s server=%s reason=%s idle=%.0fs frees=%s%s",
                "sleep" if slept else "evict",
                victim,
                tenancy.supervisor.id,
                tenancy.server,
                reason,
                now - r.last_used,
                _sizes({pool: n for pool, n in frees.items() if n > 0}),
                f" gpu={choice.gpu}" if choice.gpu else "",
            )
        sups = [self.tenancies[v].supervisor for v in (*choice.sleep, *choice.evict)]
        await asyncio.gather(
            *(s.fall_asleep() if s.id in choice.sleep else s.unload() for s in sups)
        )

    def _no_room_message(self, tenancy: Tenancy, choice: Choice) -> str:
        assert tenancy.server is not None, "only tenancies that take room are planned"
        holders = []
        for other in self.residents(tenancy.server, tenancy.supervisor.id):
            sup = other.supervisor
            why = (
                "pinned"
                if other.pinned
                else (f"busy, {sup.in_flight} in flight" if sup.in_flight else str(sup.state))
            )
            holders.append(f"{sup.id} ({_sizes(other.usage)}, {why})")
        if choice.short:
            tried = "; ".join(f"on {gpu} by {_sizes(s)}" for gpu, s in choice.short.items())
            where = f"on any of its GPUs {', '.join(choice.short)}"
            short = f"short {tried}"
        else:
            where, short = "", f"short by {_sizes(choice.plan.short or {})}"
        return (
            f"No room on server '{tenancy.server}' {where}{' ' if where else ''}"
            f"for backend '{tenancy.supervisor.id}' (needs {_sizes(tenancy.need)}; {short}) "
            f"after waiting {self.max_wait:g}s (scheduler.maxWait). Memory is held by: "
            f"{', '.join(holders) or 'nothing (the reserve leaves too little)'}. "
            "Retry later, unload one of them, or lower its ramUsage."
        )

    def _on_transition(self, sup: Supervisor, old: State, new: State) -> None:
        tracked = self.tenancies.get(sup.id)
        mine = tracked is not None and tracked.supervisor is sup
        if tracked is not None and mine and new not in HOLDING:
            tracked.placed, tracked.granted = None, False  # its memory is given back
        if tracked is not None and mine and new is State.ASLEEP:
            tracked.granted = False  # it holds its sleepUsage until a wake is let in
        if tracked is not None and mine and new is State.READY and self.reader is not None:
            task = asyncio.get_running_loop().create_task(self._measure(sup))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if new not in HOLDING or new is State.ASLEEP:
            self._notify()

    async def _measure(self, sup: Supervisor) -> None:
        """M2, R5: what the ready process really holds, learned beside what it declared."""
        tenancy = self.tenancies.get(sup.id)
        pid, reader = sup.pid, self.reader
        if tenancy is None or tenancy.server is None or pid is None or reader is None:
            return
        held, visible = await asyncio.to_thread(_read, reader, pid, bool(tenancy.gpus))
        if self.tenancies.get(sup.id) is not tenancy or sup.pid != pid or not held:
            return  # reloaded away, or a new process, meanwhile: this reading is stale
        if tenancy.placed is None and visible is not None:
            # Re-adopted after a restart of corrallm: it runs where an earlier run put it.
            by_index = {gpu_index(g, tenancy.gpus): g for g in tenancy.gpus}
            tenancy.placed = by_index.get(visible)
        measured = in_pools(held, self.servers[tenancy.server], tenancy.gpus, tenancy.placed)
        if not measured:
            return
        tenancy.measured = measured
        self._notify()
        self._warn_off(tenancy, measured)
        await self.learning.record(sup.id, tenancy.command, measured)

    def _warn_off(self, tenancy: Tenancy, measured: Mapping[str, int]) -> None:
        """R5: once per backend, command and pool in a run, a footprint that was off."""
        sid = tenancy.supervisor.id
        for pool, kind, said, real in mismatches(measured, tenancy.declared, tenancy.estimated):
            if (sid, tenancy.command, pool) in self._warned:
                continue
            self._warned.add((sid, tenancy.command, pool))
            advice = (
                "update ramUsage so eviction plans with real numbers"
                if kind == "declared"
                else "the estimate is off; planning uses the measurement plus 5 % from now on"
            )
            log.warning(
                "ramUsage mismatch backend=%s pool=%s %s=%s measured=%s: %s",
                sid,
                pool,
                kind,
                format_size(said),
                format_size(real),
                advice,
            )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, within: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), within)


def _read(
    reader: MemoryReader, pid: int, placed_anywhere: bool
) -> tuple[dict[str, int], str | None]:
    """In a worker thread: what the process holds, and (for a backend placed on any GPU)
    the CUDA_VISIBLE_DEVICES it runs with."""
    return reader.read(pid) or {}, visible_gpu(pid) if placed_anywhere else None


def _sizes(vector: Mapping[str, int]) -> str:
    return ", ".join(f"{pool} {format_size(n)}" for pool, n in sorted(vector.items())) or "-"


def _first(*values: float | None) -> float:
    """The first value that is set (the last one always is)."""
    return next(v for v in values if v is not None)
