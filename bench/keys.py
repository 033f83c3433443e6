"""What do the trust gates (SPEC §22) cost a request? The same load, same run, through a
gateway without keys and through gateways with 1,000 named keys: the keys alone, with
the caller's key holding a 20-entry allowlist (the served model matching its last glob),
and with that and rpm/tpm/concurrent limits too high to refuse anything (the issue's
measure: every gate runs on every request and none refuses).

    .venv/bin/python bench/keys.py [--requests N] [--rounds R] [--seconds S] [--json]

bench/overhead.py's processes and pinning: the fast fake backend (`--fast`), then the
gateways in front of it, all serving their callers in the same configured lane.
Latency: sequential non-streamed chat completions at concurrency 1 on one kept-alive
connection, in alternating rounds (the order reversed every other round), the median of
each round's p50 and p99. Throughput: concurrency 64, wrk when Debian's is installed (the
key in a Lua header), else bench/loadgen.py, alternating rounds, the median. The targets
(issue "Trust"): the gates cost at most 5 % of throughput and at most 0.05 ms at p50.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import PY, Bench, Procs, cpu_plan, cpu_seconds, free_port, start_fast_backend

PROMPT = [{"role": "user", "content": "Hello, how are you today?"}]
BODY = {"model": "bench", "messages": PROMPT, "max_tokens": 16}
SECRET = "sk-bench-caller-0123456789abcdef"
KEYS = 1000
# The full policy of the measure, and two steps on the way, to see what each costs.
MODES = ("no keys", "keys", "keys + allowlist", "keys + allowlist + limits")
FULL = MODES[-1]


def keys_config(allowlist: bool = True, limits: bool = True) -> str:
    """1,000 named keys by digest (the caller's is the last), and the caller's policy."""
    lines = ["keys:"]
    for i in range(KEYS - 1):
        digest = hashlib.sha256(f"sk-bench-other-{i}".encode()).hexdigest()
        lines.append(f"  other-{i}: {{secretHash: 'sha256:{digest}', group: team}}")
    allow = ", ".join([*(f"'other-model-{i}*'" for i in range(19)), "'bench'"])
    lines += [
        "  caller:",
        f"    secretHash: 'sha256:{hashlib.sha256(SECRET.encode()).hexdigest()}'",
        "    group: team",
    ]
    if allowlist:
        lines.append(f"    models: [{allow}]")
    if limits:
        lines.append("    limits: {rpm: 100000000, tpm: 100000000000, concurrent: 10000}")
    lines.append("scheduler: {requireKeys: true, defaultGroup: team}")
    return "\n".join(lines) + "\n"


def policy_of(mode: str) -> str:
    if mode == "no keys":
        return "scheduler: {defaultGroup: team}\n"
    return keys_config(allowlist="allowlist" in mode, limits="limits" in mode)


# Every gateway serves its callers in the same lane (a configured group), so that the
# keys, their allowlist and their limits are all that differs.
LANE = "priorityGroups: {team: {weight: 1}}\n"


def slug(mode: str) -> str:
    return "-".join(mode.replace("+", "").split())


def start_corrallm(procs: Procs, mode: str, fast_port: int) -> tuple[str, int]:
    """The gateway of `mode`: its URL and its pid."""
    port = free_port()
    config = procs.tmp / f"corrallm-{slug(mode)}.yaml"
    model = (
        f"  bench: {{backends: [{{proxy: 'http://127.0.0.1:{fast_port}', maxConcurrent: 1000}}]}}"
    )
    config.write_text(f"models:\n{model}\n{LANE}{policy_of(mode)}")
    home = procs.tmp / f"home-{slug(mode)}"
    cmd = [PY, "-m", "corrallm", "serve", "--config", str(config), "--home", str(home)]
    name = f"corrallm-{slug(mode)}"
    proc = procs.start(name, cmd, "proxy", env={"ADDR": f"127.0.0.1:{port}"})
    procs.wait_healthy(name, proc, f"http://127.0.0.1:{port}/health")
    assert proc.pid is not None
    return f"http://127.0.0.1:{port}/v1/chat/completions", proc.pid


def headers(mode: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRET}"} if mode != "no keys" else {}


def latency(bench: Bench, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in urls}
    for round_ in range(args.rounds):
        for mode in list(urls) if round_ % 2 == 0 else list(reversed(urls)):
            spec = {"mode": "latency", "url": urls[mode], "body": BODY, "n": args.requests}
            out = bench.loadgen(
                {**spec, "warmup": min(200, args.requests // 5), "headers": headers(mode)}
            )
            if out["errors"]:
                raise RuntimeError(f"{mode}: {out['errors']} errors at c=1")
            samples[mode].append((out["p50"], out["p99"]))
    return {
        m: {"p50": statistics.median(r[0] for r in v), "p99": statistics.median(r[1] for r in v)}
        for m, v in samples.items()
    }


def wrk_rps(bench: Bench, wrk: str, url: str, mode: str, seconds: float) -> tuple[float, int]:
    """wrk's requests/s, and how many requests it sent."""
    lua = bench.procs.tmp / f"keys-{slug(mode)}.lua"
    extra = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in headers(mode).items())
    lua.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"{extra}wrk.body = [[{json.dumps(BODY)}]]\n"
    )
    cmd = [wrk, "-t", "2", "-c", "64", "-d", f"{seconds:g}s", "-s", str(lua), url]
    out = bench.run_client(cmd)
    if re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out):
        raise RuntimeError(f"{mode}: non-2xx answers under wrk:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return rps, int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]


def throughput(
    bench: Bench, urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    """Requests/s at c=64, and (with wrk) the gateway's own CPU time per request: on a
    shared machine the steadier of the two, since it does not count the time the
    gateway's core spent on anything else."""
    wrk = shutil.which("wrk")
    rates: dict[str, list[float]] = {m: [] for m in urls}
    cpu: dict[str, list[float]] = {m: [] for m in urls}
    for round_ in range(args.rounds):
        for mode in list(urls) if round_ % 2 == 0 else list(reversed(urls)):
            if wrk is not None:
                wrk_rps(bench, wrk, urls[mode], mode, 1)  # warm-up
                before = cpu_seconds(pids[mode])
                rps, sent = wrk_rps(bench, wrk, urls[mode], mode, args.seconds)
                rates[mode].append(rps)
                cpu[mode].append((cpu_seconds(pids[mode]) - before) / max(1, sent) * 1e6)
                continue
            spec = {"mode": "throughput", "url": urls[mode], "body": BODY, "concurrency": 64}
            out = bench.loadgen({**spec, "n": args.requests * 2, "headers": headers(mode)})
            if out["errors"]:
                raise RuntimeError(f"{mode}: {out['errors']} errors at c=64")
            rates[mode].append(out["rps"])
    return {
        m: {
            "rps": statistics.median(v),
            "rounds": v,
            "cpu_us": statistics.median(cpu[m]) if cpu[m] else None,
            "tool": wrk or "aiohttp",
        }
        for m, v in rates.items()
    }


def report(lat: dict[str, Any], thr: dict[str, Any], notes: list[str]) -> str:
    base, base_cpu = lat["no keys"], thr["no keys"]["cpu_us"]
    lines = [
        "| gateway | p50 ms (c=1) | p99 ms (c=1) | req/s (c=64) | added p50 ms | throughput "
        "| CPU µs/request (c=64) | added CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        row, rps, cpu = lat[mode], thr[mode]["rps"], thr[mode]["cpu_us"]
        ratio = rps / thr["no keys"]["rps"]
        spent = "—" if cpu is None else f"{cpu:.1f}"
        added_cpu = "—" if cpu is None else f"{cpu / base_cpu - 1:+.1%}"
        lines.append(
            f"| {mode} | {row['p50']:.3f} | {row['p99']:.3f} | {rps:,.0f} | "
            f"{row['p50'] - base['p50']:+.4f} | {ratio:.3f}x | {spent} | {added_cpu} |"
        )
    added = lat[FULL]["p50"] - base["p50"]
    ratio = thr[FULL]["rps"] / thr["no keys"]["rps"]
    lines += [
        "",
        f"- the full policy vs no keys, p50: {added:+.4f} ms (target: at most +0.05 ms)",
        f"- the full policy vs no keys, throughput: {ratio:.3f}x (target: at least 0.95x)",
    ]
    if base_cpu is not None:
        cost = thr[FULL]["cpu_us"] / base_cpu
        lines.append(
            f"- the full policy vs no keys, the gateway's CPU per request: {cost:.3f}x "
            f"(throughput on its one pinned core is the inverse: {1 / cost:.3f}x)"
        )
    return "\n".join([*lines, *(f"- {n}" for n in notes)])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="c=1 requests per mode per round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--seconds", type=float, default=5.0, help="wrk seconds per throughput run")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="corrallm-bench-keys-") as tmp:
        procs = Procs(Path(tmp), {} if args.no_pin else cpu_plan())
        try:
            fast_port = start_fast_backend(procs)
            started = {mode: start_corrallm(procs, mode, fast_port) for mode in MODES}
            urls = {mode: url for mode, (url, _) in started.items()}
            pids = {mode: pid for mode, (_, pid) in started.items()}
            bench = Bench(args, procs, time.monotonic() + 1800)
            lat = latency(bench, urls, args)
            thr = throughput(bench, urls, pids, args)
        finally:
            procs.close()
    notes = [
        f"{args.rounds} alternating rounds; c=1: {args.requests} requests per mode per round; "
        f"c=64: {thr[FULL]['tool']}; 200 answers, 16 tokens, fake backend --fast; "
        f"pinned: {procs.pins or 'no'}"
    ]
    print(
        json.dumps({"latency": lat, "throughput": thr}, indent=2)
        if args.json
        else report(lat, thr, notes)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
