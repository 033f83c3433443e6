"""Python opcodes per request through the real server: a count that, unlike CPU time on a
shared VM, comes out the same on every run, so that a change of a few per cent on the hot
path can be seen (docs/design.md, "Counted, not guessed").

    .venv/bin/python bench/opcodes.py [--requests 200] [--top 20] [--json] [--trace]

Starts bench/overhead.py's upstreams (nginx's static answer; the C streamer, here twice:
64 tokens and 2, 1 ms apart) and `corrallm serve` under this file's counting wrapper
(`--serve`: `sys.settrace` with opcode events on the event loop's thread, switched on by
SIGUSR1 and off by SIGUSR2, which writes the counts). Then, each after a warm-up:
`--requests` sequential chat completions on one connection; as many streams of 64
tokens, 10 at a time (bench/stream_client.c); the same with 2 tokens. Prints opcodes and
Python calls per request and per relayed chunk (the 64-token stream less the 2-token one,
over the 62 events between them), and each load's top functions. Tracing makes the server
about twenty times slower: the counts are the result, not the time. `--trace`: the server
traces requests (SPEC §23 E2), exporting to bench/tracing.py's local OTLP/HTTP sink (the
exporter's own thread is not counted: its work is off the event loop).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

import keys
from overhead import (
    BENCH,
    PROMPT,
    PY,
    Procs,
    build_c,
    find_nginx,
    free_port,
    start_corrallm,
    start_static_upstream,
    start_stream_upstream,
)

LONG, SHORT = 64, 2  # stream lengths, in tokens: their difference is what a chunk costs
TOKEN_DELAY = 0.001
CONCURRENCY = 10


# --- the counting wrapper (runs inside the server: `bench/opcodes.py --serve ...`) ---------


def serve(argv: list[str]) -> None:
    counts: Counter[tuple[str, int, str]] = Counter()
    calls = [0]
    out = Path(os.environ["CORRALLM_OPCODES_OUT"])

    def opcode(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            counts[(code.co_filename, code.co_firstlineno, code.co_qualname)] += 1
        return opcode

    def call(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        calls[0] += 1
        return opcode

    def start(*_: object) -> None:
        counts.clear()
        calls[0] = 0
        sys.settrace(call)  # the signal runs on the event loop's thread: that one is traced

    def stop(*_: object) -> None:
        sys.settrace(None)
        rows = [
            {"opcodes": n, "function": name, "where": f"{_short(path)}:{line}"}
            for (path, line, name), n in counts.most_common()
        ]
        out.write_text(json.dumps({"calls": calls[0], "functions": rows}))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from corrallm.cli import main as corrallm

    sys.argv = ["corrallm", *argv]
    corrallm()


def _short(path: str) -> str:
    for marker in ("site-packages/", str(Path(__file__).resolve().parent.parent) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# --- the loads -------------------------------------------------------------------------------


class Counted:
    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out

    def measure(self, load: Any, n: int) -> dict[str, Any]:
        """Opcodes and calls per request of `load` (which sends `n` requests)."""
        self.out.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR1)
        time.sleep(0.2)  # the handler runs at the server's next bytecode; it is idle now
        load()
        os.kill(self.pid, signal.SIGUSR2)
        end = time.monotonic() + 30
        while not self.out.exists() or not self.out.stat().st_size:
            if time.monotonic() > end:
                raise RuntimeError("the server wrote no counts (is it still running?)")
            time.sleep(0.05)
        time.sleep(0.1)  # the whole file
        got = json.loads(self.out.read_text())
        total = sum(f["opcodes"] for f in got["functions"])
        return {
            "requests": n,
            "opcodes": total / n,
            "calls": got["calls"] / n,
            "top": [{**f, "opcodes": f["opcodes"] / n} for f in got["functions"]],
        }


def chat(url: str, n: int, more: dict[str, str] | None = None) -> None:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port)
    body = json.dumps({"model": "bench", "messages": PROMPT, "max_tokens": 16})
    for _ in range(n):
        conn.request("POST", u.path, body, {"Content-Type": "application/json", **(more or {})})
        answer = conn.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"chat completion answered {answer.status}")
    conn.close()


def streams(client: Path, url: str, body: Path, n: int, tokens: int) -> None:
    import subprocess

    u = urlsplit(url)
    cmd = [str(client), str(u.hostname), str(u.port), u.path, str(body)]
    cmd += [str(CONCURRENCY), str(max(1, n // CONCURRENCY)), str(tokens), "300", "0"]
    done = json.loads(subprocess.run(cmd, capture_output=True, check=True, text=True).stdout)
    if done.get("errors"):
        raise RuntimeError(f"streams failed: {done}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per load (200)")
    parser.add_argument("--top", type=int, default=20, help="functions listed per load (20)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--trace", action="store_true", help="telemetry on (a local sink)")
    parser.add_argument(
        "--keys",
        choices=keys.MODES,
        help="bench/keys.py's policy (1,000 named keys ...): chat completions only, as its caller",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="serve --workers N: counts the owner's event loop (1: the one process)",
    )
    args = parser.parse_args()
    nginx = find_nginx()
    if nginx is None:
        raise SystemExit("bench/opcodes.py needs nginx (apt-get install -y nginx)")
    n = args.requests - args.requests % CONCURRENCY or CONCURRENCY
    with tempfile.TemporaryDirectory(prefix="corrallm-opcodes-") as tmp:
        procs = Procs(Path(tmp), {})
        try:
            tools = build_c(procs.tmp)
            fast, _ = start_static_upstream(procs, nginx)
            up = tools["stream_upstream"]
            long, _ = start_stream_upstream(procs, up, TOKEN_DELAY, LONG, "stream-long")
            short, _ = start_stream_upstream(procs, up, TOKEN_DELAY, SHORT, "stream-short")
            out = procs.tmp / "opcodes.json"
            os.environ["CORRALLM_OPCODES_OUT"] = str(out)
            target = start_corrallm(
                procs,
                fast,
                long,
                launcher=[PY, __file__, "--serve"],
                more={"bench-short": short},
                extra_config=(start_sink(procs) if args.trace else "")
                + (keys.LANE + keys.policy_of(args.keys) if args.keys else ""),
                workers=args.workers,
            )
            if args.workers > 1:
                time.sleep(1.0)  # every worker joined (health needs only one)
            assert target.pid is not None
            counted = Counted(target.pid, out)
            client = tools["stream_client"]
            bodies = {}
            for model in ("bench-stream", "bench-short"):
                bodies[model] = procs.tmp / f"{model}.json"
                payload = {"model": model, "messages": PROMPT, "stream": True}
                bodies[model].write_text(json.dumps(payload))
            url = target.chat_url
            loads = {
                "chat completion": lambda: chat(url, n, keys.headers(args.keys or "no keys")),
                f"stream, {LONG} tokens": lambda: streams(
                    client, url, bodies["bench-stream"], n, LONG
                ),
                f"stream, {SHORT} tokens": lambda: streams(
                    client, url, bodies["bench-short"], n, SHORT
                ),
            }
            if args.keys:  # the streams' client sends no key
                loads = {"chat completion": loads["chat completion"]}
            for load in loads.values():
                load()  # warm-up: connections pooled, first-use paths taken
            results = {name: counted.measure(load, n) for name, load in loads.items()}
        finally:
            procs.close()
    report(results, args.top)
    if args.json:
        print(json.dumps({k: {**v, "top": v["top"][: args.top]} for k, v in results.items()}))


def start_sink(procs: Procs) -> str:
    """bench/tracing.py's OTLP/HTTP sink; the `telemetry` config that exports to it."""
    port = free_port()
    cmd = [PY, str(BENCH / "tracing.py"), "--sink", str(port), str(procs.tmp / "spans.json")]
    sink = procs.start("sink", cmd, "")
    procs.wait_healthy("sink", sink, f"http://127.0.0.1:{port}/")
    return f"telemetry: {{otlp: {{endpoint: 'http://127.0.0.1:{port}'}}}}\n"


def report(results: dict[str, dict[str, Any]], top: int) -> None:
    print("| load | opcodes / request | Python calls / request |")
    print("|---|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['opcodes']:.0f} | {r['calls']:.1f} |")
    long, short = results.get(f"stream, {LONG} tokens"), results.get(f"stream, {SHORT} tokens")
    if long and short:
        chunk = (long["opcodes"] - short["opcodes"]) / (LONG - SHORT)
        chunk_calls = (long["calls"] - short["calls"]) / (LONG - SHORT)
        print(
            f"| a relayed chunk ({LONG}-token less {SHORT}-token stream) | {chunk:.0f} | "
            f"{chunk_calls:.1f} |"
        )
    for name, r in results.items():
        print(f"\n{name}: top functions (opcodes per request)\n")
        for f in r["top"][:top]:
            print(f"{f['opcodes']:8.1f}  {f['function']}  ({f['where']})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
    else:
        main()
