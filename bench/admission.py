"""How long does one admission decision take with 10,000 requests queued? (SPEC §13: ≤ 50 µs)

    .venv/bin/python bench/admission.py [--queued 10000] [--groups 50] [--iterations 20000]

Builds the pure scheduling core (`corrallm.scheduler.core.Scheduler`) with 50 groups of
varied weights and share currencies, fills its backends, queues 10,000 more requests,
then times, one call at a time, with the queue held at its size:

- `submit` of a request that has to queue (every slot is taken), also with a preferred
  backend picked at random (affinity, SPEC §16 K6),
- `release` of a running request, which admits the next one by weighted fairshare,
- `withdraw` of a queued request picked at random (a client leaving).

Each layout is measured in the same run; the table gives median, p99 and mean in µs and
the ratio to the 50 µs target (below 1 meets it). No I/O, no asyncio: this is the
decision alone, what the async wrapper adds is measured end to end by bench/overhead.py.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from corrallm.scheduler.core import (
    Admit,
    Currency,
    GroupSpec,
    Policy,
    Queued,
    Request,
    Scheduler,
)

TARGET_US = 50.0
CURRENCIES: list[Currency] = ["requests", "slotSeconds", "tokens", "dollars"]
QUEUE = Policy(queue=True)


@dataclass(frozen=True)
class Layout:
    name: str
    backends: dict[str, int]  # id -> maxConcurrent, all in one tier
    leases: int = 0  # groups holding one reserved slot on the first backend


LAYOUTS = [
    Layout("1 backend x 32 slots", {"b0": 32}),
    Layout("4 backends x 8 slots, one tier", {f"b{i}": 8 for i in range(4)}),
    Layout("1 backend x 32 slots, 4 leases", {"b0": 32}, leases=4),
]


class Bench:
    """A core held at `queued` waiting requests; each timed call is followed by an untimed
    one that restores the queue, so every sample sees the same depth."""

    def __init__(self, layout: Layout, groups: int, queued: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.names = [f"g{i:02d}" for i in range(groups)]
        specs = [
            GroupSpec(n, weight=float(self.rng.choice([1, 2, 3, 5, 10])), currency=c)
            for n, c in zip(self.names, itertools.cycle(CURRENCIES), strict=False)
        ]
        self.core = Scheduler(specs, max_queue_depth=queued * 2)
        for backend, slots in layout.backends.items():
            self.core.add_backend(backend, slots)
        self.tiers = [list(layout.backends)]
        self.active = self.names[layout.leases :]  # lease holders would take their own slots
        first = self.tiers[0][0]
        for name in self.names[: layout.leases]:
            self.core.lease(name, first, 1, until=1e12, now=0.0)
        self.ids = itertools.count(1)
        self.now = 0.0
        self.running: list[int] = []
        self.queued: list[int] = []  # ids, for withdrawals at random positions
        self.position: dict[int, int] = {}
        while len(self.queued) < queued:
            self.add()
        assert len(self.running) == sum(layout.backends.values()) - layout.leases

    def tick(self) -> float:
        self.now += 0.001
        return self.now

    def request(self) -> Request:
        return Request(next(self.ids), self.rng.choice(self.active), self.now)

    def add(self) -> None:
        request = self.request()
        decision = self.core.submit(request, self.tiers, QUEUE, self.tick())
        if isinstance(decision, Admit):
            self.running.append(request.id)
        else:
            assert isinstance(decision, Queued), decision
            self.enqueue(request.id)

    def enqueue(self, rid: int) -> None:
        self.position[rid] = len(self.queued)
        self.queued.append(rid)

    def dequeue(self, rid: int) -> None:
        at, last = self.position.pop(rid), self.queued.pop()
        if last != rid:
            self.queued[at], self.position[last] = last, at

    def submit(self, prefer: str | None = None) -> int:
        request = self.request()
        now = self.tick()
        t0 = time.perf_counter_ns()
        decision = self.core.submit(request, self.tiers, QUEUE, now, prefer)
        elapsed = time.perf_counter_ns() - t0
        assert isinstance(decision, Queued), decision
        self.core.withdraw(request.id, self.tick())
        return elapsed

    def submit_preferring(self) -> int:
        return self.submit(self.rng.choice(self.tiers[0]))

    def release(self) -> int:
        rid = self.running.pop(self.rng.randrange(len(self.running)))
        now, usage = self.tick(), self.rng.uniform(1, 500)
        t0 = time.perf_counter_ns()
        admits = self.core.release(rid, now, usage)
        elapsed = time.perf_counter_ns() - t0
        assert len(admits) == 1, admits
        self.dequeue(admits[0].request)
        self.running.append(admits[0].request)
        self.add()
        return elapsed

    def withdraw(self) -> int:
        rid = self.queued[self.rng.randrange(len(self.queued))]
        now = self.tick()
        t0 = time.perf_counter_ns()
        admits = self.core.withdraw(rid, now)
        elapsed = time.perf_counter_ns() - t0
        assert admits == [], admits
        self.dequeue(rid)
        self.add()
        return elapsed


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def measure(op: Callable[[], int], iterations: int) -> list[float]:
    for _ in range(min(1000, iterations // 10)):  # warm-up
        op()
    return [op() / 1000 for _ in range(iterations)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--queued", type=int, default=10_000, help="requests waiting (10000)")
    p.add_argument("--groups", type=int, default=50, help="priority groups (50)")
    p.add_argument("--iterations", type=int, default=20_000, help="timed calls per row")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    print(
        f"### Admission decision, {args.queued:,} queued across {args.groups} groups "
        f"({args.iterations:,} calls per row)\n"
    )
    print("| layout | operation | median µs | p99 µs | mean µs | median / 50 µs | p99 / 50 µs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for layout in LAYOUTS:
        bench = Bench(layout, args.groups, args.queued, args.seed)
        gc.collect()
        gc.freeze()  # the setup's objects are not rescanned by every collection
        for name, op in (
            ("submit (queues)", bench.submit),
            ("submit, preferring one (K6)", bench.submit_preferring),
            ("release (admits next)", bench.release),
            ("withdraw (queued)", bench.withdraw),
        ):
            us = measure(op, args.iterations)
            med, p99, mean = pct(us, 50), pct(us, 99), sum(us) / len(us)
            print(
                f"| {layout.name} | {name} | {med:.1f} | {p99:.1f} | {mean:.1f} "
                f"| {med / TARGET_US:.2f} | {p99 / TARGET_US:.2f} |"
            )
            assert len(bench.queued) == args.queued
        gc.unfreeze()
    print(
        f"\n- Python {platform.python_version()} on {platform.machine()}, "
        "garbage collector on; target: 50 µs per decision (SPEC §13)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
