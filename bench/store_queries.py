"""How long do the dashboard's usage and activity queries take on a big store? (target: well
under a second each)

    .venv/bin/python bench/store_queries.py [--rows 5000000] [--repeat 5] [--plans]

Builds a store in a temporary folder (removed afterwards) through `Store.open()`, so the
schema is exactly the gateway's (all migrations and indexes), then fills it
as if corrallm had run for `--days` (30): `--rows` activity rows in time order, 50 keys
in 8 groups (a key belongs to one group; 2% of requests carry no key), 20 models, 1% of
rows `load` rows; and a queue-depth sample for each of `--queue-backends` (20) backends
every 5 s. Rows go in with `executemany`, 500,000 per transaction, with the indexes
dropped; then the indexes are built and the rollups backfilled with migration 3's own
statements (what it does to an existing store).

Then each query of `corrallm/store/queries.py` runs `--repeat` times through the store's
thread, as the API calls it, over the last 24 h, 7 d and 30 d (series with the API's
default bucket for the range); the table gives median and max in ms (the first, cold run
included in max). Last, the writer's cost: a 1,000-row flush with its rollups summed per
batch (the writer now), under migration 3's per-row trigger (before migration 5), and the
rows alone, on the store's thread.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from corrallm.store import activity, queries
from corrallm.store.activity import INSERT
from corrallm.store.db import MIGRATIONS, Store

TARGET_MS = 1000.0
DAY = 86400
CHUNK = 500_000
KEYS = [f"key-{i:02d}" for i in range(50)]
GROUPS = [f"group-{i}" for i in range(8)]
MODELS = [f"model-{i:02d}" for i in range(20)]


def activity_rows(n: int, start: float, span: float, seed: int) -> Iterator[tuple[Any, ...]]:
    rng = random.Random(seed)
    r = rng.random
    step = span / n
    for i in range(n):
        k, m, load = int(r() * 50), int(r() * 20), r() < 0.01
        key = None if r() < 0.02 else KEYS[k]
        prompt, completion = (0, 0) if load else (int(r() * 2000), int(r() * 500))
        yield (
            start + (i + r()) * step,
            "load" if load else "request",
            key,
            GROUPS[k % 8],
            MODELS[m],
            f"{MODELS[m]}#0",
            "load" if load else "/v1/chat/completions",
            200 if r() < 0.98 else 502,
            r() * 50,
            r() * 2000,
            r() * 200,
            prompt,
            completion,
            0,
            r() * 0.5,
            r() * 0.01,
            0,
            int(r() < 0.02),
            int(r() < 0.02),
            int(r() < 0.01),
            None,
            None if load else f"bench{i:012x}",  # request_id (migration 7)
        )


def queue_rows(backends: int, start: float, end: float, seed: int) -> Iterator[tuple[Any, ...]]:
    rng = random.Random(seed)
    t = start
    while t < end:
        for b in range(backends):
            yield (t, f"{MODELS[b % 20]}#{b // 20}", rng.randrange(8), rng.randrange(5))
        t += 5.0


def in_chunks(db: sqlite3.Connection, sql: str, rows: Iterator[tuple[Any, ...]]) -> int:
    total = 0
    while True:
        chunk = [row for _, row in zip(range(CHUNK), rows, strict=False)]
        if not chunk:
            return total
        db.execute("BEGIN")
        db.executemany(sql, chunk)
        db.execute("COMMIT")
        total += len(chunk)


def generate(path: Path, args: argparse.Namespace, now: float) -> dict[str, float]:
    asyncio.run(_create(path))  # the gateway's schema, every migration applied
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA cache_size = -1000000")
    derived = db.execute(
        "SELECT name, type, sql FROM sqlite_master "
        "WHERE type IN ('index', 'trigger') AND sql IS NOT NULL"
    ).fetchall()
    for name, kind, _ in derived:
        db.execute(f"DROP {kind.upper()} {name}")
    start = now - args.days * DAY
    timings = {}
    t0 = time.perf_counter()
    n = in_chunks(db, INSERT, activity_rows(args.rows, start, args.days * DAY, args.seed))
    timings["activity rows"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    samples = in_chunks(
        db,
        "INSERT INTO queue_depth (t, backend, waiting, in_flight) VALUES (?, ?, ?, ?)",
        queue_rows(args.queue_backends, start, now, args.seed),
    )
    timings["queue samples"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _, kind, sql in derived:
        if kind == "index":
            db.execute(sql)
    timings["indexes"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    db.execute("BEGIN")
    for statement in (s for m in MIGRATIONS for s in m if s.lstrip().startswith("INSERT")):
        db.execute(statement)  # migration 3's backfill of the hourly rollups
    db.execute("COMMIT")
    for _, kind, sql in derived:
        if kind == "trigger":
            db.execute(sql)
    timings["rollups"] = time.perf_counter() - t0
    timings["rows"], timings["samples"] = n, samples
    timings["rollup rows"] = sum(
        db.execute(f"SELECT COUNT(*) FROM usage_{t}_hour").fetchone()[0] for t in ("key", "model")
    )
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return timings


async def _create(path: Path) -> None:
    store = Store(path)
    await store.open()
    await store.close()


def cases(now: float) -> list[tuple[str, Callable[[Store], Awaitable[object]]]]:
    out: list[tuple[str, Callable[[Store], Awaitable[object]]]] = []
    for label, days in (("24h", 1), ("7d", 7), ("30d", 30)):
        since, until = now - days * DAY, now
        bucket = queries.default_bucket(until - since)
        out += [
            (f"by-key {label}", lambda s, a=since, b=until: queries.usage_by_key(s, a, b)),
            (f"rollup {label}", lambda s, a=since, b=until: queries.usage_rollup(s, a, b)),
            (
                f"series {label} ({bucket}s buckets)",
                lambda s, a=since, b=until, c=bucket: queries.usage_series(s, a, b, c),
            ),
            (
                f"series-by-group {label} ({bucket}s buckets)",
                lambda s, a=since, b=until, c=bucket: queries.usage_series(s, a, b, c, True),
            ),
        ]
    day = now - DAY
    out += [
        ("activity latest 100", lambda s: queries.activity(s, day, now, 100)),
        ("activity latest 100, key=key-07", lambda s: queries.activity(s, day, now, 100, "key-07")),
        ("activity latest 100, 30d, model filter", lambda s: _model_filter(s, now)),
        ("queue-depth 1h (60s buckets)", lambda s: queries.queue_depth(s, now - 3600, now, 60)),
        ("queue-depth 24h (300s buckets)", lambda s: queries.queue_depth(s, day, now, 300)),
    ]
    return out


def _model_filter(store: Store, now: float) -> Awaitable[object]:
    return queries.activity(store, now - 30 * DAY, now, 100, model="model-03")


async def measure(path: Path, now: float, repeat: int, plans: bool) -> list[str]:
    store = PlanStore(path)
    await store.open()
    lines: list[str] = []
    explained: list[str] = []
    try:
        for name, run in cases(now):
            times, size = [], 0
            store.ran.clear()
            for _ in range(repeat):
                t0 = time.perf_counter()
                result = await run(store)
                times.append((time.perf_counter() - t0) * 1000)
                size = len(result)  # type: ignore[arg-type]
            med, worst = statistics.median(times), max(times)
            verdict = (
                "yes" if worst < TARGET_MS / 2 else ("under 1 s" if worst < TARGET_MS else "NO")
            )
            lines.append(f"| {name} | {size} | {med:.1f} | {worst:.1f} | {verdict} |")
            store.ran[1:] = []
            if plans:
                explained.append(f"- {name}: " + "; ".join(await store.plans()))
        lines += [
            "",
            await writer_cost(store, now),
            *(["", "Query plans:", *explained] if plans else []),
        ]
    finally:
        await store.close()
    return lines


class PlanStore(Store):
    """The store, remembering the statements the queries ran (for `--plans`)."""

    ran: list[tuple[str, Any]] = []

    async def query(self, sql: str, args: Any = ()) -> list[sqlite3.Row]:
        self.ran.append((sql, args))
        return await super().query(sql, args)

    async def plans(self) -> list[str]:
        out = []
        for sql, args in self.ran:
            for row in await super().query("EXPLAIN QUERY PLAN " + sql, args):
                out.append(row["detail"])
        self.ran.clear()
        return out


async def writer_cost(store: Store, now: float) -> str:
    """A 1,000-row flush as ActivityLog sends it (the rows, then the rollup upserts it sums
    per hour and key or model), beside the same rows under migration 3's per-row trigger
    (what the writer did before migration 5), and the rows alone."""
    trigger = next(s for s in MIGRATIONS[2] if "CREATE TRIGGER" in s)
    batch = list(activity_rows(1000, now, 1.0, seed=2))

    def rows_alone() -> Awaitable[None]:
        return store.execute_many(INSERT, batch)

    summed: list[float] = []
    triggered: list[float] = []
    alone: list[float] = []
    ways: list[tuple[list[float], Callable[[], Awaitable[None]], bool]] = [
        (summed, lambda: activity.write(store, batch), False),
        (triggered, rows_alone, True),  # the same statement, with the trigger in place
        (alone, rows_alone, False),
    ]
    for round_ in range(9):  # each in every position in turn: WAL checkpoints hit all alike
        for times, write, trigger_on in ways[round_ % 3 :] + ways[: round_ % 3]:
            if trigger_on:
                await store.execute(trigger)
            t0 = time.perf_counter()
            await write()
            times.append((time.perf_counter() - t0) * 1000)
            if trigger_on:
                await store.execute("DROP TRIGGER activity_rollup")
    med = statistics.median
    return (
        f"Writer: a 1,000-row flush takes {med(summed):.1f} ms with its rollups summed per "
        f"batch (the writer now), {med(triggered):.1f} ms with migration 3's per-row trigger "
        f"(before), {med(alone):.1f} ms for the rows alone (medians of 9, order rotated)."
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=5_000_000, help="activity rows (5,000,000)")
    p.add_argument("--days", type=int, default=30, help="days they spread over (30)")
    p.add_argument("--queue-backends", type=int, default=20, help="backends sampled every 5 s")
    p.add_argument("--repeat", type=int, default=5, help="runs of each query (5)")
    p.add_argument("--plans", action="store_true", help="print EXPLAIN QUERY PLAN of some")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="corrallm-bench-store-"))
    try:
        path = folder / "corrallm.db"
        now = time.time()
        t0 = time.perf_counter()
        made = generate(path, args, now)
        total = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
        print(
            f"Generated {made['rows']:,.0f} activity rows over {args.days} days and "
            f"{made['samples']:,.0f} queue samples in {total:.1f} s "
            f"(activity {made['activity rows']:.1f} s, queue {made['queue samples']:.1f} s, "
            f"indexes {made['indexes']:.1f} s, rollup backfill {made['rollups']:.1f} s, "
            f"{made['rollup rows']:,.0f} rollup rows); file {size:.2f} GB.\n"
        )
        print("| query | result rows | median ms | max ms | well under 1 s (max < 500 ms) |")
        print("|---|---:|---:|---:|---|")
        for line in asyncio.run(measure(path, now, args.repeat, args.plans)):
            print(line)
        print(
            f"\n- Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
            f"{platform.machine()}; each query through the store's thread, {args.repeat} runs"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
