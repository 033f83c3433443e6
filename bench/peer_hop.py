"""What does one peer hop (SPEC §19) add? The same request, same run: direct to the upstream,
through a corrallm node, and through a gateway corrallm that serves the node's model as
its peer backend `bench@b`.

    .venv/bin/python bench/peer_hop.py [--requests N] [--repeats R] [--quick] [--json]

(a) direct: the static nginx upstream of bench/overhead.py; (b) node: `corrallm serve`
with the pure-proxy model `bench` in front of it (overhead.py's own `start_corrallm`);
(c) gateway: a second `corrallm serve` whose only config is `peers: {b: {url: <node>,
token: <the node's admin.token>}}`, so `bench` reaches it as `bench@b` and goes gateway ->
node -> upstream. Measured only once GET /api/v1/overview on the gateway shows the peer
up and one answer carried `x-corrallm-backend: bench@b`. Both corrallm processes share the
proxy CPU of overhead.py's `cpu_plan()` (on 2 CPUs: CPU 1; the upstream, load generators
and this script on CPU 0); `--no-pin` turns that off.

Per path, in `--repeats` interleaved rounds (the order reversed every other round): a
block of sequential non-streamed chat completions on one kept-alive connection
(bench/loadgen.py, aiohttp) and a wrk run at c=64. The hop is (c) - (b). Prints markdown
tables; see bench/README.md ("One peer hop").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead as ov

PATHS = ("direct", "node", "gateway")
LABEL = {
    "direct": "(a) direct",
    "node": "(b) node",
    "gateway": "(c) gateway + node",
}


# --- processes ------------------------------------------------------------------------------


def start_fast_upstream(procs: ov.Procs) -> tuple[int, int, str]:
    """overhead.py's static nginx (else `corrallm fake-backend --fast`): port, pid, kind."""
    nginx = ov.find_nginx()
    if nginx is not None:
        port, proc = ov.start_static_upstream(procs, nginx)
        return port, proc.pid, "nginx, static `return 200` (own instance, 1 worker)"
    port = ov.free_port()
    cmd = [ov.PY, "-m", "corrallm", "fake-backend", "--port", str(port), "--fast"]
    proc = procs.start("fast", cmd, "backend")
    procs.wait_healthy("fast", proc, f"http://127.0.0.1:{port}/health")
    return port, proc.pid, "corrallm fake-backend --fast (Python: nginx not found)"


def start_gateway(procs: ov.Procs, node_url: str, token: str) -> tuple[ov.Target, str]:
    """`corrallm serve` with the node as its only peer; its target and admin token."""
    port = ov.free_port()
    config = procs.tmp / "gateway.yaml"
    config.write_text(f"peers:\n  b: {{url: '{node_url}', token: '{token}'}}\n")
    home = procs.tmp / "gateway-home"
    cmd = [ov.PY, "-m", "corrallm", "serve", "--config", str(config), "--home", str(home)]
    proc = procs.start("gateway", cmd, "proxy", env={"ADDR": f"127.0.0.1:{port}"})
    base = f"http://127.0.0.1:{port}"
    procs.wait_healthy("gateway", proc, f"{base}/health")
    url = f"{base}/v1/chat/completions"
    return ov.Target("gateway", url, url, proc.pid), (home / "admin.token").read_text().strip()


def _get_json(url: str, token: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=2) as r:
        return json.loads(r.read())


def wait_peer_up(procs: ov.Procs, gateway: ov.Target, token: str, timeout: float = 30.0) -> None:
    """Until the gateway's overview shows peer b up with `bench` ready, and a request to it
    is answered by `bench@b` (not some other route)."""
    base = gateway.chat_url.removesuffix("/v1/chat/completions")
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = _get_json(f"{base}/api/v1/overview", token)
            peer = last["peers"][0]
            if peer["state"] == "up" and any(
                m["name"] == "bench" and m["state"] == "ready" for m in peer["models"]
            ):
                break
        except (OSError, KeyError, IndexError, ValueError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(
                f"peer b not up on the gateway after {timeout}s: {json.dumps(last)[:800]}\n"
                + procs.log_tail("gateway")
            )
        time.sleep(0.05)
    body = {"model": "bench", "messages": ov.PROMPT, "max_tokens": ov.FAST_TOKENS}
    req = urllib.request.Request(
        gateway.chat_url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        backends = r.headers.get_all("x-corrallm-backend") or []
    if "bench@b" not in backends:
        raise RuntimeError(f"the gateway answered from {backends}, not bench@b")


# --- accounting: the node's CPU beside the proxy's -----------------------------------------


@dataclass
class HopWindow(ov.Window):
    """overhead.py's window, plus the CPU of the node behind the gateway."""

    node: int | None = None

    def __enter__(self) -> HopWindow:
        self._node = ov.session_usage(self.node)[0]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.result["node_cpu_s"] = (
            ov.session_usage(self.node)[0] - self._node if self.node else None
        )


@dataclass
class HopBench(ov.Bench):
    behind: dict[str, int] | None = None  # target name -> the node's pid behind it

    def window(self, t: ov.Target, upstream: int, rss: bool = False) -> HopWindow:
        node = (self.behind or {}).get(t.name)
        return HopWindow(t.pid, upstream, self.cpu_sets(), rss, node=node)


def settle(pids: list[int], quiet: float = 0.05, timeout: float = 5.0) -> None:
    """Until the corrallm processes use under `quiet` of a CPU over 200 ms (after a wrk run
    they flush their activity logs): so a latency block never starts in their wake."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        before = sum(ov.session_usage(p)[0] for p in pids)
        time.sleep(0.2)
        if sum(ov.session_usage(p)[0] for p in pids) - before < quiet * 0.2:
            return


def foreign_load(blocks: list[dict[str, Any]]) -> float | None:
    """Percent of the proxies' CPU busy with processes not ours during the blocks: its busy
    share minus what the node and the gateway used (each clock tick is 10 ms)."""
    wall = sum(b["cpu"]["wall_s"] for b in blocks)
    busy = [b["cpu"].get("busy_proxy") for b in blocks]
    if not wall or None in busy:
        return None
    ours = sum((b["cpu"]["proxy_cpu_s"] or 0) + (b["cpu"].get("node_cpu_s") or 0) for b in blocks)
    total = sum(x * b["cpu"]["wall_s"] for x, b in zip(busy, blocks, strict=True)) / 100
    return max(0.0, 100 * (total - ours) / wall)


# --- run ------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, help="concurrency-1 requests per path (6000)")
    p.add_argument("--repeats", type=int, help="interleaved rounds (6)")
    p.add_argument("--duration", type=int, help="seconds of each wrk run (5)")
    p.add_argument("--concurrency", type=int, default=64, help="connections of the wrk runs")
    p.add_argument("--quick", action="store_true", help="1200 requests, 2 rounds, 2 s wrk")
    p.add_argument("--no-wrk", action="store_true", help="concurrency 1 only")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument(
        "--profile",
        type=Path,
        help="also record the gateway under wrk through (c) with py-spy (raw stacks) here",
    )
    p.add_argument("--profile-seconds", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=900, help="wall-clock cap of the run")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    q = args.quick
    args.requests = args.requests or (1200 if q else 6000)
    args.repeats = args.repeats or (2 if q else 6)
    args.duration = args.duration or (2 if q else 5)
    args.token_delay = 0.025  # overhead.Bench reads it (streams only: unused here)
    return args


def run(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    pins = {} if args.no_pin else ov.cpu_plan()
    ov.raise_fd_limit()
    if pins:
        os.sched_setaffinity(0, pins["client"])  # this script stays off the proxies' CPU
    procs = ov.Procs(tmp, pins)

    def cpus(role: str) -> str:
        return "CPU " + ",".join(map(str, sorted(pins[role])))

    load = os.getloadavg()
    before = ov.cpu_jiffies()
    time.sleep(1.0)  # how busy the machine is before anything of ours runs
    after = ov.cpu_jiffies()
    idle_busy = ", ".join(
        f"CPU {i} {100 * (after[i][0] - before[i][0]) / max(1, after[i][1] - before[i][1]):.0f} %"
        for i in sorted(after)
    )
    notes = [
        f"{os.cpu_count()} CPUs; "
        + (
            f"node and gateway corrallm both on {cpus('proxy')}; the upstream on "
            f"{cpus('backend')}; load generators and this script on {cpus('client')}"
            if pins
            else "no CPU pinning"
        )
        + f"; Python {sys.version.split()[0]}",
        "load average at start: "
        + " ".join(f"{x:.2f}" for x in load)
        + f"; busy in the second before the bench started anything: {idle_busy}",
    ]
    try:
        fast_port, fast_pid, kind = start_fast_upstream(procs)
        notes.append(f"upstream: {kind}")
        direct_url = f"http://127.0.0.1:{fast_port}/v1/chat/completions"
        node = ov.start_corrallm(procs, fast_port, fast_port)  # overhead.py's corrallm
        node.name = "node"
        node_base = node.chat_url.removesuffix("/v1/chat/completions")
        token = (tmp / "home" / "admin.token").read_text().strip()
        gateway, gw_token = start_gateway(procs, node_base, token)
        wait_peer_up(procs, gateway, gw_token)
        targets = [ov.Target("direct", direct_url, direct_url), node, gateway]
        assert node.pid is not None
        up = ov.Upstreams(fast_port, fast_port, fast_pid, fast_pid, kind, kind, None)
        bench = HopBench(
            args, procs, time.monotonic() + args.max_seconds, up, behind={"gateway": node.pid}
        )
        wrk = None if args.no_wrk else shutil.which("wrk")
        if wrk is None and not args.no_wrk:
            notes.append("wrk not found (`apt-get install -y wrk`): no throughput runs")
        parts: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        runs: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        block = -(-args.requests // args.repeats)
        res: dict[str, dict[str, Any]] = {t.name: {} for t in targets}
        try:
            for rep in range(args.repeats):
                order = targets if rep % 2 == 0 else list(reversed(targets))
                for t in order:
                    print(f"... round {rep + 1}: {t.name}", file=sys.stderr, flush=True)
                    if t is gateway:
                        wait_peer_up(procs, gateway, gw_token, timeout=10)
                    settle([node.pid, gateway.pid])
                    warmup = min(300, args.requests // 4) if rep == 0 else 50
                    parts[t.name].append(bench.latency(t, block, warmup))
                    if wrk:
                        runs[t.name].append(bench.throughput(t, wrk))
            if args.profile and wrk:
                print("... profile: gateway", file=sys.stderr, flush=True)
                res["gateway"]["profile"] = bench.profile(gateway, wrk, args.profile)
        except ov.OutOfTime:
            notes.append(f"stopped early: --max-seconds {args.max_seconds:g} reached")
        for name, p in parts.items():
            if not p:
                continue
            node_cpu = [b["cpu"].get("node_cpu_s") for b in p]
            other = foreign_load(p)
            per_block = [foreign_load([b]) for b in p]
            res[name]["latency"] = ov.merge_latency(p)  # pops each block's times
            res[name]["latency"]["cpu"]["node_cpu_s"] = None if None in node_cpu else sum(node_cpu)
            res[name]["latency"]["foreign_pct"] = other
            for b, x in zip(res[name]["latency"]["blocks"], per_block, strict=True):
                b["foreign_pct"] = x
        for name, r in runs.items():
            if r:
                res[name]["throughput"] = ov.median_run(r)
        load = os.getloadavg()
        notes.append("load average at end: " + " ".join(f"{x:.2f}" for x in load))
        errors = sum(r.get("latency", {}).get("errors", 0) for r in res.values())
        errors += sum(r.get("throughput", {}).get("errors", 0) for r in res.values())
        if errors:
            notes.append(f"{errors} requests failed (non-200 or socket errors): see the tables")
        return res, notes
    finally:
        procs.close()


# --- report ---------------------------------------------------------------------------------

_f = ov._f


def _max(*values: float | None) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _per_request_us(r: dict[str, Any], key: str) -> float | None:
    cpu = r.get("cpu", {}).get(key)
    return cpu / r["sent"] * 1e6 if cpu is not None and r.get("sent") else None


def report(res: dict[str, dict[str, Any]], notes: list[str], args: argparse.Namespace) -> str:
    lat = {n: r["latency"] for n, r in res.items() if "latency" in r}
    thr = {n: r["throughput"] for n, r in res.items() if "throughput" in r}
    direct, node, gw = (lat.get(n) for n in PATHS)
    out = [
        f"### Non-streaming chat completion, concurrency 1 ({args.requests} requests per path "
        f"in {args.repeats} interleaved blocks; percentiles over all of them)",
        "",
        "| path | p50 ms | p99 ms | mean ms | added to direct p50 ms | added p99 ms "
        "| blocks: p99 min..max ms | errors | gateway CPU µs/req | node CPU µs/req "
        "| others on the proxy CPU % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in lat.items():
        added = [ov._minus(r, direct, k) for k in ("p50", "p99")]
        gw_us = _per_request_us(r, "proxy_cpu_s") if n == "gateway" else None
        node_us = _per_request_us(r, "node_cpu_s" if n == "gateway" else "proxy_cpu_s")
        out.append(
            f"| {LABEL[n]} | {_f(r['p50'], 3)} | {_f(r['p99'], 3)} | {_f(r['mean'], 3)} "
            f"| {_f(added[0], 3)} | {_f(added[1], 3)} "
            f"| {ov._span([b['p99'] for b in r['blocks']], 2)} | {r['errors']} "
            f"| {_f(gw_us, 0)} | {_f(node_us, 0)} | {_f(r.get('foreign_pct'), 0)} |"
        )
    out += [
        "",
        "- others on the proxy CPU: its busy share during the blocks minus the node's and the "
        "gateway's own CPU, i.e. processes not this bench's; more than a few % and the run was "
        "not alone on the machine.",
        "",
    ]
    if node and gw:
        hop = {k: gw[k] - node[k] for k in ("p50", "p99", "mean")}
        per_block = [
            f"{g['p50'] - b['p50']:.3f} ({_f(_max(g.get('foreign_pct'), b.get('foreign_pct')), 0)})"
            for g, b in zip(gw["blocks"], node["blocks"], strict=True)
        ]
        node_added = {k: node[k] - direct[k] for k in ("p50", "p99")} if direct else {}
        out += [
            "### The hop: (c) - (b)",
            "",
            "| | p50 ms | p99 ms | mean ms |",
            "|---|---:|---:|---:|",
            f"| added by the hop | {_f(hop['p50'], 3)} | {_f(hop['p99'], 3)} "
            f"| {_f(hop['mean'], 3)} |",
            f"| (c) ÷ (b) | {_f(gw['p50'] / node['p50'])} | {_f(gw['p99'] / node['p99'])} "
            f"| {_f(gw['mean'] / node['mean'])} |",
        ]
        if node_added:
            out.append(
                f"| hop ÷ what the node adds to direct | "
                f"{_f(hop['p50'] / node_added['p50'])} | {_f(hop['p99'] / node_added['p99'])} "
                f"| - |"
            )
        out += [
            "",
            f"- The hop's p50 in each round, ms (in brackets: others' % of the proxy CPU, the "
            f"larger of the two blocks): {', '.join(per_block)}.",
            "",
        ]
    if thr:
        b_thr = thr.get("direct")
        n_thr = thr.get("node")
        out += [
            f"### Throughput, concurrency {args.concurrency} (wrk: {args.repeats} interleaved "
            f"runs of {args.duration} s, each after a 1 s warm-up; the median run)",
            "",
            "| path | req/s | x direct | x (b) node | runs: min..max req/s | errors "
            "| proxy CPU % | node CPU % | upstream % |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for n, r in thr.items():
            c = r["cpu"]
            proxy = c.get("proxy_cpu_s")
            node_cpu = c.get("node_cpu_s")
            wall = c["wall_s"]
            spread = r.get("rps_runs") or [r["rps"]]
            out.append(
                f"| {LABEL[n]} | {r['rps']:.0f} | {_f(r['rps'] / b_thr['rps'] if b_thr else None)} "
                f"| {_f(r['rps'] / n_thr['rps'] if n_thr else None)} "
                f"| {min(spread):.0f}..{max(spread):.0f} | {r['errors']} "
                f"| {_f(None if proxy is None else 100 * proxy / wall, 0)} "
                f"| {_f(None if node_cpu is None else 100 * node_cpu / wall, 0)} "
                f"| {_f(100 * c['upstream_cpu_s'] / wall, 0)} |"
            )
        out += [
            "",
            "- proxy CPU: the node's in (b), the gateway's in (c); both share one CPU, so in (c)"
            " their sum is at most 100 %.",
            "",
        ]
    prof = res.get("gateway", {}).get("profile")
    if prof and "path" in prof:
        frames, samples = ov.top_frames(Path(prof["path"]))
        out += [
            f"### py-spy: the gateway under wrk -c {args.concurrency} through (c), "
            f"{args.profile_seconds} s ({samples} samples, {_f(prof.get('rps'), 0)} req/s)",
            "",
            *ov.frame_table(frames, samples),
        ]
    elif prof:
        notes.append(f"profile: {prof['error']}")
    out += [f"- {n}" for n in notes]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="corrallm-peer-hop-") as tmp:
        try:
            res, notes = run(args, Path(tmp))
        except subprocess.CalledProcessError as exc:
            print(f"a load run failed: {exc}\n{exc.stderr}", file=sys.stderr)
            return 1
    notes.append(f"the run took {time.monotonic() - began:.0f} s")
    print(report(res, notes, args))
    if args.json:
        print(json.dumps({"results": res, "notes": notes}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
