"""Process groups: spawn with captured output, signal the whole group, wait for it to be gone.

Every backend runs in its own session (`start_new_session`), so its process group id is
its pid and SIGTERM/SIGKILL reach the children it forks too (llama-server workers,
shell wrappers). Only groups we spawned, or adopted after verifying their identity, are
ever signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil


def program_argv(cmd: str) -> list[str]:
    """Split `cmd` like a shell (no shell runs it); `corrallm` means this very installation."""
    argv = shlex.split(cmd)
    if argv and argv[0] == "corrallm":
        argv = [sys.executable, "-m", "corrallm", *argv[1:]]
    return argv


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies we have not reaped; those are gone for our purposes.
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class Spawned:
    """A running process group we own (spawned now, or adopted from a PID record)."""

    pid: int
    pgid: int
    started: float  # psutil create_time, the identity check against PID reuse
    exited: asyncio.Task[int]  # finishes with the exit code once the process is gone


async def spawn(
    argv: list[str],
    env: Mapping[str, str],
    cwd: str | None,
    on_line: Callable[[str], None],
) -> Spawned:
    """Start `argv` in a new session; `on_line` receives each line of stdout+stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **env},
        cwd=cwd,
        start_new_session=True,
    )

    async def pump() -> int:
        assert proc.stdout is not None
        while True:
            try:
                raw = await proc.stdout.readline()
            except ValueError:  # a line longer than the stream limit: take it in pieces
                raw = await proc.stdout.read(65536)
            if not raw:
                break
            on_line(raw.decode("utf-8", "replace"))
        return await proc.wait()

    exited = asyncio.create_task(pump(), name=f"pump-{proc.pid}")
    started = create_time(proc.pid) or 0.0
    return Spawned(proc.pid, proc.pid, started, exited)


async def run(
    argv: list[str],
    env: Mapping[str, str],
    cwd: str | None,
    on_line: Callable[[str], None],
    within: float,
) -> int | None:
    """Run a short command (a starter or a stopper) to completion; None if it overran.

    Its output goes through a file, not a pipe: a starter such as `docker start` may leave
    a daemon behind, and a pipe would not reach end-of-file while that daemon lives.
    """
    with tempfile.TemporaryFile() as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **env},
            cwd=cwd,
            start_new_session=True,
        )
        try:
            code: int | None = await asyncio.wait_for(proc.wait(), within)
        except TimeoutError:
            signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
            code = None
        out.seek(0)
        for line in out.read().decode("utf-8", "replace").splitlines():
            on_line(line)
    return code


def adopt(pid: int, started: float) -> Spawned:
    """Watch a process spawned by an earlier run of corrallm (its exit code is unknown: -1)."""

    async def watch() -> int:
        while create_time(pid) == started:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            await asyncio.sleep(0.5)
        return -1

    return Spawned(pid, os.getpgid(pid), started, asyncio.create_task(watch()))


async def stop_group(pgid: int, exited: asyncio.Future[int], grace: float) -> str:
    """SIGTERM the group, wait up to `grace` for it to be gone, then SIGKILL.

    Returns how it ended ("terminated" or "killed") once no process of the group is left.
    """
    signal_group(pgid, signal.SIGTERM)
    if await _wait_gone(pgid, exited, grace):
        return "terminated"
    signal_group(pgid, signal.SIGKILL)
    await _wait_gone(pgid, exited, 10.0)
    return "killed"


async def _wait_gone(pgid: int, exited: asyncio.Future[int], within: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    await asyncio.wait({exited}, timeout=within)
    while loop.time() < deadline:
        if not group_alive(pgid):
            return True
        await asyncio.sleep(0.05)
    return not group_alive(pgid)
