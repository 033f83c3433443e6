"""How soon is a dead or hung ready backend noticed, and a persistent one back? (SPEC §17 M4)

    .venv/bin/python bench/liveness.py [--runs 5] [--interval 1] [--failures 3]

Starts `corrallm serve` with two persistent models on fake backends, probed every
`--interval` seconds and failed after `--failures` misses in a row:

- `dies`: each run kills its ready backend with SIGKILL and times, from the kill, the
  moment corrallm shows it `failed` and the moment it is `ready` again (the restart waits
  out the start back-off: 1 s after a first failure, doubling while it keeps dying; runs
  are spaced so that each one is a first failure).
- `hangs`: its fake backend blocks its event loop `--hang-after` seconds after turning
  healthy (`--hang-after-ready`: /health and inference get no answer). Timed from that
  instant (the fake backend's `ready_at` + the delay, on the monotonic clock Linux shares
  between processes) to `failed` and to `ready` again; detection takes `failures` probes,
  an interval apart, each bounded by min(interval, 2 s).

The state is read from `GET /api/v1/overview` every 5 ms, so each time is late by at most
that. Prints p50 / max per column, in ms.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import Gateway, fake_cmd, running_gateway  # noqa: E402

POLL = 0.005


def until(gw: Gateway, backend: str, ok: Callable[[str], bool], within: float) -> float:
    """The monotonic time at which `ok(state)` was first seen."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ok(gw.state(backend)):
            return time.monotonic()
        time.sleep(POLL)
    raise SystemExit(f"{backend}: still {gw.state(backend)} after {within:g}s")


def ready_at(gw: Gateway, backend: str) -> float:
    """When the fake backend's loading ended (its own clock, CLOCK_MONOTONIC)."""
    port = gw.records()[backend]["port"]
    stats = httpx.get(f"http://127.0.0.1:{port}/debug/stats", timeout=5).json()
    return float(stats["ready_at"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--interval", type=float, default=1.0, help="health.interval, seconds")
    parser.add_argument("--failures", type=int, default=3, help="health.failures")
    parser.add_argument("--hang-after", type=float, default=3.0, help="seconds healthy, then hang")
    args = parser.parse_args()
    health = f"health: {{interval: {args.interval}s, failures: {args.failures}}}"
    hang = fake_cmd("--hang-after-ready", str(args.hang_after))
    config = f"""
models:
  dies:
    persistent: true
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", {health}}}]
  hangs:
    persistent: true
    backends: [{{cmd: "{hang}", proxy: "${{PORT}}", {health}, stopGrace: 1s}}]
"""
    rows: dict[str, list[tuple[float, float]]] = {"dies": [], "hangs": []}
    ready = lambda s: s == "ready"  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp, running_gateway(config, Path(tmp)) as gw:
        for _ in range(args.runs):
            until(gw, "dies#0", ready, 60)
            time.sleep(args.interval * 2)  # a healthy probe resets the back-off (not timed)
            pid = gw.pid_of("dies#0")
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            failed = until(gw, "dies#0", lambda s: s in ("stopping", "failed", "starting"), 30)
            back = until(gw, "dies#0", ready, 60)
            rows["dies"].append((failed - killed, back - killed))
        for run in range(args.runs):
            # A fresh start each run: its ready_at is read before it hangs.
            until(gw, "hangs#0", lambda s: s == "starting", 60)
            until(gw, "hangs#0", ready, 60)
            hung = ready_at(gw, "hangs#0") + args.hang_after
            failed = until(gw, "hangs#0", lambda s: s in ("stopping", "failed", "starting"), 60)
            back = until(gw, "hangs#0", ready, 60)
            rows["hangs"].append((failed - hung, back - hung))
            print(f"hang run {run + 1}/{args.runs} done", file=sys.stderr)

    print(f"health.interval {args.interval:g}s, health.failures {args.failures}, {args.runs} runs")
    print()
    print("| backend | event → failed (detected) p50 | max | event → ready again p50 | max |")
    print("|---|---:|---:|---:|---:|")
    for name, values in rows.items():
        detect = [d * 1000 for d, _ in values]
        again = [b * 1000 for _, b in values]
        event = "SIGKILL" if name == "dies" else "hang"
        print(
            f"| {name} ({event}) | {statistics.median(detect):.0f} ms | {max(detect):.0f} ms "
            f"| {statistics.median(again):.0f} ms | {max(again):.0f} ms |"
        )


if __name__ == "__main__":
    main()
