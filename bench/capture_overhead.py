"""What does capturing (SPEC §21 O2) add to a request that is not kept? `capture: {bodies:
none}` against `{bodies: errors}` (and `{bodies: all}`, for scale), same run.

    .venv/bin/python bench/capture_overhead.py [--requests N] [--rounds R] [--json]

Starts the fast fake backend (`--fast`) and one `corrallm serve` per capture mode in front
of it (bench/overhead.py's processes, pinning and load generator), then sends sequential
non-streamed chat completions (concurrency 1, one kept-alive connection) to each in
alternating rounds, the order reversed every other round, so drift hits all alike. Every
answer is a 200, so `errors` opens a capture per request, feeds it the answer and drops
it at the end; `all` also redacts and keeps each one. Prints p50/p99 per mode (the median
over rounds of each round's) and the difference against `none`. The target: `errors` at
most 0.02 ms more than `none` at p50.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import PY, Bench, Procs, cpu_plan, free_port, start_fast_backend

PROMPT = [{"role": "user", "content": "Hello, how are you today?"}]
MODES = ("none", "errors", "all")


def start_corrallm(procs: Procs, mode: str, fast_port: int) -> str:
    """`corrallm serve` with one pure-proxy model and `capture.bodies: mode`; its URL."""
    port = free_port()
    config = procs.tmp / f"corrallm-{mode}.yaml"
    config.write_text(
        f"capture: {{bodies: {mode}}}\n"
        "models:\n"
        f"  bench: {{backends: [{{proxy: 'http://127.0.0.1:{fast_port}', maxConcurrent: 1000}}]}}\n"
    )
    home = procs.tmp / f"home-{mode}"
    cmd = [PY, "-m", "corrallm", "serve", "--config", str(config), "--home", str(home)]
    name = f"corrallm-{mode}"
    proc = procs.start(name, cmd, "proxy", env={"ADDR": f"127.0.0.1:{port}"})
    procs.wait_healthy(name, proc, f"http://127.0.0.1:{port}/health")
    return f"http://127.0.0.1:{port}/v1/chat/completions"


def measure(bench: Bench, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Per mode: the median over rounds of each round's p50 and p99."""
    body = {"model": "bench", "messages": PROMPT, "max_tokens": 16}
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in urls}
    for round_ in range(args.rounds):
        order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
        for mode in order:
            spec = {"mode": "latency", "url": urls[mode], "body": body, "n": args.requests}
            out = bench.loadgen({**spec, "warmup": min(200, args.requests // 5)})
            if out["errors"]:
                raise RuntimeError(f"bodies: {mode}: {out['errors']} errors")
            samples[mode].append((out["p50"], out["p99"]))
    return {
        m: {
            "p50": statistics.median(r[0] for r in v),
            "p99": statistics.median(r[1] for r in v),
            "rounds": v,
        }
        for m, v in samples.items()
    }


def hot_path(n: int = 100_000, repeats: int = 5) -> dict[str, dict[str, float]]:
    """In-process, the exact work capturing adds: µs per request for open -> start ->
    body per chunk -> close of a 200 answer, as the app drives it (best of `repeats`)."""
    from corrallm.config.loading import load_config_text
    from corrallm.cost.ledger import Visit
    from corrallm.observe.captures import Captures
    from corrallm.observe.context import Exchange

    scope = {"type": "http", "path": "/v1/chat/completions", "headers": []}
    request = json.dumps({"model": "bench", "messages": PROMPT}).encode()
    head = [(b"content-type", b"application/json")]
    shapes = {"json": [b"x" * 400, b""], "stream (64 events)": [b"data: {}\n\n"] * 64 + [b""]}
    out: dict[str, dict[str, float]] = {}
    for mode in ("none", "errors"):
        captures = Captures(load_config_text(f"capture: {{bodies: {mode}}}\n"))
        out[mode] = {}
        for shape, chunks in shapes.items():
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(n):
                    ex = Exchange("0123456789abcdef")
                    ex.capture = capture = captures.open(ex.id, scope, request)
                    visit = Visit(None, "default", "bench", "/v1/chat/completions", 0)
                    visit.status, ex.visit = 200, visit
                    # What the app's send wrapper does per message, in every mode.
                    if capture is not None:
                        capture.start(200, head)
                    for chunk in chunks:
                        if capture is not None:
                            capture.body(chunk)
                    if ex.capture is not None:
                        captures.close(ex)
                best = min(best, (time.perf_counter() - t0) / n * 1e6)
            out[mode][shape] = best
    return out


def report(res: dict[str, Any], notes: list[str]) -> str:
    base = res["none"]
    lines = [
        "| capture.bodies | p50 ms | p99 ms | added p50 ms | added p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, row in res.items():
        if mode not in MODES:
            continue
        added = [row[q] - base[q] for q in ("p50", "p99")]
        lines.append(
            f"| {mode} | {row['p50']:.3f} | {row['p99']:.3f} | {added[0]:+.3f} | {added[1]:+.3f} |"
        )
    verdict = res["errors"]["p50"] - base["p50"]
    lines += ["", f"- errors vs none, p50: {verdict:+.4f} ms (target: at most +0.02 ms)"]
    hot = res.get("hot_path")
    if hot:
        lines += [
            "",
            "In process (the capture calls alone, best of 5 x 100,000; the Exchange and",
            "Visit objects both modes make are in both columns):",
            "",
            "| answer | none µs | errors µs | added µs |",
            "|---|---:|---:|---:|",
        ]
        for shape, none in hot["none"].items():
            errors = hot["errors"][shape]
            lines.append(f"| {shape} | {none:.3f} | {errors:.3f} | {errors - none:+.3f} |")
        lines.append("")
    return "\n".join([*lines, *(f"- {n}" for n in notes)])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests per mode per round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corrallm-bench-capture-") as tmp:
        procs = Procs(Path(tmp), {} if args.no_pin else cpu_plan())
        try:
            fast_port = start_fast_backend(procs)
            urls = {mode: start_corrallm(procs, mode, fast_port) for mode in MODES}
            bench = Bench(args, procs, time.monotonic() + 900)
            res = measure(bench, urls, args)
        finally:
            procs.close()
    res["hot_path"] = hot_path()
    notes = [
        f"concurrency 1, {args.rounds} alternating rounds x {args.requests} requests per mode "
        f"(200 answers, 16 tokens, fake backend --fast); pinned: {procs.pins or 'no'}"
    ]
    print(json.dumps(res, indent=2) if args.json else report(res, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
