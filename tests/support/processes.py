"""Real processes on loopback for the integration and e2e tests: corrallm and fake backends.

Every process runs in its own session and its group is killed in a finalizer, so a failing
test leaves nothing behind. Waiting is always on a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import psutil
import yaml

T = TypeVar("T")


def _own_ports() -> Iterator[int]:
    """The ports this test worker hands out, in turn: a block of 1,000 per xdist worker,
    below the kernel's ephemeral range. bind(0), which corrallm uses for `${PORT}`, and
    every outgoing connection draw from that range, and each worker from its own block, so
    no port a test picks can be bound meanwhile by a backend another test's corrallm starts
    or by another worker's server (the race once routed a soak request to another test)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    # CORRALLM_TEST_PORT_BASE: where this run's blocks start, so that two runs of the suite
    # at once on one machine (two checkouts) do not share blocks either.
    first = int(os.environ.get("CORRALLM_TEST_PORT_BASE", "20000")) + 1000 * worker
    if first + 1000 > low:  # no room below a widened ephemeral range: the kernel picks
        return
    while True:
        yield from range(first, first + 1000)


_PORTS = _own_ports()


def free_port() -> int:
    for _ in range(1000):
        port = next(_PORTS, 0)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # held, or in TIME_WAIT from an earlier test
            return int(sock.getsockname()[1])
    raise AssertionError("no free port left in this worker's block")


def wait_for(
    condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}: {last!r}")


def fake_cmd(*flags: str) -> str:
    """A backend `cmd` running the package's fake backend on the port corrallm picks."""
    return " ".join(["corrallm fake-backend --port ${PORT}", *flags])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return _has_live_member(pgid)


def _has_live_member(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def process_gone(pid: int) -> bool:
    """Exited (or a zombie nobody reaped yet). One lookup: a process that ends between a
    `pid_exists` and a `Process()` would otherwise raise NoSuchProcess."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class GatewayClient:
    """A running gateway as the tests reach it: its address, home folder and log, and
    helpers over HTTP. `Gateway` is one run as a `corrallm serve` process;
    `tests/support/inprocess.py` serves one from a thread of the test process."""

    url: str
    home: Path
    log_path: Path
    backend_groups: set[int] = field(default_factory=set)
    config_path: Path | None = field(default=None, kw_only=True)  # the file it was given

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def token(self) -> str:
        return (self.home / "admin.token").read_text().strip()

    def api(
        self, method: str, path: str, json: object = None, timeout: float = 60
    ) -> httpx.Response:
        """Call the management API with the admin token."""
        return httpx.request(
            method,
            f"{self.url}/api/v1/{path}",
            json=json,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout,
        )

    def upstream(
        self, method: str, path: str, timeout: float = 60, **kwargs: object
    ) -> httpx.Response:
        """`/upstream/<path>` (a backend's own API) as an operator: with the admin token
        (SPEC §22 T5)."""
        return httpx.request(
            method,
            f"{self.url}/upstream/{path}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=timeout,
            **kwargs,  # type: ignore[arg-type]
        )

    def overview_backend(self, backend: str) -> dict[str, object]:
        for model in self.api("GET", "overview").json()["models"]:
            for b in model["backends"]:
                if b["id"] == backend:
                    return b
        raise AssertionError(f"no backend {backend} in the overview")

    def state(self, backend: str) -> str:
        return str(self.overview_backend(backend)["state"])

    def records(self) -> dict[str, dict[str, object]]:
        import json

        folder = self.home / "run"
        if not folder.is_dir():
            return {}
        out = {}
        for path in folder.glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                data = json.loads(path.read_text())
                out[data["backend"]] = data
                self.backend_groups.add(int(data["pgid"]))
        return out

    def pid_of(self, backend: str, timeout: float = 10.0) -> int:
        record = wait_for(lambda: self.records().get(backend), timeout, what=f"{backend} pid")
        return int(record["pid"])  # type: ignore[call-overload]


@dataclass
class Gateway(GatewayClient):
    """A running `corrallm serve` process."""

    proc: subprocess.Popen[bytes] = field(kw_only=True)

    def signal(self, sig: int) -> None:
        self.records()
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 20.0) -> int:
        return self.proc.wait(timeout)


def _peered(config_text: str) -> bool:
    """A config with peers, which `serve --workers` refuses (not served yet)."""
    try:
        loaded = yaml.safe_load(config_text)
    except yaml.YAMLError:
        return False
    return isinstance(loaded, dict) and bool(loaded.get("peers"))


def start_gateway(
    config_text: str,
    tmp: Path,
    *,
    home: Path | None = None,
    health_timeout: str = "20s",
    env: dict[str, str] | None = None,
    wait: bool = True,
    port: int | None = None,
) -> Gateway:
    """`port`: listen there (a node restarted where its peers look for it), else a free one."""
    config = tmp / f"corrallm-{time.monotonic_ns()}.yaml"
    config.write_text(config_text)
    home = home or tmp / "home"
    port = port or free_port()
    log_path = tmp / f"corrallm-{port}.log"
    full_env = {
        **os.environ,
        "ADDR": f"127.0.0.1:{port}",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    if _peered(config_text) and "CORRALLM_WORKERS" not in (env or {}):
        # Under CORRALLM_WORKERS=2 (the workers tiers) a gateway with peers stays one
        # process, every node a test starts (tests/integration/test_peers.py starts its
        # own): `serve --workers` refuses peers. A test that set the count keeps it.
        full_env["CORRALLM_WORKERS"] = "1"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "corrallm",
                "serve",
                "--config",
                str(config),
                "--home",
                str(home),
                "--health-timeout",
                health_timeout,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    gateway = Gateway(f"http://127.0.0.1:{port}", home, log_path, proc=proc, config_path=config)
    if wait:
        wait_healthy(gateway)
    return gateway


def wait_healthy(gateway: Gateway, timeout: float = 20.0) -> None:
    def up() -> bool:
        if gateway.proc.poll() is not None:
            raise AssertionError(
                f"corrallm exited with {gateway.proc.returncode}:\n{gateway.log()}"
            )
        try:
            return httpx.get(gateway.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout, what="corrallm /health")


def cleanup(gateway: Gateway) -> None:
    """Kill corrallm and every backend group it recorded, whatever state the test left."""
    gateway.records()
    if gateway.proc.poll() is None:
        kill_group(gateway.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            gateway.proc.wait(10)
    for pgid in gateway.backend_groups:
        kill_group(pgid)


@contextlib.contextmanager
def running_gateway(config_text: str, tmp: Path, **kwargs: object) -> Iterator[Gateway]:
    gateway = start_gateway(config_text, tmp, **kwargs)  # type: ignore[arg-type]
    try:
        yield gateway
    finally:
        cleanup(gateway)


@dataclass
class FakeBackend:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_fake_backend(tmp: Path, *flags: str) -> FakeBackend:
    port = free_port()
    log = (tmp / f"fake-{port}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "corrallm", "fake-backend", "--port", str(port), *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    backend = FakeBackend(proc, port)

    def healthy() -> bool:
        try:
            return httpx.get(backend.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 20, what="fake backend health")
    return backend


@contextlib.contextmanager
def running_fake_backend(tmp: Path, *flags: str) -> Iterator[FakeBackend]:
    """A fake backend for the `with` block, its process group killed after it."""
    backend = start_fake_backend(tmp, *flags)
    try:
        yield backend
    finally:
        kill_group(backend.proc.pid)
        backend.proc.wait(10)
