"""Does each group get its weight's share of a saturated backend? (SPEC §6 S3)

    .venv/bin/python bench/fairness.py               # simulated core, then a real gateway
    .venv/bin/python bench/fairness.py --sim-only    # the pure core alone (a few seconds)
    .venv/bin/python bench/fairness.py --real-only --seconds 8 --workers 8

Weights 10:1, 3:1 and 1:1:1. Two measurements, each a markdown table of served share
against weight share and the worst deviation:

- **sim**: the pure core (`corrallm.scheduler.core.Scheduler`) with a simulated clock: one
  backend, every group keeps requests waiting, each request holds its slot for one second
  of simulated time; shares after 100, 1,000 and 10,000 seconds.
- **real**: `corrallm serve` in front of a `corrallm fake-backend --latency 0.02` pure-proxy
  backend with `maxConcurrent: 2`; one API key per group, `onSaturated: {default: queue}`,
  and `--workers` clients per group sending back to back for `--warmup` + `--seconds`;
  completions are counted over the window after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import PY, Procs, free_port

from corrallm.scheduler.core import (
    Admit,
    Currency,
    GroupSpec,
    Policy,
    Request,
    Scheduler,
)

WEIGHTS: list[tuple[int, ...]] = [(10, 1), (3, 1), (1, 1, 1)]
PROMPT = [{"role": "user", "content": "Hello, how are you today?"}]


# --- shares -----------------------------------------------------------------------------


def shares_row(weights: tuple[int, ...], served: list[int]) -> tuple[str, str, float, float]:
    """(served shares, weight shares, worst deviation in points, worst relative deviation)."""
    total = sum(served) or 1
    got = [n / total for n in served]
    want = [w / sum(weights) for w in weights]
    worst = max(abs(g - w) for g, w in zip(got, want, strict=True))
    relative = max(abs(g - w) / w for g, w in zip(got, want, strict=True))
    return (
        " / ".join(f"{g:.3f}" for g in got),
        " / ".join(f"{w:.3f}" for w in want),
        worst * 100,
        relative * 100,
    )


def ratio(weights: tuple[int, ...]) -> str:
    return ":".join(str(w) for w in weights)


# --- sim ----------------------------------------------------------------------------------


def simulate(
    weights: tuple[int, ...], seconds: int, currency: Currency, slots: int = 1, backlog: int = 4
) -> list[int]:
    """Served counts per group when every group keeps `backlog` requests waiting on one
    backend and each request holds its slot for one simulated second (usage 1)."""
    names = [f"g{i}" for i in range(len(weights))]
    core = Scheduler(
        [GroupSpec(n, w, currency) for n, w in zip(names, weights, strict=True)], 10**6
    )
    core.add_backend("b", slots)
    ids, now = itertools.count(), 0.0
    group_of: dict[int, str] = {}
    waiting: Counter[str] = Counter()
    served: Counter[str] = Counter()
    running: list[int] = []

    def took(rid: int) -> None:
        served[group_of[rid]] += 1
        running.append(rid)

    def top_up() -> None:
        for n in names:
            while waiting[n] < backlog:
                rid = next(ids)
                group_of[rid] = n
                decision = core.submit(Request(rid, n, now), [["b"]], Policy(queue=True), now)
                if isinstance(decision, Admit):
                    took(rid)
                else:
                    waiting[n] += 1

    top_up()
    for _ in range(seconds):
        now += 1.0
        done, running[:] = list(running), []
        for rid in done:
            for admit in core.release(rid, now, 1.0):
                waiting[group_of[admit.request]] -= 1
                took(admit.request)
        top_up()
    return [served[n] for n in names]


def sim_table(currencies: list[Currency], steps: list[int], slots: int) -> str:
    out = [
        f"### Fairshare, simulated core: one backend with {slots} slot(s), every group "
        "saturating it, 1 s per request",
        "",
        "| weights | currency | simulated s | served | served share | weight share "
        "| worst deviation (pts) | worst relative |",
        "|---|---|---:|---:|---|---|---:|---:|",
    ]
    for weights in WEIGHTS:
        for currency in currencies:
            for seconds in steps:
                served = simulate(weights, seconds, currency, slots)
                got, want, worst, relative = shares_row(weights, served)
                out.append(
                    f"| {ratio(weights)} | {currency} | {seconds:,} | {sum(served):,} | {got} "
                    f"| {want} | {worst:.2f} | {relative:.1f}% |"
                )
    return "\n".join(out)


# --- real ---------------------------------------------------------------------------------


def gateway_config(backend_port: int, slots: int) -> str:
    """One model on the fake backend; a group and an API key per (weight set, member)."""
    groups, keys = [], []
    for i, weights in enumerate(WEIGHTS):
        for j, w in enumerate(weights):
            groups.append(f"  s{i}g{j}: {{weight: {w}, onSaturated: {{default: queue}}}}")
            keys.append(f"key-s{i}g{j}: s{i}g{j}")
    return (
        "models:\n"
        "  fair:\n"
        f"    backends: [{{name: fake, proxy: 'http://127.0.0.1:{backend_port}', "
        f"maxConcurrent: {slots}}}]\n"
        "priorityGroups:\n" + "\n".join(groups) + "\n"
        "keys: {" + ", ".join(keys) + "}\n"
        "scheduler: {maxWait: 120s, maxQueueDepth: 1000}\n"
    )


async def load(
    url: str, keys: list[str], workers: int, warmup: float, seconds: float
) -> dict[str, Any]:
    """`workers` clients per key, back to back; completions counted inside the window."""
    body = json.dumps({"model": "fair", "messages": PROMPT, "max_tokens": 16}).encode()
    start = time.monotonic()
    window = (start + warmup, start + warmup + seconds)
    served: Counter[str] = Counter()
    refused: Counter[str] = Counter()

    async def worker(session: aiohttp.ClientSession, key: str) -> None:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        while time.monotonic() < window[1]:
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if window[0] <= time.monotonic() <= window[1]:
                (served if ok else refused)[key] += 1

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=warmup + seconds + 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(worker(session, k)) for k in keys for _ in range(workers)]
        await asyncio.sleep(warmup + seconds)
        done, pending = await asyncio.wait(tasks, timeout=30)  # the last requests drain
        for task in pending:
            task.cancel()
        errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    return {"served": [served[k] for k in keys], "refused": sum(refused.values())}


def real_table(args: argparse.Namespace, tmp: Path) -> str:
    procs = Procs(tmp, {})
    try:
        backend_port, port = free_port(), free_port()
        fake = [PY, "-m", "corrallm", "fake-backend", "--port", str(backend_port)]
        backend = procs.start("fake", [*fake, "--latency", str(args.latency)], "backend")
        procs.wait_healthy("fake", backend, f"http://127.0.0.1:{backend_port}/health")
        config = tmp / "corrallm.yaml"
        config.write_text(gateway_config(backend_port, args.slots))
        serve = [PY, "-m", "corrallm", "serve", "--config", str(config), "--home", str(tmp / "h")]
        gateway = procs.start("corrallm", serve, "proxy", env={"ADDR": f"127.0.0.1:{port}"})
        procs.wait_healthy("corrallm", gateway, f"http://127.0.0.1:{port}/health")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        out = [
            f"### Fairshare through `corrallm serve`: maxConcurrent {args.slots}, backend "
            f"latency {args.latency * 1000:g} ms, {args.workers} clients per group, "
            f"{args.seconds:g} s counted after {args.warmup:g} s warm-up",
            "",
            "| weights | completed | served share | weight share | worst deviation (pts) "
            "| worst relative | req/s | refused |",
            "|---|---:|---|---|---:|---:|---:|---:|",
        ]
        for i, weights in enumerate(WEIGHTS):
            print(f"... real: {ratio(weights)}", file=sys.stderr, flush=True)
            keys = [f"key-s{i}g{j}" for j in range(len(weights))]
            result = asyncio.run(load(url, keys, args.workers, args.warmup, args.seconds))
            served = result["served"]
            got, want, worst, relative = shares_row(weights, served)
            out.append(
                f"| {ratio(weights)} | {sum(served):,} | {got} | {want} | {worst:.2f} "
                f"| {relative:.1f}% | {sum(served) / args.seconds:.0f} | {result['refused']} |"
            )
        return "\n".join(out)
    finally:
        procs.close()


# --- main ---------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sim-only", action="store_true", help="only the simulated core")
    p.add_argument("--real-only", action="store_true", help="only the real gateway")
    p.add_argument("--currencies", default="requests,slotSeconds,tokens", help="sim currencies")
    p.add_argument("--steps", default="100,1000,10000", help="simulated seconds per row")
    p.add_argument("--sim-slots", type=int, default=1, help="slots of the simulated backend")
    p.add_argument("--slots", type=int, default=2, help="maxConcurrent of the real backend")
    p.add_argument("--latency", type=float, default=0.02, help="fake backend latency, s")
    p.add_argument("--workers", type=int, default=8, help="concurrent clients per group")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before counting")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds counted per weight set")
    args = p.parse_args(argv)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally that kills the groups

    signal.signal(signal.SIGTERM, stop)
    tables = []
    if not args.real_only:
        currencies: list[Any] = args.currencies.split(",")
        steps = [int(s) for s in args.steps.split(",")]
        tables.append(sim_table(currencies, steps, args.sim_slots))
        print(tables[-1] + "\n", flush=True)
    if not args.sim_only:
        with tempfile.TemporaryDirectory(prefix="corrallm-fairness-") as tmp:
            tables.append(real_table(args, Path(tmp)))
        print(tables[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
