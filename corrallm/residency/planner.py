"""The eviction planner (SPEC §5 R1-R4, §18 W1): a pure function, state in, actions out.

Given one server's capacity vector, its reserve, the residents holding memory and what a
new backend needs, say whether it fits, and if not, which idle unpinned residents to put
to sleep or stop: ttl-expired first, then by `evictCost` (low, medium, high), then least
recently used, and no more of them than needed. A resident that can sleep (W1) is put to
sleep when that frees what is lacking and waking it is cheaper than loading it; a sleeper
(asleep already, holding its `sleepUsage`) may be stopped to free that too. Two plans are
made — residents first (sleepers stopped only if still short) and sleepers first — and the
sleepers-first plan is taken only when it is strictly cheaper, cost being the seconds it
takes to bring back what the plan displaces (a wake, a load, or a load instead of a wake).
It never logs and knows no processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Vector = Mapping[str, int]
Action = Literal["sleep", "stop"]

EVICT_COST_RANK = {"low": 0, "medium": 1, "high": 2}


@dataclass(frozen=True)
class Resident:
    id: str
    usage: Vector  # what it holds now (a sleeper: its sleepUsage)
    idle: bool  # ready with no request in flight, or asleep: the only kinds that may go
    pinned: bool = False  # persistent: never evicted
    last_used: float = 0.0
    ttl_expires_at: float | None = None
    evict_cost: str = "medium"
    asleep: bool = False
    sleep_usage: Vector | None = None  # awake and able to sleep: what it would hold asleep
    load_seconds: float = 0.0  # bringing it back after a stop
    wake_seconds: float = 0.0  # bringing it back after a sleep

    def expired(self, now: float) -> bool:
        return self.ttl_expires_at is not None and self.ttl_expires_at <= now

    def may_sleep(self) -> bool:
        """Awake, able to sleep, and waking is cheaper than loading (W1)."""
        return (
            not self.asleep
            and self.sleep_usage is not None
            and self.wake_seconds < self.load_seconds
        )

    def frees(self, action: Action) -> dict[str, int]:
        """What each pool gains when it sleeps or stops (negative: it holds more asleep)."""
        if action == "stop":
            return dict(self.usage)
        assert self.sleep_usage is not None
        pools = set(self.usage) | set(self.sleep_usage)
        return {p: self.usage.get(p, 0) - self.sleep_usage.get(p, 0) for p in pools}

    def cost(self, action: Action) -> float:
        """Seconds it will take to bring it back."""
        if action == "sleep":
            return self.wake_seconds
        return max(0.0, self.load_seconds - self.wake_seconds) if self.asleep else self.load_seconds


@dataclass(frozen=True)
class Plan:
    fits: bool  # True: it fits once the actions are done; False: nothing can make room
    evict: tuple[str, ...] = ()  # stopped
    short: Mapping[str, int] | None = None  # per pool, what is missing even after all
    sleep: tuple[str, ...] = ()  # put to sleep instead of stopped (W1)
    cost: float = 0.0  # seconds to bring back what it displaces

    @property
    def actions(self) -> int:
        return len(self.evict) + len(self.sleep)


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
    if not _deficit(free, need, set()):
        return Plan(True)
    order = eviction_order(residents, now)
    awake = [r for r in order if not r.asleep]
    sleepers = [r for r in order if r.asleep]
    by_cost = sorted(sleepers, key=lambda r: r.cost("stop"))  # stable: R2 order on ties
    residents_first = _build(free, need, [(awake, False), (sleepers, True)])
    sleepers_first = _build(free, need, [(by_cost, True), (awake, False), (awake, True)])
    if sleepers_first.fits and (
        not residents_first.fits or sleepers_first.cost < residents_first.cost
    ):
        return sleepers_first
    return residents_first


def settle_idle(free: Vector, resident: Resident) -> Action:
    """An idle resident whose ttl ran out (R4, W1): sleep if it may and its sleepUsage fits
    the pools as they are now (`free` counts it awake), else stop."""
    if resident.may_sleep():
        after = dict(free)
        _add(after, resident.frees("sleep"))
        if not _deficit(after, {}, _grown([(resident, "sleep")])):
            return "sleep"
    return "stop"


# (resident, action) in the order taken
Steps = list[tuple[Resident, Action]]


def _build(free: Vector, need: Vector, passes: list[tuple[list[Resident], bool]]) -> Plan:
    """Walk the passes in order, each a list of candidates and whether it stops them (else
    a candidate sleeps where it may), taking each that frees something still lacking; then
    undo, latest first, every step the others make unnecessary."""
    have = dict(free)
    steps: Steps = []
    for candidates, stopping in passes:
        for resident in candidates:
            if not _deficit(have, need, _grown(steps)):
                break
            action = _action(resident, steps, stopping, _deficit(have, need, _grown(steps)))
            if action is None:
                continue
            steps = [(r, a) for r, a in steps if r.id != resident.id] + [(resident, action)]
            have = _after(free, steps)
    short = _deficit(have, need, _grown(steps))
    if short:
        return Plan(False, short=short)
    for step in reversed(list(steps)):
        resident, action = step
        lighter = [s for s in steps if s is not step]
        if action == "stop" and resident.may_sleep():
            gentler = [*lighter, (resident, "sleep")]
            if not _deficit(_after(free, gentler), need, _grown(gentler)):
                steps = gentler
                continue
        if not _deficit(_after(free, lighter), need, _grown(lighter)):
            steps = lighter
    return Plan(
        True,
        evict=tuple(r.id for r, a in steps if a == "stop"),
        sleep=tuple(r.id for r, a in steps if a == "sleep"),
        cost=sum(r.cost(a) for r, a in steps),
    )


def _action(
    resident: Resident, steps: Steps, stopping: bool, deficit: Mapping[str, int]
) -> Action | None:
    """What to do with `resident` in this pass, if it frees anything lacking."""
    taken = next((a for r, a in steps if r.id == resident.id), None)
    if taken == "stop":
        return None
    wants: list[Action] = ["stop"] if stopping or not resident.may_sleep() else ["sleep", "stop"]
    for action in wants:
        if taken == action:
            continue
        gain = resident.frees(action)
        if taken == "sleep":  # upgrading a sleep to a stop frees what it held asleep
            gain = dict(resident.sleep_usage or {})
        if any(gain.get(pool, 0) > 0 for pool in deficit):
            return action
    return None


def _after(free: Vector, steps: Steps) -> dict[str, int]:
    have = dict(free)
    for resident, action in steps:
        _add(have, resident.frees(action))
    return have


def _grown(steps: Steps) -> set[str]:
    """Pools a sleeper will hold more of than it does awake: they must not go below zero."""
    grown: set[str] = set()
    for resident, action in steps:
        if action == "sleep":
            grown |= {pool for pool, n in resident.frees("sleep").items() if n < 0}
    return grown


def _deficit(free: Mapping[str, int], need: Vector, grown: set[str]) -> dict[str, int]:
    wanted = dict(need)
    for pool in grown:
        wanted.setdefault(pool, 0)
    return {pool: n - free.get(pool, 0) for pool, n in wanted.items() if n > free.get(pool, 0)}


def _add(free: dict[str, int], usage: Vector, sign: int = 1) -> None:
    for pool, used in usage.items():
        free[pool] = free.get(pool, 0) + sign * used
