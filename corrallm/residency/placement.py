"""GPU placement (SPEC §17 M3): a pure function, state in, the chosen GPU and its evictions out.

A server may name interchangeable GPU pools (`gpus: [gpu0, gpu1]`); a footprint that asks
for the pool `gpu` may run on any one of them. `place()` plans the start on each GPU with
the eviction planner (planner.py) and picks, among the GPUs where it fits:

1. one that needs no eviction;
2. else the fewest evictions (a sleep counts as one, W1);
3. then the cheapest: victims compared worst first by the planner's order (ttl-expired
   before the rest, then `evictCost` low < medium < high);
4. then the most memory left free on that GPU after the start;
5. ties by the order of `gpus`.

The need then names that one GPU instead of `gpu` (`concrete_need`), so the memory is
counted on exactly one pool. Like the planner it never logs, reads no clock (`now` is
passed in) and knows no processes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from corrallm.config.schema import ANY_GPU
from corrallm.config.units import format_size
from corrallm.residency.planner import (
    EVICT_COST_RANK,
    Plan,
    Resident,
    Vector,
    free_space,
    plan,
)

_TRAILING_NUMBER = re.compile(r"(\d+)$")

# How one GPU compares with another (smaller is better): evictions, the victims' costs
# worst first, memory left free (negated), position in `gpus`.
Rank = tuple[int, list[tuple[bool, int]], int, int]


@dataclass(frozen=True)
class Choice:
    """Where a start goes: `gpu` (None when the need names no `gpu`, or nothing fits), the
    plan on it (its evictions), the need as counted there, why that GPU (for the log line),
    and, when it fits nowhere, what each GPU tried is short of."""

    gpu: str | None
    plan: Plan
    need: Mapping[str, int] = field(default_factory=dict)  # concrete: never names `gpu`
    why: str = ""
    short: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # GPU -> deficit

    @property
    def fits(self) -> bool:
        return self.plan.fits

    @property
    def evict(self) -> tuple[str, ...]:
        return self.plan.evict

    @property
    def sleep(self) -> tuple[str, ...]:
        return self.plan.sleep


def concrete_need(need: Vector, gpu: str) -> dict[str, int]:
    """`need` with its `gpu` part counted on the pool `gpu`."""
    out = {pool: n for pool, n in need.items() if pool != ANY_GPU}
    if ANY_GPU in need:
        out[gpu] = out.get(gpu, 0) + need[ANY_GPU]
    return out


def gpu_index(pool: str, gpus: Sequence[str]) -> str:
    """What `${GPU}` and CUDA_VISIBLE_DEVICES say for `pool`: the number that ends its name
    (`gpu1` -> "1"), else its position in `gpus`."""
    match = _TRAILING_NUMBER.search(pool)
    if match:
        return match.group(1)
    return str(list(gpus).index(pool))


def place(
    capacity: Vector,
    reserve: Vector,
    residents: Sequence[Resident],
    need: Vector,
    gpus: Sequence[str],
    now: float,
) -> Choice:
    """Plan a start whose `need` may name `gpu` on one of `gpus` (see the module doc)."""
    if ANY_GPU not in need:
        return Choice(None, plan(capacity, reserve, residents, need, now), dict(need))
    by_id = {r.id: r for r in residents}
    ranked: list[tuple[Rank, Choice]] = []
    short: dict[str, Mapping[str, int]] = {}
    for position, gpu in enumerate(gpus):
        concrete = concrete_need(need, gpu)
        decision = plan(capacity, reserve, residents, concrete, now)
        if not decision.fits:
            short[gpu] = dict(decision.short or {})
            continue
        left = [r for r in residents if r.id not in decision.evict + decision.sleep]
        asleep = [by_id[v] for v in decision.sleep]
        held = free_space(capacity, reserve, left).get(gpu, 0) - sum(
            (r.sleep_usage or {}).get(gpu, 0) for r in asleep
        )
        free_after = held - concrete.get(gpu, 0)
        victims = decision.evict + decision.sleep
        costs = sorted((_cost(by_id[v], now) for v in victims), reverse=True)
        rank: Rank = (decision.actions, costs, -free_after, position)
        ranked.append((rank, Choice(gpu, decision, concrete)))
    if not ranked:
        first = short[gpus[0]] if gpus else {ANY_GPU: need[ANY_GPU]}
        return Choice(None, Plan(False, short=first), short=short)
    ranked.sort(key=lambda pair: pair[0])
    (rank, best), runner_up = ranked[0], ranked[1] if len(ranked) > 1 else None
    return replace(best, why=_why(rank, runner_up, len(gpus)))


def _why(best: Rank, runner_up: tuple[Rank, Choice] | None, tried: int) -> str:
    """The first criterion that set the chosen GPU apart from the next best."""
    if runner_up is None:
        return "its only GPU" if tried == 1 else "the only GPU it fits on"
    other, on = runner_up[0], runner_up[1].gpu
    if best[0] != other[0]:
        if best[0] == 0:
            return f"fits without eviction ({on} would need {other[0]})"
        return f"fewest evictions ({best[0]}; {on} would need {other[0]})"
    if best[1] != other[1]:
        return f"cheapest evictions (than {on}'s)"
    if best[2] != other[2]:
        left, left_other = format_size(-best[2]), format_size(-other[2])
        return f"most free after the start ({left} left; {on}: {left_other})"
    return f"first in gpus (tied with {on})"


def _cost(victim: Resident, now: float) -> tuple[bool, int]:
    """How dear a victim is, as the planner orders them: ttl-expired first, then evictCost."""
    return (not victim.expired(now), EVICT_COST_RANK.get(victim.evict_cost, 1))
