"""What does corrallm add on the hot path? Same load, same run: direct, corrallm, nginx,
LiteLLM.

    .venv/bin/python bench/overhead.py [--requests N] [--quick] [--json]

Starts the fake backend (`--fast`) and a streaming one, then sends the same load straight
to them, through `corrallm serve` (a pure-proxy config), and through nginx `proxy_pass`
with upstream keepalive when nginx is installed, and through LiteLLM's proxy when `make
litellm` has installed it (or CORRALLM_LITELLM names one). When a real llama-server is found
(`make llama-server`, or CORRALLM_LLAMA_SERVER) it also serves a tiny generated model,
measured direct and through corrallm. Prints markdown tables with ratios against the
direct baseline measured in this run. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
PY = sys.executable
PROMPT = [{"role": "user", "content": "Hello, how are you today?"}]
STREAM_TOKENS = 64
LLAMA_MAX_TOKENS = 4


# --- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def cpu_plan() -> dict[str, set[int]]:
    """Pin backend, proxy and load generator apart when there are >= 4 CPUs (steadier runs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 4:
        return {}
    return {"backend": {cpus[0]}, "proxy": {cpus[1]}, "client": set(cpus[2:6])}


def pinner(cpus: set[int] | None) -> Any:
    """A preexec_fn that pins the child to `cpus` (None: no pinning)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


@dataclass
class Procs:
    """Every process started here, each in its own group; all killed in `close()`."""

    tmp: Path
    pins: dict[str, set[int]]
    running: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], role: str, env: dict[str, str] | None = None) -> Any:
        log = (self.tmp / f"{name}.log").open("wb")
        cpus = self.pins.get(role)
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            preexec_fn=pinner(cpus),
        )
        log.close()
        self.running.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.tmp / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, name: str, proc: Any, url: str, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while http_status(url) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            if time.monotonic() > end:
                raise RuntimeError(f"{name} not healthy after {timeout}s:\n{self.log_tail(name)}")
            time.sleep(0.02)

    def close(self) -> None:
        for _, proc in reversed(self.running):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 5
        for _, proc in reversed(self.running):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group, even if the leader left
            proc.wait()


@dataclass
class Target:
    name: str
    chat_url: str
    stream_url: str
    pid: int | None = None
    llama_url: str | None = None  # chat completions served by the real llama-server


def start_corrallm(
    procs: Procs, fast_port: int, stream_port: int, llama_port: int | None = None
) -> Target:
    port = free_port()
    config = procs.tmp / "corrallm.yaml"
    config.write_text(
        "models:\n"
        f"  bench: {{backends: [{{proxy: 'http://127.0.0.1:{fast_port}', maxConcurrent: 1000}}]}}\n"
        f"  bench-stream: {{backends: [{{proxy: 'http://127.0.0.1:{stream_port}', "
        "maxConcurrent: 1000}]}\n"
        + (
            f"  bench-llama: {{backends: [{{proxy: 'http://127.0.0.1:{llama_port}', "
            "maxConcurrent: 1000}]}\n"
            if llama_port
            else ""
        )
    )
    cmd = [
        PY,
        "-m",
        "corrallm",
        "serve",
        "--config",
        str(config),
        "--home",
        str(procs.tmp / "home"),
    ]
    proc = procs.start("corrallm", cmd, "proxy", env={"ADDR": f"127.0.0.1:{port}"})
    procs.wait_healthy("corrallm", proc, f"http://127.0.0.1:{port}/health")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    return Target("corrallm", url, url, proc.pid, url if llama_port else None)


def find_cached(variable: str, script: str) -> str | None:
    """The executable `variable` names, else where `scripts/<script> --path` caches it;
    None if neither is there."""
    path = (
        os.environ.get(variable)
        or subprocess.run(
            [str(ROOT / "scripts" / script), "--path"], capture_output=True, text=True
        ).stdout.strip()
    )
    return path if path and os.access(path, os.X_OK) else None


def start_llama_server(procs: Procs, binary: str) -> int:
    """llama-server on the tiny generated model (tests/support/tiny_gguf.py); its port."""
    model = procs.tmp / "tiny.gguf"
    gguf = [PY, "-m", "tests.support.tiny_gguf", str(model)]
    subprocess.run(gguf, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    flags = ["-c", "2048", "-np", "4", "-t", "1"]
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = procs.start("llama-server", cmd, "backend")
    procs.wait_healthy("llama-server", proc, f"http://127.0.0.1:{port}/health", timeout=60)
    return port


def start_litellm(procs: Procs, binary: str, fast_port: int, stream_port: int) -> Target:
    """LiteLLM's proxy with the same two models, one worker, no database, offline."""
    port = free_port()
    config = procs.tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        + "".join(
            f"  - model_name: {name}\n"
            f"    litellm_params: {{model: openai/{name}, "
            f"api_base: 'http://127.0.0.1:{backend}/v1', api_key: none}}\n"
            for name, backend in (("bench", fast_port), ("bench-stream", stream_port))
        )
    )
    cmd = [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--num_workers", "1"]
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price list at start
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        # No key, as the other paths: a loopback bench, not a deployment.
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    proc = procs.start("litellm", cmd, "proxy", env=env)
    procs.wait_healthy("litellm", proc, f"http://127.0.0.1:{port}/health/liveliness", 120)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    return Target("litellm", url, url, proc.pid)


NGINX_CONF = """daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    upstream fast {{ server 127.0.0.1:{fast}; keepalive 256; }}
    upstream stream {{ server 127.0.0.1:{stream}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
    server {{
        listen 127.0.0.1:{sport};
        location / {{
            proxy_pass http://stream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def start_nginx(procs: Procs, nginx: str, fast_port: int, stream_port: int) -> Target:
    port, sport = free_port(), free_port()
    conf = procs.tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(tmp=procs.tmp, fast=fast_port, stream=stream_port, port=port, sport=sport)
    )
    cmd = [nginx, "-p", str(procs.tmp), "-e", str(procs.tmp / "nginx-error.log"), "-c", str(conf)]
    proc = procs.start("nginx", cmd, "proxy")
    procs.wait_healthy("nginx", proc, f"http://127.0.0.1:{port}/health")
    path = "/v1/chat/completions"
    return Target("nginx", f"http://127.0.0.1:{port}{path}", f"http://127.0.0.1:{sport}{path}")


# --- measurements ---------------------------------------------------------------------------


class OutOfTime(Exception):
    pass


@dataclass
class Bench:
    args: argparse.Namespace
    procs: Procs
    deadline: float

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left < 1:
            raise OutOfTime
        return left

    def loadgen(self, spec: dict[str, Any]) -> dict[str, Any]:
        cpus = self.procs.pins.get("client")
        out = subprocess.run(
            [PY, str(LOADGEN), json.dumps(spec)],
            capture_output=True,
            check=True,
            timeout=self.left(),
            preexec_fn=pinner(cpus),
        )
        return dict(json.loads(out.stdout))

    def latency(self, t: Target) -> dict[str, Any]:
        body = {"model": "bench", "messages": PROMPT, "max_tokens": 16}
        warmup = min(200, self.args.requests // 5)
        spec = {"mode": "latency", "url": t.chat_url, "body": body, "n": self.args.requests}
        return self.loadgen({**spec, "warmup": warmup})

    def throughput(self, t: Target, wrk: str | None) -> dict[str, Any]:
        body = {"model": "bench", "messages": PROMPT, "max_tokens": 16}
        c = self.args.concurrency
        if wrk is None:
            n = max(2000, self.args.requests * 5)
            spec = {"mode": "throughput", "url": t.chat_url, "body": body, "concurrency": c}
            return {**self.loadgen({**spec, "n": n}), "tool": "aiohttp"}
        lua = self.procs.tmp / "post.lua"
        lua.write_text(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = [[{json.dumps(body)}]]\n"
        )
        cpus = self.procs.pins.get("client")
        threads = str(min(4, len(cpus) if cpus else 2))
        seconds = str(self.args.duration)
        for secs in ("1", seconds):  # warm-up, then the measured run
            cmd = [wrk, "-t", threads, "-c", str(c), "-d", f"{secs}s", "-s", str(lua), t.chat_url]
            out = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                check=True,
                timeout=self.left(),
                preexec_fn=pinner(cpus),
            ).stdout
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
        sock = re.search(
            r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
        )
        errors = int(bad.group(1)) if bad else 0
        errors += sum(int(x) for x in sock.groups()) if sock else 0
        total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
        return {"rps": rps, "errors": errors, "requests": total, "tool": "wrk"}

    def llama(self, t: Target) -> dict[str, Any]:
        body = {"model": "bench-llama", "messages": PROMPT, "max_tokens": LLAMA_MAX_TOKENS}
        n = max(50, self.args.requests // 5)
        spec = {"mode": "latency", "url": t.llama_url, "body": body, "n": n}
        return self.loadgen({**spec, "warmup": min(20, n // 5)})

    def streams(self, t: Target) -> dict[str, Any]:
        body = {"model": "bench-stream", "messages": PROMPT, "stream": True}
        spec = {"mode": "streams", "url": t.stream_url, "body": body, "tokens": STREAM_TOKENS}
        c = self.args.streams
        return self.loadgen({**spec, "concurrency": c, "n": c * 3})


def rss_mb(pid: int | None, key: str) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return None
    m = re.search(rf"^{key}:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) / 1024 if m else None


# --- report ---------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{0.0 if abs(x) < 0.5 * 10**-digits else x:.{digits}f}"


def _minus(row: dict[str, Any], base: dict[str, Any] | None, key: str) -> float | None:
    """row[key] - base[key], or None for the baseline itself or missing data."""
    if not base or row is base or row.get(key) is None or base.get(key) is None:
        return None
    return float(row[key] - base[key])


def _latency_table(title: str, res: dict[str, dict[str, Any]], phase: str) -> list[str]:
    """A concurrency-1 latency phase as a table, with what each path adds to direct."""
    rows = {n: r[phase] for n, r in res.items() if phase in r}
    if not rows:
        return []
    out = [
        f"### {title}",
        "",
        "| path | p50 ms | p99 ms | mean ms | added p50 ms | added p99 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = res.get("direct", {}).get(phase)
    for n, r in rows.items():
        added = [_minus(r, base, k) for k in ("p50", "p99")]
        out.append(
            f"| {n} | {_f(r['p50'], 3)} | {_f(r['p99'], 3)} | {_f(r['mean'], 3)} "
            f"| {_f(added[0], 3)} | {_f(added[1], 3)} | {r['errors']} |"
        )
    return [*out, ""]


def report(res: dict[str, dict[str, Any]], notes: list[str], args: argparse.Namespace) -> str:
    base = res.get("direct", {})
    out = []
    out += _latency_table(
        f"Non-streaming chat completion, concurrency 1 ({args.requests} requests)", res, "latency"
    )
    thr = {n: r["throughput"] for n, r in res.items() if "throughput" in r}
    if thr:
        tool = next(iter(thr.values()))["tool"]
        out += [
            f"### Throughput, concurrency {args.concurrency} ({tool})",
            "",
            "| path | req/s | x direct | requests | errors |",
            "|---|---:|---:|---:|---:|",
        ]
        b = base.get("throughput")
        for n, r in thr.items():
            ratio = r["rps"] / b["rps"] if b else None
            out.append(f"| {n} | {r['rps']:.0f} | {_f(ratio)} | {r['requests']} | {r['errors']} |")
        out.append("")
    st = {n: r["streams"] for n, r in res.items() if "streams" in r}
    if st:
        out += [
            f"### Streaming: {args.streams} concurrent streams x {STREAM_TOKENS} tokens, "
            f"{args.token_delay * 1000:g} ms apart at the backend",
            "",
            "| path | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms | inter-chunk p50 ms "
            "| inter-chunk p99 ms | added p50 ms | added p99 ms | streams | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        b = base.get("streams")
        for n, r in st.items():
            d = {k: _minus(r, b, k) for k in ("ttft_p50", "gap_p50", "gap_p99")}
            out.append(
                f"| {n} | {_f(r['ttft_p50'])} | {_f(r['ttft_p99'])} | {_f(d['ttft_p50'])} "
                f"| {_f(r['gap_p50'], 3)} | {_f(r['gap_p99'], 3)} | {_f(d['gap_p50'], 3)} "
                f"| {_f(d['gap_p99'], 3)} | {r['streams']} | {r['errors']} |"
            )
        out.append("")
    out += _latency_table(
        f"Real backend: llama-server, tiny model, max_tokens {LLAMA_MAX_TOKENS}, concurrency 1",
        res,
        "llama",
    )
    out += [f"- {n}" for n in notes]
    return "\n".join(out)


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, help="requests in the concurrency-1 run (2000)")
    p.add_argument(
        "--quick", action="store_true", help="a short run (300 requests, 2 s, 8 streams)"
    )
    p.add_argument("--concurrency", type=int, default=64, help="connections, throughput run")
    p.add_argument("--duration", type=int, help="seconds of the wrk throughput run (5)")
    p.add_argument("--streams", type=int, help="concurrent streams (32)")
    p.add_argument(
        "--token-delay",
        type=float,
        default=0.001,
        help="seconds between streamed tokens at the backend (0.001; 0.025 is a 40 tok/s LLM)",
    )
    p.add_argument("--max-seconds", type=float, default=600, help="wall-clock cap of the run")
    p.add_argument(
        "--only",
        default="direct,corrallm,nginx,litellm,llama",
        help="paths and the llama-server row",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    q = args.quick
    args.requests = args.requests or (300 if q else 2000)
    args.duration = args.duration or (2 if q else 5)
    args.streams = args.streams or (8 if q else 32)
    return args


def run(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    pins = {} if args.no_pin else cpu_plan()
    procs = Procs(tmp, pins)
    notes = [
        f"{os.cpu_count()} CPUs; "
        + (f"pinned {pins}" if pins else "no CPU pinning")
        + f"; Python {sys.version.split()[0]}; load generator in its own process"
    ]
    wanted = set(args.only.split(","))
    try:
        fast_port, stream_port = free_port(), free_port()
        fake = [PY, "-m", "corrallm", "fake-backend"]
        fast = procs.start("fast", [*fake, "--port", str(fast_port), "--fast"], "backend")
        stream_cmd = [*fake, "--port", str(stream_port), "--model-name", "bench-stream"]
        stream_cmd += ["--tokens", str(STREAM_TOKENS), "--token-delay", str(args.token_delay)]
        slow = procs.start("stream", stream_cmd, "backend")
        procs.wait_healthy("fast", fast, f"http://127.0.0.1:{fast_port}/health")
        procs.wait_healthy("stream", slow, f"http://127.0.0.1:{stream_port}/health")
        path = "/v1/chat/completions"
        llama_port = None
        llama = (
            find_cached("CORRALLM_LLAMA_SERVER", "build-llama-server.sh")
            if "llama" in wanted
            else None
        )
        if "llama" in wanted and llama is None:
            notes.append("llama-server row skipped: no binary (`make llama-server` builds it)")
        elif llama is not None:
            try:
                llama_port = start_llama_server(procs, llama)
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                notes.append(f"llama-server row skipped: {exc}")
        targets = [
            Target(
                "direct",
                f"http://127.0.0.1:{fast_port}{path}",
                f"http://127.0.0.1:{stream_port}{path}",
                llama_url=f"http://127.0.0.1:{llama_port}{path}" if llama_port else None,
            )
        ]
        if "corrallm" in wanted:
            try:
                targets.append(start_corrallm(procs, fast_port, stream_port, llama_port))
            except RuntimeError as exc:
                notes.append(f"corrallm row skipped: `corrallm serve` did not start: {exc}")
        nginx = find_nginx()
        if "nginx" in wanted and nginx is None:
            notes.append("nginx row skipped: nginx not found (install: `apt-get install -y nginx`)")
        elif "nginx" in wanted:
            assert nginx is not None
            try:
                targets.append(start_nginx(procs, nginx, fast_port, stream_port))
            except RuntimeError as exc:
                notes.append(f"nginx row skipped: {exc}")
        litellm = (
            find_cached("CORRALLM_LITELLM", "install-litellm.sh") if "litellm" in wanted else None
        )
        if "litellm" in wanted and litellm is None:
            notes.append("LiteLLM row skipped: not installed (`make litellm` installs it)")
        elif litellm is not None:
            try:
                targets.append(start_litellm(procs, litellm, fast_port, stream_port))
            except RuntimeError as exc:
                notes.append(f"LiteLLM row skipped: {exc}")
        wrk = shutil.which("wrk")
        if wrk is None:
            notes.append("wrk not found (`apt-get install -y wrk`): throughput from aiohttp")
        res: dict[str, dict[str, Any]] = {t.name: {} for t in targets}
        bench = Bench(args, procs, time.monotonic() + args.max_seconds)
        for t in targets:
            if t.pid:
                res[t.name]["rss_idle_mb"] = rss_mb(t.pid, "VmRSS")
        try:
            for phase in ("latency", "throughput", "streams", "llama"):
                for t in targets:
                    if phase == "llama" and t.llama_url is None:
                        continue
                    print(f"... {phase}: {t.name}", file=sys.stderr, flush=True)
                    if phase == "throughput":
                        res[t.name][phase] = bench.throughput(t, wrk)
                    else:
                        res[t.name][phase] = getattr(bench, phase)(t)
        except OutOfTime:
            notes.append(f"stopped early: --max-seconds {args.max_seconds:g} reached")
        ours, theirs = (res.get(n, {}).get("throughput") for n in ("corrallm", "litellm"))
        if ours and theirs and theirs["rps"]:
            ratio = ours["rps"] / theirs["rps"]
            notes.append(f"corrallm throughput = {ratio:.1f}x LiteLLM's (SPEC §13: at least 5x)")
        for t in targets:
            if t.pid:
                res[t.name]["rss_peak_mb"] = rss_mb(t.pid, "VmHWM")
                idle, peak = res[t.name]["rss_idle_mb"], res[t.name]["rss_peak_mb"]
                notes.append(f"{t.name} RSS: idle {_f(idle, 1)} MB, peak {_f(peak, 1)} MB")
        return res, notes
    finally:
        procs.close()


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that kill groups

    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="corrallm-bench-") as tmp:
        try:
            res, notes = run(args, Path(tmp))
        except subprocess.CalledProcessError as exc:
            print(f"a load run failed: {exc}\n{exc.stderr}", file=sys.stderr)
            return 1
    print(report(res, notes, args))
    if args.json:
        print(json.dumps({"results": res, "notes": notes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
