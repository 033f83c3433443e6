"""`serve --workers N`: throughput against one process, and the owner's CPU per request.

    .venv/bin/python bench/workers.py [--workers 1,2] [--duration 5] [--concurrency 64]

Against nginx serving a static chat completion (bench/overhead.py's fast upstream), the
same `wrk` load (c=64, after a 1 s warm-up) goes through `corrallm serve` with each
`--workers` count in turn (1: one process, no hop). For each: requests/s, the CPU the
whole gateway spent per request (owner and workers: its session), and the owner's own
CPU per request (utime+stime of that one process, from /proc), and of it its event
loop's thread (the rest is the store's writer thread): the share SPEC §13 caps at 20 µs,
the cost that lands on the one owner whatever the number of workers. With one worker
the "owner" is the whole single process.

Nothing is pinned: with workers on a small machine the gateway needs every core, and
the load generator and the upstream run beside it (say so when quoting the ratio). Every
process started here is stopped at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import (
    CLK_TCK,
    FAST_TOKENS,
    PROMPT,
    PY,
    Procs,
    cpu_seconds,
    find_nginx,
    free_port,
    session_usage,
    start_static_upstream,
)


def _thread_seconds(pid: int, tid: int) -> float:
    """One thread's CPU: the main thread (tid = pid) is the event loop's; the rest of
    the owner's is the store's writer thread and other helper threads."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def run_wrk(procs: Procs, wrk: str, url: str, seconds: float, concurrency: int) -> str:
    import json
    import subprocess

    lua = procs.tmp / "post.lua"
    body = {"model": "bench", "messages": PROMPT, "max_tokens": FAST_TOKENS}
    lua.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{json.dumps(body)}]]\n"
    )
    cmd = [wrk, "-t", "2", "-c", str(concurrency), "-d", f"{seconds:g}s", "-s", str(lua), url]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def measure(procs: Procs, wrk: str, upstream: int, workers: int, args: Any) -> dict[str, Any]:
    port = free_port()
    config = procs.tmp / f"corrallm-{workers}.yaml"
    config.write_text(
        "models:\n"
        f"  bench: {{backends: [{{proxy: 'http://127.0.0.1:{upstream}', maxConcurrent: 4096}}]}}\n"
    )
    home = procs.tmp / f"home-{workers}"
    cmd = [PY, "-m", "corrallm", "serve", "--config", str(config), "--home", str(home)]
    env = {"ADDR": f"127.0.0.1:{port}", "CORRALLM_WORKERS": str(workers)}
    name = f"corrallm-{workers}"
    proc = procs.start(name, cmd, "proxy", env=env)
    procs.wait_healthy(name, proc, f"http://127.0.0.1:{port}/health")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    time.sleep(1.0 if workers > 1 else 0.0)  # every worker joined (health needs only one)
    run_wrk(procs, wrk, url, 1, args.concurrency)  # warm-up
    owner0, gateway0 = cpu_seconds(proc.pid), session_usage(proc.pid)[0]
    loop0 = _thread_seconds(proc.pid, proc.pid)
    out = run_wrk(procs, wrk, url, args.duration, args.concurrency)
    owner1, gateway1 = cpu_seconds(proc.pid), session_usage(proc.pid)[0]
    loop1 = _thread_seconds(proc.pid, proc.pid)
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {
        "workers": workers,
        "rps": rps,
        "requests": total,
        "errors": int(bad.group(1)) if bad else 0,
        "gateway_us": (gateway1 - gateway0) / total * 1e6,
        "owner_us": (owner1 - owner0) / total * 1e6,
        "loop_us": (loop1 - loop0) / total * 1e6,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", default="1,2", help="worker counts to measure (1,2)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of each wrk run (5)")
    p.add_argument("--concurrency", type=int, default=64, help="wrk connections (64)")
    args = p.parse_args(argv)
    nginx, wrk = find_nginx(), __import__("shutil").which("wrk")
    if nginx is None or wrk is None:
        raise SystemExit("bench/workers.py needs nginx and wrk (apt-get install nginx wrk)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="corrallm-bench-") as tmp:
        procs = Procs(Path(tmp), {})
        try:
            upstream, _ = start_static_upstream(procs, nginx)
            for n in (int(x) for x in args.workers.split(",")):
                rows.append(measure(procs, wrk, upstream, n, args))
        finally:
            procs.close()
    base = rows[0]["rps"]
    print(f"{os.cpu_count()} CPUs, nothing pinned (wrk and the upstream share them)\n")
    print(
        "| workers | req/s | x first row | gateway CPU µs/req | owner CPU µs/req "
        "| of it, its event loop | errors |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['rps']:.0f} | {r['rps'] / base:.2f} | "
            f"{r['gateway_us']:.1f} | {r['owner_us']:.1f} | {r['loop_us']:.1f} | {r['errors']} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
