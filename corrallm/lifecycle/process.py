"""Process groups: spawn with output to a file, signal the whole group, wait for it to be gone.

Every backend runs in its own session (`start_new_session`), so its process group id is
its pid and SIGTERM/SIGKILL reach the children it forks too (llama-server workers,
shell wrappers). Only groups we spawned, or adopted after verifying their identity, are
ever signalled.

A backend's stdout and stderr go to its log file (opened for append), never to a pipe: a
pipe's reader is this corrallm process, and after a crash of corrallm a backend that is
later re-adopted would die of SIGPIPE on its next line of output. The supervisor follows
the file instead (`LogBuffer.follow`).

`Processes` is the seam the supervisor drives (as honcho's Manager drives its process
class): `ProcessGroups` is the real one, tests script fakes of it.
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
from pathlib import Path
from typing import Protocol

import psutil

from corrallm.store.home import open_private


def program_argv(cmd: str) -> list[str]:
    """Split `cmd` like a shell (no shell runs it); `corrallm` means this very installation."""
    argv = shlex.split(cmd)
    if argv and argv[0] == "corrallm":
        argv = [sys.executable, "-m", "corrallm", *argv[1:]]
    return argv


def naming(exc: OSError, argv: list[str]) -> OSError:
    """`exc` naming the program it could not run (uvloop's spawn errors name nothing: a bare
    `[Errno 2] No such file or directory`)."""
    if exc.filename is not None or exc.errno is None or not argv:
        return exc
    return type(exc)(exc.errno, exc.strerror, argv[0])


def exec_failure(exc: OSError) -> str:
    """Why a command could not be run, in words that name its program."""
    if isinstance(exc, FileNotFoundError) and exc.filename is not None:
        return (
            f"program '{exc.filename}' not found (not on PATH, or no such file, or its "
            "cwd does not exist); install it or give its full path in cmd"
        )
    if isinstance(exc, PermissionError) and exc.filename is not None:
        return f"program '{exc.filename}' cannot be run: {exc.strerror} (is it executable?)"
    return str(exc)


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
    exited: asyncio.Future[int]  # finishes with the exit code once the process is gone


class Processes(Protocol):
    """What the supervisor asks of the operating system; every call about processes goes
    through here, so a supervisor can be driven by a scripted fake."""

    async def spawn(
        self, argv: list[str], env: Mapping[str, str], cwd: str | None, output: Path
    ) -> Spawned:
        """Start a long-running process in a new session, its output appended to `output`."""
        ...

    async def run(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str | None,
        on_line: Callable[[str], None],
        within: float,
    ) -> int | None:
        """Run a starter or stopper to completion: its exit code, None if it overran."""
        ...

    def adopt(self, pid: int, started: float) -> Spawned:
        """Watch a process an earlier run of corrallm spawned (exit code unknown: -1)."""
        ...

    def alive(self, pid: int, started: float) -> bool:
        """The process `pid` runs and is the very one created at `started` (no reused pid)."""
        ...

    def group_alive(self, pgid: int) -> bool:
        """Some process of the group is left (zombies aside)."""
        ...

    async def stop_group(self, pgid: int, exited: asyncio.Future[int], grace: float) -> str:
        """SIGTERM, `grace`, SIGKILL; returns "terminated" or "killed" once it is gone."""
        ...

    async def port_holder(self, port: int, ours: Spawned) -> str | None:
        """Who else listens on loopback `port` ("pid N (its command)"); None when the
        listener is `ours` or cannot be seen."""
        ...


class ProcessGroups:
    """The real `Processes`: process groups of this machine."""

    async def spawn(
        self, argv: list[str], env: Mapping[str, str], cwd: str | None, output: Path
    ) -> Spawned:
        return await spawn(argv, env, cwd, output)

    async def run(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str | None,
        on_line: Callable[[str], None],
        within: float,
    ) -> int | None:
        return await run(argv, env, cwd, on_line, within)

    def adopt(self, pid: int, started: float) -> Spawned:
        return adopt(pid, started)

    def alive(self, pid: int, started: float) -> bool:
        return create_time(pid) == started

    def group_alive(self, pgid: int) -> bool:
        return group_alive(pgid)

    async def stop_group(self, pgid: int, exited: asyncio.Future[int], grace: float) -> str:
        return await stop_group(pgid, exited, grace)

    async def port_holder(self, port: int, ours: Spawned) -> str | None:
        # It may read /proc of every process (4 ms on a quiet box): off the event loop.
        return await asyncio.to_thread(port_holder, port, ours)


async def spawn(argv: list[str], env: Mapping[str, str], cwd: str | None, output: Path) -> Spawned:
    """Start `argv` in a new session, its stdout and stderr appended to the file `output`."""
    fd = open_private(output, os.O_WRONLY | os.O_APPEND)  # T5: 0600, in a 0700 folder
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            env={**os.environ, **env},
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        raise naming(exc, argv) from None
    finally:
        os.close(fd)  # the child has its own copies
    exited = asyncio.create_task(proc.wait(), name=f"wait-{proc.pid}")
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
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise naming(exc, argv) from None
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


# The addresses a listener answers loopback requests on.
_LOOPBACK_OR_ANY = ("0.0.0.0", "::", "::1", "::ffff:127.0.0.1")


def port_holder(port: int, ours: Spawned) -> str | None:
    """The process, not of `ours` (its group or a descendant), that listens on TCP `port`
    where a loopback request reaches it: `"pid N (its command)"`, or None.

    None also when no listener can be seen: another user's process (docker-proxy, as root)
    or another network namespace's is not ours to judge, so only a listener known to be a
    stranger counts. A backend that daemonizes out of its group counts as a stranger; it
    escapes the group signals too, and wants `supervision: command`, `docker` or `systemd`.
    """
    if _listens(ours.pid, port):
        return None  # the usual answer, from the backend's own sockets alone
    seen: list[int] = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port:
            continue
        ip = conn.laddr.ip
        if conn.pid is None or not (ip.startswith("127.") or ip in _LOOPBACK_OR_ANY):
            continue
        if _is_ours(conn.pid, ours):
            return None
        seen.append(conn.pid)
    return _describe(seen[0]) if seen else None


def listener_of(port: int) -> str | None:
    """Whoever listens on TCP `port` (any address), as `"pid N (its command)"`; None when
    no listener can be seen (another user's process, another network namespace)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    for conn in connections:
        listening = conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
        if listening and conn.pid is not None:
            return _describe(conn.pid)
    return None


def _listens(pid: int, port: int) -> bool:
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


def _is_ours(pid: int, ours: Spawned) -> bool:
    try:
        if os.getpgid(pid) == ours.pgid:
            return True
        return any(parent.pid == ours.pid for parent in psutil.Process(pid).parents())
    except (OSError, psutil.Error):
        return False  # gone since the listing: not a listener of ours either


def _describe(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        command = " ".join(process.cmdline()) or "?"
        # `serve --workers`: the gateway's address is its relaying workers' to listen on.
        worker = process.ppid() == os.getpid() and "corrallm.workers.worker" in command
    except psutil.Error:
        command, worker = "?", False
    if pid == os.getpid() or worker:
        return f"corrallm itself (pid {os.getpid()})"
    return f"pid {pid} ({command[:160]})"
