"""What the scheduling core decides over: each backend's slots, queues, running requests
and leases, and each group's decayed usage. Plain data with the few questions the core
asks of it; every decision stays in `core.py`."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from corrallm.scheduler.decisions import GroupSpec, Request

HALF_LIFE_SECONDS = 120.0  # usage decay: what a group used two minutes ago counts half


@dataclass(slots=True)
class Running:
    request: Request
    backend: str
    admitted: float
    preempted_by: int | None = None


@dataclass
class Group:
    spec: GroupSpec
    usage: float = 0.0
    usage_at: float = 0.0
    in_flight: int = 0
    waiting: int = 0
    admitted_sum: float = 0.0  # sum of admission times of its running requests

    def decayed(self, now: float) -> float:
        if now > self.usage_at:
            self.usage *= 0.5 ** ((now - self.usage_at) / HALF_LIFE_SECONDS)
            self.usage_at = now
        return self.usage


@dataclass
class Backend:
    id: str
    capacity: int
    running: dict[int, Running] = field(default_factory=dict)
    queues: dict[str, deque[Request]] = field(default_factory=dict)
    queued: dict[int, Request] = field(default_factory=dict)  # every request in `queues`
    counts: Counter[str] = field(default_factory=Counter)  # group -> requests in `running`
    handoffs: dict[int, Request] = field(default_factory=dict)  # victim id -> its taker
    leases: dict[str, tuple[int, float]] = field(default_factory=dict)  # group -> slots, until
    dwell: float | None = None
    service: float | None = None

    @property
    def waiting(self) -> int:
        return len(self.queued) + len(self.handoffs)

    def in_flight_of(self, group: str) -> int:
        return self.counts[group]

    def held_for_others(self, group: str) -> int:
        """Reserved slots of other lanes that those lanes are not using (V2)."""
        if not self.leases:
            return 0
        return sum(
            max(0, slots - self.in_flight_of(owner))
            for owner, (slots, _) in self.leases.items()
            if owner != group
        )

    def beyond_lease(self, group: str) -> int:
        """Running requests of `group` outside its own lease, not already being preempted."""
        slots = self.leases[group][0] if group in self.leases else 0
        mine = [r for r in self.running.values() if r.request.group == group]
        return len(mine) - slots - sum(1 for r in mine if r.preempted_by is not None)

    def room_for(self, group: str) -> bool:
        busy = len(self.running) + len(self.handoffs)
        if not self.leases:  # perf (SPEC §13): nothing reserved, the common case
            return busy < self.capacity
        return busy + self.held_for_others(group) < self.capacity
