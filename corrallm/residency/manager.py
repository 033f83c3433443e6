"""Residency at run time: who holds memory on which server, and making room for a start.

The decisions are the planner's (pure); this wrapper feeds it snapshots of the
supervisors, carries out its evictions, waits (bounded by `scheduler.maxWait`) for busy
residents to go idle, and unloads ttl-expired residents (R4). Each eviction is logged
with the reason it was chosen, one line per victim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from corrallm.config.schema import ANY_GPU, Server
from corrallm.config.units import format_size
from corrallm.lifecycle.errors import LifecycleError
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Placement, Supervisor
from corrallm.lifecycle.transitions import Transitions
from corrallm.residency.measure import MemoryReader
from corrallm.residency.planner import Plan, Resident, plan

log = logging.getLogger("corrallm.residency")

MEASURED_MARGIN = 1.05  # M2: a measured footprint is planned with 5 % headroom
HOLDING = frozenset({State.STARTING, State.READY, State.DRAINING, State.STOPPING})


class NoRoom(LifecycleError):
    """No eviction can make room now, and none came free within the wait."""


@dataclass
class Tenancy:
    """What a supervised process asks of a server's pools, and how it may be evicted.

    Planning uses `usage` (SPEC §17 M2): the declared footprint, else the estimate from the
    model file, raised per pool to what was measured of the process × 1.05. A footprint may
    name the pool `gpu` (any of the server's `gpus`, M3): `placed` says which one the
    current process was given."""

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

    @property
    def wanted(self) -> dict[str, int]:
        """Declared, else estimated; may still name the placeholder pool `gpu`."""
        if self.declared is not None:
            return self.declared
        return self.estimated or {}

    @property
    def usage(self) -> dict[str, int]:
        """What planning counts now, per concrete pool."""
        usage = dict(self.wanted)
        if ANY_GPU in usage and self.placed is not None:
            usage[self.placed] = usage.pop(ANY_GPU)
        for pool, held in (self.measured or {}).items():
            usage[pool] = max(usage.get(pool, 0), math.ceil(held * MEASURED_MARGIN))
        return usage

    def resident(self, now: float) -> Resident:
        sup = self.supervisor
        return Resident(
            id=sup.id,
            usage=self.usage,
            idle=sup.state is State.READY and sup.in_flight == 0,
            pinned=self.pinned,
            last_used=sup.last_used,
            ttl_expires_at=self.ttl_expires_at(),
            evict_cost=self.evict_cost,
        )

    def ttl_expires_at(self) -> float | None:
        return None if self.ttl is None else self.supervisor.last_used + self.ttl


@dataclass
class Residency:
    """Long-lived: built once with the gateway, it subscribes once to the transition bus;
    a config reload hands it the new servers and tenancies (`reconfigure`) and keeps its
    memory reader, its locks and everything it measured of processes that stay."""

    servers: dict[str, Server]
    max_wait: float = 60.0
    reader: MemoryReader | None = None
    clock: Callable[[], float] = time.monotonic
    tenancies: dict[str, Tenancy] = field(default_factory=dict)
    bus: Transitions[Supervisor] | None = None

    def __post_init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._changed = asyncio.Event()
        if self.bus is not None:
            self.bus.subscribe(moved=self._on_transition, idle=lambda _: self._notify())

    def reconfigure(
        self, servers: dict[str, Server], max_wait: float, tenancies: list[Tenancy]
    ) -> None:
        """A config reload: the new pools and tenancies replace the old as a whole; what
        was measured of a process that keeps running is kept."""
        previous = self.tenancies
        self.servers, self.max_wait = servers, max_wait
        self.tenancies = {}
        for tenancy in tenancies:
            old = previous.get(tenancy.supervisor.id)
            if old is not None and old.supervisor is tenancy.supervisor:
                tenancy.measured = old.measured
            self.track(tenancy)
        self._notify()

    def track(self, tenancy: Tenancy) -> None:
        self.tenancies[tenancy.supervisor.id] = tenancy

    def residents(self, server: str, exclude: str | None = None) -> list[Tenancy]:
        return [
            t
            for t in self.tenancies.values()
            if t.server == server and t.supervisor.id != exclude and t.supervisor.state in HOLDING
        ]

    def used(self, server: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for tenancy in self.residents(server):
            for pool, n in tenancy.usage.items():
                total[pool] = total.get(pool, 0) + n
        return total

    def could_fit(self, sup: Supervisor) -> bool:
        """Whether a start of `sup` could be placed now, evicting idle residents if needed."""
        tenancy = self.tenancies.get(sup.id)
        if tenancy is None or tenancy.server is None or sup.state in HOLDING:
            return True
        return self._plan(tenancy).fits

    async def make_room(self, sup: Supervisor) -> Placement:
        """The supervisor's `room` seam: return once `sup` fits, evicting as planned (R2)."""
        tenancy = self.tenancies.get(sup.id)
        if tenancy is None or tenancy.server is None:
            return Placement()
        deadline = self.clock() + self.max_wait
        lock = self._locks.setdefault(tenancy.server, asyncio.Lock())
        async with lock:
            while True:
                decision = self._plan(tenancy)
                if decision.fits and not decision.evict:
                    return Placement()
                if decision.fits:
                    await self._evict(tenancy, decision.evict)
                    continue
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise NoRoom(self._no_room_message(tenancy, decision.short or {}))
                await self._wait_change(remaining)

    async def reap_expired(self) -> None:
        """R4: unload idle, unpinned residents whose `sticky.ttl` has run out."""
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
                log.info(
                    "unload backend=%s reason=ttl-expired idle=%.0fs", sup.id, now - sup.last_used
                )
                await sup.unload()

    # -- the machinery ---------------------------------------------------------------

    def _plan(self, tenancy: Tenancy) -> Plan:
        assert tenancy.server is not None, "only tenancies that take room are planned"
        server = self.servers[tenancy.server]
        now = self.clock()
        residents = [t.resident(now) for t in self.residents(tenancy.server, tenancy.supervisor.id)]
        return plan(server.pools, server.reserve, residents, tenancy.usage, now)

    async def _evict(self, tenancy: Tenancy, victims: tuple[str, ...]) -> None:
        now = self.clock()
        for victim in victims:
            r = self.tenancies[victim].resident(now)
            reason = "ttl-expired" if r.expired(now) else f"evictCost={r.evict_cost}"
            log.info(
                "evict backend=%s for=%s server=%s reason=%s idle=%.0fs frees=%s",
                victim,
                tenancy.supervisor.id,
                tenancy.server,
                reason,
                now - r.last_used,
                _sizes(r.usage),
            )
        await asyncio.gather(*(self.tenancies[v].supervisor.unload() for v in victims))

    def _no_room_message(self, tenancy: Tenancy, short: Mapping[str, int]) -> str:
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
        return (
            f"No room on server '{tenancy.server}' for backend '{tenancy.supervisor.id}' "
            f"(needs {_sizes(tenancy.usage)}; short by {_sizes(short)}) after waiting "
            f"{self.max_wait:g}s (scheduler.maxWait). Memory is held by: "
            f"{', '.join(holders) or 'nothing (the reserve leaves too little)'}. "
            "Retry later, unload one of them, or lower its ramUsage."
        )

    def _on_transition(self, sup: Supervisor, old: State, new: State) -> None:
        tracked = self.tenancies.get(sup.id)
        if tracked is not None and tracked.supervisor is sup and new is State.READY and self.reader:
            asyncio.get_running_loop().create_task(self._measure(sup))
        if new not in HOLDING:
            self._notify()

    async def _measure(self, sup: Supervisor) -> None:
        """R5: what the process really holds, beside what it declared."""
        tenancy = self.tenancies[sup.id]
        assert self.reader is not None
        if sup.pid is None:
            return
        measured = await asyncio.to_thread(self.reader.read, sup.pid)
        tenancy.measured = measured
        for pool, real in (measured or {}).items():
            declared = (tenancy.declared or {}).get(pool, 0)
            if declared == 0 or abs(real - declared) > 0.10 * declared:
                log.warning(
                    "ramUsage mismatch backend=%s pool=%s declared=%s measured=%s: "
                    "update ramUsage so eviction plans with real numbers",
                    sup.id,
                    pool,
                    format_size(declared),
                    format_size(real),
                )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, within: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), within)


def _sizes(vector: Mapping[str, int]) -> str:
    return ", ".join(f"{pool} {format_size(n)}" for pool, n in sorted(vector.items())) or "-"
