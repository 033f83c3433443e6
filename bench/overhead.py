"""What does corrallm add on the hot path? Same load, same run: direct, corrallm, nginx,
LiteLLM.

    .venv/bin/python bench/overhead.py [--requests N] [--quick] [--json] [--profile FILE]

Upstreams that cost next to nothing: nginx serving a static chat completion (its own
instance, not the nginx under test) and a small C program that streams SSE
(bench/stream_upstream.c, built here with gcc). The same load goes straight to them,
through `corrallm serve` (a pure-proxy config), through nginx `proxy_pass` with upstream
keepalive, through the Go standard library's reverse proxy (bench/httputil_proxy.go,
built with Debian's golang-go when `go` is found; the row is skipped, and said so,
otherwise), and through LiteLLM's proxy when `make litellm` has installed it (or
CORRALLM_LITELLM names one). `--workers N` gives corrallm N relaying workers, nginx N
worker processes and Go GOMAXPROCS=N. With 2 or 3 CPUs the proxy under test runs alone on the last
CPU and the upstreams and load generators on the others (with 4 or more, each on its
own); `--no-pin` turns that off. The load: `wrk` (c=64), bench/loadgen.py (c=1 latency),
bench/stream_client.c (1,000 concurrent streams). When a real llama-server is found
(`make llama-server`, or CORRALLM_LLAMA_SERVER) it also serves a tiny generated model,
measured direct and through corrallm. Prints markdown tables with ratios against the
direct baseline measured in this run, and where the CPU went in each phase. Without nginx
or gcc it falls back to `corrallm fake-backend` and the Python load generator (noted).
See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
LOADGEN = BENCH / "loadgen.py"
PY = sys.executable
PROMPT = [{"role": "user", "content": "Hello, how are you today?"}]
STREAM_TOKENS = 64
FAST_TOKENS = 16  # tokens in the non-streamed answer (the request asks max_tokens 16)
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
LLAMA_MAX_TOKENS = 4


# --- processes ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """The user and system CPU time process `pid` has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


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
    """Where each role runs: with >= 4 CPUs backend, proxy and load generator each on their
    own; with 2 or 3 the proxy under test alone on the last CPU and the upstreams and load
    generators together on the others (so the proxy's CPU is all its own, as on a server);
    with 1 nothing is pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    # "anywhere": every CPU (`--also-workers`), set explicitly: a child would otherwise
    # inherit this script's own pinning to the client's CPUs.
    if len(cpus) >= 4:
        return {
            "backend": {cpus[0]},
            "proxy": {cpus[1]},
            "client": set(cpus[2:6]),
            "anywhere": set(cpus),
        }
    if len(cpus) >= 2:
        rest = set(cpus[:-1])
        return {"backend": rest, "proxy": {cpus[-1]}, "client": rest, "anywhere": set(cpus)}
    return {}


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
    pid: int | None = None  # its session leader (each process is started in its own session)
    llama_url: str | None = None  # chat completions served by the real llama-server


@dataclass
class Upstreams:
    """The two upstreams every path is measured against, and what they are."""

    fast_port: int
    stream_port: int
    fast_pid: int
    stream_pid: int
    fast_kind: str
    stream_kind: str
    client: Path | None  # the C stream client, or None: the Python one


def start_corrallm(
    procs: Procs,
    fast_port: int,
    stream_port: int,
    llama_port: int | None = None,
    launcher: list[str] | None = None,
    more: dict[str, int] | None = None,
    extra_config: str = "",
    workers: int = 1,
    name: str = "corrallm",
    role: str = "proxy",
) -> Target:
    """`corrallm serve` in front of the bench's upstreams (and `more` models: name ->
    upstream port); `launcher` runs it instead of `python -m corrallm` (bench/opcodes.py's
    counting wrapper); `extra_config`: more top-level YAML (bench/tracing.py's
    `telemetry`); `name` and `role`: a second corrallm row (`--also-workers`) and where
    it runs (a role with no CPUs in the plan: every CPU)."""
    port = free_port()
    config = procs.tmp / f"{name}.yaml"
    # maxConcurrent above the stream count: a stream's next round may arrive before the slot
    # of the one that just ended is released, and the bench measures relaying, not queueing.
    config.write_text(
        "models:\n"
        f"  bench: {{backends: [{{proxy: 'http://127.0.0.1:{fast_port}', maxConcurrent: 4096}}]}}\n"
        f"  bench-stream: {{backends: [{{proxy: 'http://127.0.0.1:{stream_port}', "
        "maxConcurrent: 4096}]}\n"
        + (
            f"  bench-llama: {{backends: [{{proxy: 'http://127.0.0.1:{llama_port}', "
            "maxConcurrent: 1000}]}\n"
            if llama_port
            else ""
        )
        + "".join(
            f"  {name}: {{backends: [{{proxy: 'http://127.0.0.1:{p}', maxConcurrent: 4096}}]}}\n"
            for name, p in (more or {}).items()
        )
        + extra_config
    )
    cmd = [
        *(launcher or [PY, "-m", "corrallm"]),
        "serve",
        "--config",
        str(config),
        "--home",
        str(procs.tmp / ("home" if name == "corrallm" else f"{name}-home")),
    ]
    env = {"ADDR": f"127.0.0.1:{port}", "CORRALLM_WORKERS": str(workers)}
    proc = procs.start(name, cmd, role, env=env)
    procs.wait_healthy(name, proc, f"http://127.0.0.1:{port}/health")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    return Target(name, url, url, proc.pid, url if llama_port else None)


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


NGINX_COMMON = """daemon off;
worker_processes {workers};
worker_rlimit_nofile 16384;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
{servers}
}}
"""

# nginx as the proxy under test: one worker, upstream keepalive, HTTP/1.1 to the upstream,
# no buffering of the streams.
NGINX_PROXY = """    upstream fast {{
        server 127.0.0.1:{fast};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    upstream stream {{
        server 127.0.0.1:{stream};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
    server {{
        listen 127.0.0.1:{sport} backlog=4096;
        location / {{
            proxy_pass http://stream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}"""

# nginx as the non-streaming upstream (its own instance): a static chat completion.
NGINX_STATIC = """    server {{
        listen 127.0.0.1:{port} backlog=4096;
        default_type application/json;
        location = /health {{ return 200 '{{"status":"ok"}}'; }}
        location / {{ return 200 '{body}'; }}
    }}"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def _nginx(procs: Procs, nginx: str, name: str, role: str, servers: str, workers: int = 1) -> Any:
    prefix = procs.tmp / name
    prefix.mkdir()
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_COMMON.format(prefix=prefix, servers=servers, workers=workers))
    cmd = [nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    return procs.start(name, cmd, role)


def start_nginx(
    procs: Procs, nginx: str, fast_port: int, stream_port: int, workers: int = 1
) -> Target:
    """nginx as the proxy under test, with `workers` worker processes (corrallm's
    --workers, for a like-for-like row)."""
    port, sport = free_port(), free_port()
    servers = NGINX_PROXY.format(fast=fast_port, stream=stream_port, port=port, sport=sport)
    proc = _nginx(procs, nginx, "nginx", "proxy", servers, workers)
    procs.wait_healthy("nginx", proc, f"http://127.0.0.1:{port}/health")
    path = "/v1/chat/completions"
    return Target(
        "nginx", f"http://127.0.0.1:{port}{path}", f"http://127.0.0.1:{sport}{path}", proc.pid
    )


def start_go_httputil(procs: Procs, fast_port: int, stream_port: int, workers: int) -> Target:
    """The Go standard library's reverse proxy (bench/httputil_proxy.go, llama-swap's
    stack), built here with Debian's golang-go, GOMAXPROCS matching corrallm's workers.
    RuntimeError when there is no `go` (the row is then skipped, and said so)."""
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("no Go toolchain (`apt-get install -y golang-go`)")
    exe = procs.tmp / "httputil_proxy"
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    env.setdefault("GOCACHE", str(procs.tmp / "gocache"))
    built = subprocess.run(
        [go, "build", "-o", str(exe), str(BENCH / "httputil_proxy.go")],
        capture_output=True,
        text=True,
        env=env,
    )
    if built.returncode:
        raise RuntimeError(f"go build failed:\n{built.stderr[-2000:]}")
    port, sport = free_port(), free_port()
    cmd = [
        str(exe),
        f"127.0.0.1:{port}",
        f"http://127.0.0.1:{fast_port}",
        f"127.0.0.1:{sport}",
        f"http://127.0.0.1:{stream_port}",
    ]
    proc = procs.start("go-httputil", cmd, "proxy", env={"GOMAXPROCS": str(workers)})
    procs.wait_healthy("go-httputil", proc, f"http://127.0.0.1:{port}/health")
    path = "/v1/chat/completions"
    return Target(
        "go-httputil",
        f"http://127.0.0.1:{port}{path}",
        f"http://127.0.0.1:{sport}{path}",
        proc.pid,
    )


def fake_answers(tokens: int = STREAM_TOKENS) -> tuple[bytes, list[bytes], int]:
    """The bytes `corrallm fake-backend` would send: the non-streamed answer to the bench's
    request, and the events of a streamed one (`tokens` long) with the index of its first
    token event."""
    from corrallm.fake_backend import responses as r

    prompt = r.count_words(PROMPT[0]["content"])
    body = r.chat_completion("chatcmpl-bench", 1700000000, "bench", FAST_TOKENS, "length", prompt)
    events, first = r.stream_events(
        True, "chatcmpl-bench", 1700000000, "bench-stream", tokens, "stop", prompt, False
    )
    return body, events, first


def start_fast_backend(procs: Procs, *flags: str) -> int:
    """`corrallm fake-backend --fast` (the companion benchmarks' upstream); its port."""
    port = free_port()
    cmd = [PY, "-m", "corrallm", "fake-backend", "--port", str(port), "--fast", *flags]
    fast = procs.start("fast", cmd, "backend")
    procs.wait_healthy("fast", fast, f"http://127.0.0.1:{port}/health")
    return port


def start_static_upstream(procs: Procs, nginx: str) -> tuple[int, Any]:
    """nginx answering every request with the static chat completion; its port and process."""
    body = fake_answers()[0].decode()
    if any(ch in body for ch in ("'", "$", "\\", "\n")):  # nginx would interpret these
        raise RuntimeError("the static answer holds a character nginx would interpret")
    port = free_port()
    servers = NGINX_STATIC.format(port=port, body=body)
    proc = _nginx(procs, nginx, "upstream-nginx", "backend", servers)
    procs.wait_healthy("upstream-nginx", proc, f"http://127.0.0.1:{port}/health")
    return port, proc


def build_c(tmp: Path) -> dict[str, Path]:
    """Compile bench/stream_upstream.c and bench/stream_client.c into `tmp`."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("no C compiler (gcc or cc) found")
    out = {}
    for name in ("stream_upstream", "stream_client"):
        exe = tmp / name
        cmd = [gcc, "-O2", "-o", str(exe), str(BENCH / f"{name}.c"), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        out[name] = exe
    return out


def start_stream_upstream(
    procs: Procs,
    exe: Path,
    delay: float,
    tokens: int = STREAM_TOKENS,
    name: str = "stream-upstream",
) -> tuple[int, Any]:
    """The C streaming upstream, sending the fake backend's events (`tokens` of them)
    `delay` apart."""
    _, events, first = fake_answers(tokens)
    lines = []
    for i, event in enumerate(events):
        if event == b"data: [DONE]\n\n":
            continue  # the program ends every stream with it
        assert event.startswith(b"data: ") and event.endswith(b"\n\n") and b"\n" not in event[:-2]
        delayed = first < i < first + tokens  # as the fake backend spaces them
        lines.append(b"1 " if delayed else b"0 ")
        lines.append(event[6:-2] + b"\n")
    path = procs.tmp / f"{name}-events.txt"
    path.write_bytes(b"".join(lines))
    port = free_port()
    cmd = [str(exe), str(port), str(path), str(round(delay * 1e6))]
    proc = procs.start(name, cmd, "backend")
    procs.wait_healthy(name, proc, f"http://127.0.0.1:{port}/health")
    return port, proc


def start_upstreams(procs: Procs, args: argparse.Namespace, notes: list[str]) -> Upstreams:
    """nginx static + the C streamer; `corrallm fake-backend` for either that cannot run."""
    fake = [PY, "-m", "corrallm", "fake-backend"]
    fast = stream = None
    fast_kind = stream_kind = "corrallm fake-backend (Python)"
    nginx = find_nginx()
    if nginx is None:
        notes.append(
            "nginx not found (`apt-get install -y nginx`): fast upstream is the fake backend"
        )
    else:
        try:
            fast = start_static_upstream(procs, nginx)
            fast_kind = "nginx, static `return 200` (own instance, 1 worker)"
        except RuntimeError as exc:
            notes.append(f"static nginx upstream failed, using the fake backend: {exc}")
    client = None
    try:
        tools = build_c(procs.tmp)
        stream = start_stream_upstream(procs, tools["stream_upstream"], args.token_delay)
        stream_kind = "bench/stream_upstream.c (epoll, 1 thread)"
        client = tools["stream_client"]
    except RuntimeError as exc:
        notes.append(f"C stream upstream/client unavailable, using Python ones: {exc}")
    if fast is None:
        port = free_port()
        proc = procs.start("fast", [*fake, "--port", str(port), "--fast"], "backend")
        procs.wait_healthy("fast", proc, f"http://127.0.0.1:{port}/health")
        fast = (port, proc)
    if stream is None:
        port = free_port()
        cmd = [*fake, "--port", str(port), "--model-name", "bench-stream"]
        cmd += ["--tokens", str(STREAM_TOKENS), "--token-delay", str(args.token_delay)]
        proc = procs.start("stream", cmd, "backend")
        procs.wait_healthy("stream", proc, f"http://127.0.0.1:{port}/health")
        stream = (port, proc)
    return Upstreams(fast[0], stream[0], fast[1].pid, stream[1].pid, fast_kind, stream_kind, client)


# --- accounting -----------------------------------------------------------------------------


def session_usage(sid: int | None) -> tuple[float, float]:
    """CPU seconds (utime+stime of every thread, plus reaped children) and resident MB,
    summed over the processes of session `sid` (each server here leads its own)."""
    if sid is None:
        return 0.0, 0.0
    ticks = pages = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # fields[0] is field 3 (state)
        if int(fields[3]) != sid:
            continue
        ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        pages += int(fields[21])
    return ticks / CLK_TCK, pages * PAGE / 2**20


def cpu_jiffies() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy, total) jiffies from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        m = re.match(r"cpu(\d+) (.*)", line)
        if m:
            v = [int(x) for x in m.group(2).split()[:8]]  # guest time is already in user
            out[int(m.group(1))] = (sum(v) - v[3] - v[4], sum(v))  # minus idle and iowait
    return out


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@dataclass
class Window:
    """Where the CPU went while one load ran: the proxy, the upstream, the load generator
    (the children waited for meanwhile), and how busy each pinned CPU set was."""

    proxy: int | None
    upstream: int
    sets: dict[str, set[int]]
    sample_rss: bool = False
    result: dict[str, Any] = field(default_factory=dict)

    def __enter__(self) -> Window:
        self._rss = 0.0
        self._stop = threading.Event()
        if self.sample_rss and self.proxy:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        self._t = time.monotonic()
        self._cpus = cpu_jiffies()
        self._proxy = session_usage(self.proxy)[0]
        self._upstream = session_usage(self.upstream)[0]
        self._client = children_cpu()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.25):
            self._rss = max(self._rss, session_usage(self.proxy)[1])

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._t
        cpus = cpu_jiffies()
        proxy, rss = session_usage(self.proxy)
        self._stop.set()
        r = self.result
        r["wall_s"] = wall
        r["proxy_cpu_s"] = proxy - self._proxy if self.proxy else None
        r["upstream_cpu_s"] = session_usage(self.upstream)[0] - self._upstream
        r["client_cpu_s"] = children_cpu() - self._client
        r["rss_mb"] = max(self._rss, rss) if self.proxy else None
        for name, ids in self.sets.items():
            busy = sum(cpus[i][0] - self._cpus[i][0] for i in ids if i in cpus)
            total = sum(cpus[i][1] - self._cpus[i][1] for i in ids if i in cpus)
            r[f"busy_{name}"] = 100 * busy / total if total else None


# --- measurements ---------------------------------------------------------------------------


class OutOfTime(Exception):
    pass


@dataclass
class Bench:
    args: argparse.Namespace
    procs: Procs
    deadline: float
    up: Upstreams | None = None  # latency, throughput and streams need it; loadgen() not

    @property
    def ups(self) -> Upstreams:
        assert self.up is not None, "Bench(..., up=start_upstreams(...)) for this phase"
        return self.up

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left < 1:
            raise OutOfTime
        return left

    def cpu_sets(self) -> dict[str, set[int]]:
        pins = self.procs.pins
        if not pins:
            return {"all": set(os.sched_getaffinity(0))}
        sets = {"proxy": pins["proxy"], "client": pins["client"]}
        if pins["backend"] != pins["client"]:
            sets["backend"] = pins["backend"]
        return sets

    def window(self, t: Target, upstream: int, rss: bool = False) -> Window:
        return Window(t.pid, upstream, self.cpu_sets(), rss)

    def run_client(self, cmd: list[str]) -> str:
        out = subprocess.run(
            cmd,
            capture_output=True,
            check=True,
            text=True,
            timeout=self.left(),
            preexec_fn=pinner(self.procs.pins.get("client")),
        )
        return out.stdout

    def loadgen(self, spec: dict[str, Any]) -> dict[str, Any]:
        return dict(json.loads(self.run_client([PY, str(LOADGEN), json.dumps(spec)])))

    def latency(self, t: Target, n: int, warmup: int) -> dict[str, Any]:
        """One block of `n` sequential requests (after `warmup` untimed ones)."""
        body = {"model": "bench", "messages": PROMPT, "max_tokens": FAST_TOKENS}
        spec = {"mode": "latency", "url": t.chat_url, "body": body, "n": n, "raw": True}
        with self.window(t, self.ups.fast_pid) as w:
            res = self.loadgen({**spec, "warmup": warmup})
        return {**res, "sent": n + warmup, "cpu": w.result}

    def throughput(self, t: Target, wrk: str | None) -> dict[str, Any]:
        """One measured run at concurrency --concurrency (wrk after a 1 s warm-up)."""
        body = {"model": "bench", "messages": PROMPT, "max_tokens": FAST_TOKENS}
        c = self.args.concurrency
        if wrk is None:
            n = max(2000, self.args.requests * 5) // self.args.repeats
            spec = {"mode": "throughput", "url": t.chat_url, "body": body, "concurrency": c}
            with self.window(t, self.ups.fast_pid) as w:
                res = self.loadgen({**spec, "n": n})
            return {**res, "tool": "aiohttp", "cpu": w.result}
        self.run_client(self.wrk_cmd(wrk, t, 1))  # warm-up
        with self.window(t, self.ups.fast_pid) as w:
            out = self.run_client(self.wrk_cmd(wrk, t, self.args.duration))
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
        sock = re.search(
            r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
        )
        errors = int(bad.group(1)) if bad else 0
        errors += sum(int(x) for x in sock.groups()) if sock else 0
        total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
        return {"rps": rps, "errors": errors, "requests": total, "tool": "wrk", "cpu": w.result}

    def wrk_cmd(self, wrk: str, t: Target, seconds: float) -> list[str]:
        body = {"model": "bench", "messages": PROMPT, "max_tokens": FAST_TOKENS}
        lua = self.procs.tmp / "post.lua"
        lua.write_text(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = [[{json.dumps(body)}]]\n"
        )
        cpus = self.procs.pins.get("client")
        threads = str(min(4, len(cpus) if cpus else 2))
        c = str(self.args.concurrency)
        return [wrk, "-t", threads, "-c", c, "-d", f"{seconds:g}s", "-s", str(lua), t.chat_url]

    def profile(self, t: Target, wrk: str, path: Path) -> dict[str, Any]:
        """py-spy on `t` (raw collapsed stacks into `path`) while wrk loads it."""
        secs = self.args.profile_seconds
        result: dict[str, Any] = {}

        def load() -> None:
            out = self.run_client(self.wrk_cmd(wrk, t, secs + 1))
            rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
            result["rps"] = float(rps.group(1)) if rps else None

        return {**self._spy(t, path, load), **result}

    def profile_streams(self, t: Target, path: Path) -> dict[str, Any]:
        """py-spy on `t` during one streams run (its first `--profile-seconds`)."""
        result: dict[str, Any] = {}

        def load() -> None:
            run = self.streams(t)
            result["chunks"] = run.get("events")

        return {**self._spy(t, path, load), **result}

    def _spy(self, t: Target, path: Path, load: Callable[[], None]) -> dict[str, Any]:
        spy = shutil.which("py-spy") or str(Path(PY).parent / "py-spy")
        if not os.access(spy, os.X_OK):
            return {"error": "py-spy not found (`.venv/bin/pip install py-spy`)"}
        secs = self.args.profile_seconds
        cmd = [spy, "record", "-p", str(t.pid), "-d", str(secs), "-r", "200", "-f", "raw"]
        cmd += ["--nonblocking", "--function", "-o", str(path)]
        spy_proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=pinner(self.procs.pins.get("client")),
        )
        time.sleep(1)  # py-spy attaches
        load()
        log = spy_proc.communicate(timeout=self.left())[0].decode(errors="replace")
        if spy_proc.returncode or not path.exists():
            return {"error": f"py-spy failed ({spy_proc.returncode}): {log[-1000:]}"}
        return {"path": str(path), "log": log[-300:]}

    def llama(self, t: Target) -> dict[str, Any]:
        body = {"model": "bench-llama", "messages": PROMPT, "max_tokens": LLAMA_MAX_TOKENS}
        n = max(50, self.args.requests // 5)
        spec = {"mode": "latency", "url": t.llama_url, "body": body, "n": n}
        return self.loadgen({**spec, "warmup": min(20, n // 5)})

    def streams(self, t: Target) -> dict[str, Any]:
        body = {"model": "bench-stream", "messages": PROMPT, "stream": True}
        c, rounds, delay = self.args.streams, self.args.rounds, self.args.token_delay
        # Bounded: 10x what the streams take at the upstream, at least 30 s.
        budget = min(
            self.left() - 1, max(30.0, 10 * rounds * STREAM_TOKENS * self.args.token_delay)
        )
        with self.window(t, self.ups.stream_pid, rss=True) as w:
            if self.ups.client is not None:
                body_file = self.procs.tmp / "stream-body.json"
                body_file.write_text(json.dumps(body))
                u = urlsplit(t.stream_url)
                cmd = [str(self.ups.client), str(u.hostname), str(u.port), u.path, str(body_file)]
                cmd += [str(c), str(rounds), str(STREAM_TOKENS), f"{budget:.0f}"]
                cmd.append(str(self.args.ramp if self.args.ramp is not None else delay))
                res = dict(json.loads(self.run_client(cmd)))
                res["tool"] = "C"
            else:
                spec: dict[str, Any] = {"mode": "streams", "url": t.stream_url, "body": body}
                spec |= {"tokens": STREAM_TOKENS, "concurrency": c, "n": c * rounds}
                res = {**self.loadgen(spec), "tool": "aiohttp"}
        return {**res, "cpu": w.result}


def frame_table(frames: list[tuple[str, int, int]], samples: int) -> list[str]:
    """A profile's top frames as a Markdown table (own and total share of the samples)."""
    rows = ["| own % | total % | frame |", "|---:|---:|---|"]
    for frame, own, total in frames:
        rows.append(f"| {100 * own / samples:.1f} | {100 * total / samples:.1f} | `{frame}` |")
    return [*rows, ""]


def top_frames(raw: Path, n: int = 15) -> tuple[list[tuple[str, int, int]], int]:
    """py-spy's raw (collapsed) stacks: the `n` frames with the most own samples, each with
    its own and total (inclusive) samples; and the sample count."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        samples += k
        frames = stack.split(";")
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    return [(f, k, total[f]) for f, k in own.most_common(n)], samples


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (as bench/loadgen.py)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def merge_latency(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The latency blocks of one path as one run: percentiles over all their requests."""
    times = [x for p in parts for x in p.pop("times_ms")]
    cpu = [p["cpu"]["proxy_cpu_s"] for p in parts]
    return {
        "p50": pct(times, 50),
        "p99": pct(times, 99),
        "mean": sum(times) / len(times) if times else None,
        "requests": len(times),
        "errors": sum(p["errors"] for p in parts),
        "sent": sum(p["sent"] for p in parts),
        "blocks": [{k: p[k] for k in ("p50", "p99", "mean")} for p in parts],
        "cpu": {"proxy_cpu_s": None if None in cpu else sum(cpu)},
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median req/s (its CPU accounting with it), and every run's req/s."""
    runs = sorted(runs, key=lambda r: r["rps"])
    return {**runs[len(runs) // 2], "rps_runs": [r["rps"] for r in runs]}


def merge_streams(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several streams runs of one path: the median of each percentile across the runs,
    counts and CPU summed (so CPU per chunk is pooled), the largest RSS."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if key.startswith(("ttft_", "gap_")) and len(values) == len(runs):
            out[key] = sorted(values)[len(values) // 2]
            out[f"{key}_runs"] = values
    for key in ("streams", "errors", "events", "tokens"):
        out[key] = sum(r.get(key) or 0 for r in runs)
    out["tool"], out["runs"] = runs[0].get("tool"), len(runs)
    cpus = [r["cpu"] for r in runs]
    wall = sum(c["wall_s"] for c in cpus)
    cpu: dict[str, Any] = {"wall_s": wall}
    for key in ("proxy_cpu_s", "upstream_cpu_s", "client_cpu_s"):
        vals = [c[key] for c in cpus]
        cpu[key] = None if None in vals else sum(vals)
    rss = [c["rss_mb"] for c in cpus if c.get("rss_mb") is not None]
    cpu["rss_mb"] = max(rss) if rss else None
    for key in cpus[0]:
        if key.startswith("busy_"):
            vals = [(c[key], c["wall_s"]) for c in cpus if c.get(key) is not None]
            cpu[key] = sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else None
    out["cpu"] = cpu
    return out


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
        "| path | p50 ms | p99 ms | mean ms | added p50 ms | added p99 ms "
        "| blocks: p99 min..max ms | errors | proxy CPU µs/request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = res.get("direct", {}).get(phase)
    for n, r in rows.items():
        added = [_minus(r, base, k) for k in ("p50", "p99")]
        cpu = r.get("cpu", {}).get("proxy_cpu_s")
        per = cpu / r["sent"] * 1e6 if cpu is not None and r.get("sent") else None
        out.append(
            f"| {n} | {_f(r['p50'], 3)} | {_f(r['p99'], 3)} | {_f(r['mean'], 3)} "
            f"| {_f(added[0], 3)} | {_f(added[1], 3)} "
            f"| {_span([b['p99'] for b in r.get('blocks', ())], 2)} | {r['errors']} "
            f"| {_f(per, 0)} |"
        )
    return [*out, ""]


def _span(values: list[float] | None, digits: int = 1) -> str:
    return f"{min(values):.{digits}f}..{max(values):.{digits}f}" if values else "-"


def chunks(r: dict[str, Any]) -> int | None:
    """Events the client received in a streams run (every `data:` line)."""
    return r.get("events")


def us_per_chunk(r: dict[str, Any], key: str = "proxy_cpu_s") -> float | None:
    cpu, n = r["cpu"].get(key), chunks(r)
    return cpu / n * 1e6 if cpu is not None and n else None


def _cpu_table(res: dict[str, dict[str, Any]], sets: dict[str, set[int]]) -> list[str]:
    label = {"proxy": "proxy", "client": "load gen + upstreams", "backend": "upstreams"}
    if "backend" in sets:
        label["client"] = "load gen"
    out = [
        "### Where the CPU went (CPU seconds ÷ wall seconds of each measured load)",
        "",
        "| phase | path | wall s | proxy % | upstream % | load generator % | "
        + " | ".join(
            f"CPU {','.join(map(str, sorted(ids)))} ({label.get(s, s)}) busy %"
            for s, ids in sets.items()
        )
        + " |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(sets),
    ]
    for phase in ("throughput", "streams"):  # at c=1 one request is in flight: no queue
        for n, r in res.items():
            c = r.get(phase, {}).get("cpu")
            if not c:
                continue
            pct = [
                None if c[k] is None else 100 * c[k] / c["wall_s"]
                for k in ("proxy_cpu_s", "upstream_cpu_s", "client_cpu_s")
            ]
            busy = " | ".join(_f(c.get(f"busy_{s}"), 0) for s in sets)
            out.append(
                f"| {phase} | {n} | {_f(c['wall_s'], 1)} | {_f(pct[0], 0)} | {_f(pct[1], 0)} "
                f"| {_f(pct[2], 0)} | {busy} |"
            )
    return [*out, ""]


def report(
    res: dict[str, dict[str, Any]],
    notes: list[str],
    args: argparse.Namespace,
    sets: dict[str, set[int]] | None = None,
) -> str:
    base = res.get("direct", {})
    out = []
    out += _summary_table(res, args)
    out += _latency_table(
        f"Non-streaming chat completion, concurrency 1 ({args.requests} requests in "
        f"{args.repeats} interleaved blocks)",
        res,
        "latency",
    )
    thr = {n: r["throughput"] for n, r in res.items() if "throughput" in r}
    if thr:
        tool = next(iter(thr.values()))["tool"]
        out += [
            f"### Throughput, concurrency {args.concurrency} ({tool}: {args.repeats} interleaved "
            f"runs of {args.duration} s, each after a 1 s warm-up; the median run)",
            "",
            "| path | req/s (median) | x direct | x nginx | runs: min..max req/s | requests "
            "| errors |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        b, ng = base.get("throughput"), res.get("nginx", {}).get("throughput")
        for n, r in thr.items():
            ratio = r["rps"] / b["rps"] if b else None
            vs_nginx = r["rps"] / ng["rps"] if ng else None
            spread = r.get("rps_runs") or [r["rps"]]
            out.append(
                f"| {n} | {r['rps']:.0f} | {_f(ratio)} | {_f(vs_nginx)} "
                f"| {min(spread):.0f}..{max(spread):.0f} | {r['requests']} | {r['errors']} |"
            )
        out.append("")
    st = {n: r["streams"] for n, r in res.items() if "streams" in r}
    if st:
        out += [
            f"### Streaming: {args.streams} concurrent streams x {args.rounds} in turn per "
            f"connection x {STREAM_TOKENS} tokens, {args.token_delay * 1000:g} ms apart at the "
            f"upstream ({next(iter(st.values())).get('tool', 'aiohttp')} client; "
            f"{args.repeats} interleaved runs: percentiles are the runs' median, CPU pooled)",
            "",
            "| path | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms | inter-chunk p50 ms "
            "| inter-chunk p99 ms | added p50 ms | added p99 ms | runs: p99 min..max ms "
            "| streams | errors | chunks | CPU µs/chunk | RSS peak MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        b = base.get("streams")
        for n, r in st.items():
            d = {k: _minus(r, b, k) for k in ("ttft_p50", "gap_p50", "gap_p99")}
            out.append(
                f"| {n} | {_f(r['ttft_p50'])} | {_f(r['ttft_p99'])} | {_f(d['ttft_p50'])} "
                f"| {_f(r['gap_p50'], 3)} | {_f(r['gap_p99'], 3)} | {_f(d['gap_p50'], 3)} "
                f"| {_f(d['gap_p99'], 3)} | {_span(r.get('gap_p99_runs'))} "
                f"| {r['streams']} | {r['errors']} "
                f"| {chunks(r) if chunks(r) is not None else '-'} | {_f(us_per_chunk(r), 1)} "
                f"| {_f(r['cpu'].get('rss_mb'), 1)} |"
            )
        out.append("")
    if sets:
        out += _cpu_table(res, sets)
    out += _latency_table(
        f"Real backend: llama-server, tiny model, max_tokens {LLAMA_MAX_TOKENS}, concurrency 1",
        res,
        "llama",
    )
    prof = res.get("corrallm", {}).get("profile")
    if prof and "path" in prof:
        frames, samples = top_frames(Path(prof["path"]))
        out += [
            f"### py-spy: corrallm under wrk -c {args.concurrency}, "
            f"{args.profile_seconds} s ({samples} samples of non-idle threads, "
            f"{_f(prof.get('rps'), 0)} req/s meanwhile)",
            "",
            *frame_table(frames, samples),
        ]
    elif prof:
        notes.append(f"profile: {prof['error']}")
    prof = res.get("corrallm", {}).get("profile_streams")
    if prof and "path" in prof:
        frames, samples = top_frames(Path(prof["path"]))
        out += [
            f"### py-spy: corrallm relaying {args.streams} streams, the run's first "
            f"{args.profile_seconds} s ({samples} samples of non-idle threads)",
            "",
            *frame_table(frames, samples),
        ]
    elif prof:
        notes.append(f"streams profile: {prof['error']}")
    out += [f"- {n}" for n in notes]
    return "\n".join(out)


def _summary_table(res: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """One row per path: what SPEC §13 asks about."""
    base = res.get("direct", {})
    out = [
        "### Summary",
        "",
        f"| path | req/s c={args.concurrency} | x direct | added p50 ms c=1 | added p99 ms c=1 "
        f"| streams: added gap p50 ms | added gap p99 ms | CPU µs/chunk | RSS peak MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in res.items():
        thr, lat, st = r.get("throughput"), r.get("latency"), r.get("streams")
        bt, bl, bs = base.get("throughput"), base.get("latency"), base.get("streams")
        rps = thr["rps"] if thr else None
        ratio = rps / bt["rps"] if rps is not None and bt else None
        la = [_minus(lat, bl, k) if lat else None for k in ("p50", "p99")]
        sa = [_minus(st, bs, k) if st else None for k in ("gap_p50", "gap_p99")]
        per = us_per_chunk(st) if st else None
        rss = st["cpu"].get("rss_mb") if st else None
        out.append(
            f"| {n} | {_f(rps, 0)} | {_f(ratio)} | {_f(la[0], 3)} | {_f(la[1], 3)} "
            f"| {_f(sa[0], 3)} | {_f(sa[1], 3)} | {_f(per, 1)} | {_f(rss, 1)} |"
        )
    return [*out, ""]


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, help="requests in the concurrency-1 run (2000)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run (300 requests, 1 x 2 s of wrk, 100 streams x 1 round)",
    )
    p.add_argument("--concurrency", type=int, default=64, help="connections, throughput run")
    p.add_argument("--duration", type=int, help="seconds of the wrk throughput run (5)")
    p.add_argument(
        "--repeats",
        type=int,
        help="interleaved rounds of latency, wrk and streams per path (3); medians kept",
    )
    p.add_argument("--streams", type=int, help="concurrent streams (1000)")
    p.add_argument("--rounds", type=int, help="streams each connection runs in turn (3)")
    p.add_argument(
        "--token-delay",
        type=float,
        default=0.025,
        help="seconds between streamed tokens at the upstream (0.025: a 40 tokens/s LLM)",
    )
    p.add_argument(
        "--ramp",
        type=float,
        help="seconds over which the first streams start, evenly (default: one token delay)",
    )
    p.add_argument("--max-seconds", type=float, default=600, help="wall-clock cap of the run")
    p.add_argument(
        "--only",
        default="direct,corrallm,nginx,go-httputil,litellm,llama",
        help="paths and the llama-server row",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="corrallm serve --workers N (1), nginx with N worker processes and the Go\n"
        "proxy with GOMAXPROCS=N, all on the proxy's CPUs (give them N with --no-pin on a\n"
        "small machine); bench/workers.py compares counts and measures the owner's share",
    )
    p.add_argument(
        "--also-workers",
        type=int,
        help="also a row corrallm-xN: serve --workers N on every CPU, unpinned (beside the\n"
        "load generator), in the same run as the pinned one-process row",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="also record corrallm with py-spy (raw collapsed stacks) under wrk into this "
        "file, and during one streams run into FILE's stem + .streams.raw",
    )
    p.add_argument("--profile-seconds", type=int, default=10, help="length of the profile (10)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    q = args.quick
    args.requests = args.requests or (300 if q else 2000)
    args.duration = args.duration or (2 if q else 5)
    args.streams = args.streams or (100 if q else 1000)
    args.rounds = args.rounds or (1 if q else 3)
    args.repeats = args.repeats or (1 if q else 3)
    return args


def raise_fd_limit() -> None:
    """1,000 streams hold 2,000+ sockets in a proxy: children inherit the raised limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def run(
    args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, set[int]]]:
    pins = {} if args.no_pin else cpu_plan()
    raise_fd_limit()
    if pins:
        os.sched_setaffinity(0, pins["client"])  # this script stays off the proxy's CPU
    procs = Procs(tmp, pins)
    plan = (
        "; ".join(
            f"{role} on CPU {','.join(map(str, sorted(c)))}"
            for role, c in pins.items()
            if role != "anywhere"
        )
        if pins
        else "no CPU pinning"
    )
    notes = [
        f"{os.cpu_count()} CPUs; {plan}; Python {sys.version.split()[0]}; "
        "load generators in their own processes"
    ]
    wanted = set(args.only.split(","))
    try:
        up = start_upstreams(procs, args, notes)
        notes.append(f"upstreams: non-streaming {up.fast_kind}; streaming {up.stream_kind}")
        fast_port, stream_port = up.fast_port, up.stream_port
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
                targets.append(
                    start_corrallm(procs, fast_port, stream_port, llama_port, workers=args.workers)
                )
            except RuntimeError as exc:
                notes.append(f"corrallm row skipped: `corrallm serve` did not start: {exc}")
        if "corrallm" in wanted and args.also_workers:
            name = f"corrallm-x{args.also_workers}"
            try:  # on every CPU, beside the load generator (the 2-core measure)
                targets.append(
                    start_corrallm(
                        procs,
                        fast_port,
                        stream_port,
                        workers=args.also_workers,
                        name=name,
                        role="anywhere",
                    )
                )
                notes.append(f"{name}: serve --workers {args.also_workers}, not pinned")
            except RuntimeError as exc:
                notes.append(f"{name} row skipped: `corrallm serve` did not start: {exc}")
        nginx = find_nginx()
        if "nginx" in wanted and nginx is None:
            notes.append("nginx row skipped: nginx not found (install: `apt-get install -y nginx`)")
        elif "nginx" in wanted:
            assert nginx is not None
            try:
                targets.append(start_nginx(procs, nginx, fast_port, stream_port, args.workers))
            except RuntimeError as exc:
                notes.append(f"nginx row skipped: {exc}")
        if "go-httputil" in wanted:
            try:
                targets.append(start_go_httputil(procs, fast_port, stream_port, args.workers))
            except RuntimeError as exc:
                notes.append(f"go-httputil row SKIPPED: {exc}")
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
        bench = Bench(args, procs, time.monotonic() + args.max_seconds, up)
        for t in targets:
            if t.pid:
                res[t.name]["rss_idle_mb"] = session_usage(t.pid)[1]
        # --repeats rounds, the paths interleaved within each, so that a slow spell of the
        # machine (a VM's neighbours) falls on every path alike: per path a block of the
        # latency requests, a wrk run and a streams run. Only the path being measured runs:
        # the other proxies are stopped (SIGSTOP), so that one still busy (LiteLLM settling
        # after its start, a store flushing) takes no CPU from it.
        parts: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        runs: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        streams: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        block = -(-args.requests // args.repeats)
        try:
            for rep in range(args.repeats):
                for t in targets:
                    hold(targets, t)
                    print(f"... round {rep + 1}: {t.name}", file=sys.stderr, flush=True)
                    warmup = min(200, args.requests // 5) if rep == 0 else 20
                    parts[t.name].append(bench.latency(t, block, warmup))
                    runs[t.name].append(bench.throughput(t, wrk))
                    done = streams[t.name]
                    if not done or not done[0].get("timed_out"):  # one slow run is enough
                        done.append(bench.streams(t))
            for t in targets:
                hold(targets, t)
                if t.name == "corrallm" and args.profile and wrk:
                    print("... profile: corrallm", file=sys.stderr, flush=True)
                    res[t.name]["profile"] = bench.profile(t, wrk, args.profile)
                    print("... profile: corrallm, streams", file=sys.stderr, flush=True)
                    streams_raw = args.profile.with_name(args.profile.stem + ".streams.raw")
                    res[t.name]["profile_streams"] = bench.profile_streams(t, streams_raw)
                if t.llama_url is not None:
                    print(f"... llama: {t.name}", file=sys.stderr, flush=True)
                    res[t.name]["llama"] = bench.llama(t)
        except OutOfTime:
            notes.append(f"stopped early: --max-seconds {args.max_seconds:g} reached")
        finally:
            hold(targets, None)
            for name, p in parts.items():
                if p:
                    res[name]["latency"] = merge_latency(p)
            for name, r in runs.items():
                if r:
                    res[name]["throughput"] = median_run(r)
            for name, r in streams.items():
                if r:
                    res[name]["streams"] = merge_streams(r)
                    if r[0].get("timed_out"):
                        notes.append(
                            f"{name}: the streams run did not finish in its time budget; its "
                            "row is what was relayed by then (one run, not repeated)"
                        )
        ours, theirs = (res.get(n, {}).get("throughput") for n in ("corrallm", "litellm"))
        if ours and theirs and theirs["rps"]:
            ratio = ours["rps"] / theirs["rps"]
            notes.append(f"corrallm throughput = {ratio:.1f}x LiteLLM's (SPEC §13: at least 5x)")
        ng = res.get("nginx", {}).get("throughput")
        if ours and ng and ng["rps"]:
            share = 100 * ours["rps"] / ng["rps"]
            notes.append(
                f"corrallm throughput = {share:.0f} % of nginx's (SPEC §13: at least 25 %)"
            )
        for t in targets:
            if t.pid:
                idle = res[t.name]["rss_idle_mb"]
                peak = rss_peak_mb(t.pid)
                res[t.name]["rss_hwm_mb"] = peak
                notes.append(
                    f"{t.name} RSS (all its processes): idle {_f(idle, 1)} MB at start; "
                    f"main process VmHWM {_f(peak, 1)} MB after the run"
                )
        return res, notes, bench.cpu_sets()
    finally:
        procs.close()


def hold(targets: list[Target], active: Target | None) -> None:
    """Let `active` run and stop (SIGSTOP) every other proxy; None: resume them all."""
    for t in targets:
        if t.pid and t is not active:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(t.pid, signal.SIGSTOP if active else signal.SIGCONT)
    if active is not None and active.pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(active.pid, signal.SIGCONT)
        time.sleep(1.0)  # its timers catch up before it is measured


def rss_peak_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) / 1024 if m else None


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that kill groups

    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="corrallm-bench-") as tmp:
        try:
            res, notes, sets = run(args, Path(tmp))
        except subprocess.CalledProcessError as exc:
            print(f"a load run failed: {exc}\n{exc.stderr}", file=sys.stderr)
            return 1
    print(report(res, notes, args, sets))
    if args.json:
        print(json.dumps({"results": res, "notes": notes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
