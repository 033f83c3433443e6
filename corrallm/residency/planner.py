"""The eviction planner (SPEC §5 R1-R4): a pure function, state in, evictions out.

Given one server's capacity vector, its reserve, the residents holding memory and what a
new backend needs, say whether it fits, and if not, which idle unpinned residents to
evict: ttl-expired first, then by `evictCost` (low, medium, high), then least recently
used, and no more of them than needed. It never logs and knows no processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Vector = Mapping[str, int]

EVICT_COST_RANK = {"low": 0, "medium": 1, "high": 2}


@dataclass(frozen=True)
class Resident:
    id: str
    usage: Vector
    idle: bool  # ready with no request in flight: the only kind that may be evicted
    pinned: bool = False  # persistent: never evicted
    last_used: float = 0.0
    ttl_expires_at: float | None = None
    evict_cost: str = "medium"

    def expired(self, now: float) -> bool:
        return self.ttl_expires_at is not None and self.ttl_expires_at <= now


@dataclass(frozen=True)
class Plan:
    fits: bool  # True: it fits once `evict` are gone; False: no eviction can make room
    evict: tuple[str, ...] = ()
    short: Mapping[str, int] | None = None  # per pool, what is missing even after evicting


def free_space(capacity: Vector, reserve: Vector, residents: Sequence[Resident]) -> dict[str, int]:
    """What each pool can still hand out: capacity minus reserve minus what residents hold."""
    free = {pool: size - reserve.get(pool, 0) for pool, size in capacity.items()}
    for resident in residents:
        for pool, used in resident.usage.items():
            free[pool] = free.get(pool, 0) - used
    return free


def eviction_order(residents: Sequence[Resident], now: float) -> list[Resident]:
    """Who goes first: idle, unpinned; ttl-expired, then cheap to evict, then LRU."""
    candidates = [r for r in residents if r.idle and not r.pinned]
    return sorted(
        candidates,
        key=lambda r: (
            not r.expired(now),
            EVICT_COST_RANK.get(r.evict_cost, 1),
            r.last_used,
            r.id,
        ),
    )


def plan(
    capacity: Vector,
    reserve: Vector,
    residents: Sequence[Resident],
    need: Vector,
    now: float,
) -> Plan:
    free = free_space(capacity, reserve, residents)
    deficit = _deficit(free, need)
    if not deficit:
        return Plan(True)
    chosen: list[Resident] = []
    for resident in eviction_order(residents, now):
        if not any(resident.usage.get(pool, 0) > 0 for pool in deficit):
            continue  # evicting it frees nothing we lack
        chosen.append(resident)
        _add(free, resident.usage)
        deficit = _deficit(free, need)
        if not deficit:
            break
    if deficit:
        return Plan(False, short=deficit)
    # Only as many as needed: drop, latest first, any victim the others make unnecessary.
    for resident in reversed(list(chosen)):
        _add(free, resident.usage, sign=-1)
        if _deficit(free, need):
            _add(free, resident.usage)
        else:
            chosen.remove(resident)
    return Plan(True, tuple(r.id for r in chosen))


def _deficit(free: Mapping[str, int], need: Vector) -> dict[str, int]:
    return {pool: n - free.get(pool, 0) for pool, n in need.items() if n > free.get(pool, 0)}


def _add(free: dict[str, int], usage: Vector, sign: int = 1) -> None:
    for pool, used in usage.items():
        free[pool] = free.get(pool, 0) + sign * used
