"""How soon after a backend turns healthy does its first byte reach the client?
(SPEC §13: ≤ 100 ms.)

    .venv/bin/python bench/cold_start.py [--runs 30] [--load-seconds 1.0]

Starts `corrallm serve` with one model whose backend is the fake backend with a load delay
(its health answers 503 until then). Each run unloads the model, sends a streamed chat
completion, and notes when its first byte arrives; the fake backend reports the instant its
loading ended (`ready_at` in `/debug/stats`, on the same monotonic clock, which Linux
shares between processes). The table gives the gap between the two (the health poll's
detection, the state change, forwarding, the backend's own first byte) and the whole cold
request, p50 / p90 / max in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import fake_cmd, running_gateway, wait_for  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=1.0,
        help="backend load time; longer than the fake backend's own start-up (~0.4 s)",
    )
    args = parser.parse_args()
    # Ten models whose loads differ by 11 ms: the instant a backend turns healthy lands at
    # every phase of the health poll, rather than at the same one each run.
    models = {
        f"m{i}": fake_cmd("--load-seconds", f"{args.load_seconds + 0.011 * i:.3f}", "--tokens", "4")
        for i in range(10)
    }
    config = "models:\n" + "".join(
        f'  {name}: {{backends: [{{cmd: "{cmd}", proxy: "${{PORT}}"}}]}}\n'
        for name, cmd in models.items()
    )
    gaps, totals = [], []
    with tempfile.TemporaryDirectory() as tmp, running_gateway(config, Path(tmp)) as gw:
        for run in range(args.runs):
            model = f"m{run % len(models)}"
            gw.api("POST", "models/unload", {"model": model})
            backend = f"{model}#0"
            wait_for(lambda b=backend: gw.state(b) == "stopped", 30, what="unloaded")
            body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            sent = time.monotonic()
            with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
                first = None
                for _chunk in r.iter_raw():
                    first = first or time.monotonic()
            stats = gw.upstream("GET", f"{model}/debug/stats").json()
            assert first is not None and r.status_code == 200
            gaps.append((first - stats["ready_at"]) * 1000)
            totals.append((first - sent) * 1000)

    def row(name: str, xs: list[float]) -> str:
        xs = sorted(xs)
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        return f"| {name} | {statistics.median(xs):.1f} | {p90:.1f} | {xs[-1]:.1f} |"

    print(f"### Cold start, {args.runs} runs, backend load {args.load_seconds:g} s\n")
    print("| ms | p50 | p90 | max |\n|---|---:|---:|---:|")
    print(row("healthy -> first byte at the client", gaps))
    print(row("request sent -> first byte (whole cold request)", totals))


if __name__ == "__main__":
    main()
