"""What does the Ollama surface (SPEC §23 E1) add? `/api/chat` translated to Chat
Completions vs `/v1/chat/completions`, both through corrallm, same run.

    .venv/bin/python bench/ollama.py [--requests N] [--rounds R] [--json]

Starts the fast fake backend (`--fast`, OpenAI only: every /api/chat is translated) and
`corrallm serve` in front of it (bench/overhead.py's processes, pinning and load generator),
then sends sequential requests (concurrency 1, one kept-alive connection) to each path in
alternating rounds, so drift hits all alike. Whole answers (`"stream": false`) and
streams (16 tokens: SSE on /v1, NDJSON lines on /api/chat, each read to its end).
`/v1/messages` (Anthropic's, translated the same way) is measured beside them as the
reference for what any translated dialect costs. Prints p50/p99 per path (the median
over rounds of each round's), and the difference and ratio against chat. The target
(issue 30): /api/chat at most 0.3 ms more than chat at p50.
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

from overhead import Bench, Procs, cpu_plan, start_corrallm, start_fast_backend

PROMPT = [{"role": "user", "content": "Hello, how are you today?"}]
TOKENS = 16
PATHS = ("/v1/chat/completions", "/api/chat", "/v1/messages")


def bodies(stream: bool) -> dict[str, dict[str, Any]]:
    chat = {"model": "bench", "messages": PROMPT, "max_tokens": TOKENS, "stream": stream}
    ollama = {
        "model": "bench",
        "messages": PROMPT,
        "options": {"num_predict": TOKENS},
        "stream": stream,
    }
    return {PATHS[0]: chat, PATHS[1]: ollama, PATHS[2]: chat}


def measure(bench: Bench, base: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per (path, streamed): the median over rounds of each round's p50 and p99."""
    samples: dict[str, list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        for stream in (False, True):
            made = bodies(stream)
            for path in PATHS if round_ % 2 == 0 else PATHS[::-1]:
                spec = {
                    "mode": "latency",
                    "url": base + path,
                    "body": made[path],
                    "n": args.requests,
                    "warmup": min(100, args.requests // 5),
                }
                out = bench.loadgen(spec)
                if out["errors"]:
                    raise RuntimeError(f"{path}: {out['errors']} errors")
                key = f"{path} {'stream' if stream else 'json'}"
                samples.setdefault(key, []).append((out["p50"], out["p99"]))
    return {
        k: {
            "p50": statistics.median(r[0] for r in v),
            "p99": statistics.median(r[1] for r in v),
            "rounds": v,
        }
        for k, v in samples.items()
    }


def report(res: dict[str, dict[str, Any]], notes: list[str]) -> str:
    lines = [
        "| path | mode | p50 ms | p99 ms | p50 vs chat | p99 vs chat |",
        "|---|---|---|---|---|---|",
    ]
    for mode in ("json", "stream"):
        chat = res[f"{PATHS[0]} {mode}"]
        for path in PATHS:
            row = res[f"{path} {mode}"]
            cells = [path, mode, f"{row['p50']:.3f}", f"{row['p99']:.3f}"]
            for q in ("p50", "p99"):
                diff = row[q] - chat[q]
                cells.append(f"{diff:+.3f} ms (x{row[q] / chat[q]:.2f})")
            lines.append("| " + " | ".join(cells) + " |")

    def added(path: str, mode: str) -> float:
        return float(res[f"{path} {mode}"]["p50"] - res[f"{PATHS[0]} {mode}"]["p50"])

    lines.append("")
    for path, what in ((PATHS[1], " (target: at most +0.3 ms)"), (PATHS[2], " (reference)")):
        lines.append(
            f"- {path} vs /v1/chat/completions at p50: {added(path, 'json'):+.3f} ms whole, "
            f"{added(path, 'stream'):+.3f} ms streamed{what}"
        )
    return "\n".join([*lines, *notes])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=1000, help="requests per path per round")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corrallm-bench-ollama-") as tmp:
        procs = Procs(Path(tmp), {} if args.no_pin else cpu_plan())
        try:
            fast_port = start_fast_backend(procs, "--tokens", str(TOKENS))
            target = start_corrallm(procs, fast_port, fast_port)
            bench = Bench(args, procs, time.monotonic() + 900)
            base = target.chat_url.removesuffix("/v1/chat/completions")
            res = measure(bench, base, args)
        finally:
            procs.close()
    notes = [
        f"- concurrency 1, {args.rounds} alternating rounds x {args.requests} requests per "
        f"path; fake backend --fast, {TOKENS} tokens; pinned: {procs.pins or 'no'}"
    ]
    print(json.dumps(res, indent=2) if args.json else report(res, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
