"""Scripted fakes for the supervisor's seams, like honcho's tests: a virtual clock, a
health probe, a process manager, and the World that writes every transition, process call
and test mark to one history. No process is started and no wait lasts beyond event-loop
turns."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from pathlib import Path

from corrallm.config.schema import BackendConfig as Backend
from corrallm.lifecycle.process import Spawned
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.lifecycle.transitions import Transitions

CMD = "llama-server --port ${PORT}"


class Clock:
    """Virtual time: `sleep` moves it on at once and yields one event-loop turn."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class Probe:
    """The health check: answers `status` (None: connection refused), or the next of
    `script` while there is one; with `hang`, never answers."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.script: list[int | None] = []
        self.hang = False
        self.asked = 0

    async def __call__(self, url: str) -> int | None:
        self.asked += 1
        if self.hang:
            await asyncio.get_running_loop().create_future()  # until cancelled
        await asyncio.sleep(0)
        return self.script.pop(0) if self.script else self.status


class FakeProcesses:
    """A scripted process manager: processes live until the test ends them or a group is
    stopped; what they print goes to the output file the supervisor names."""

    def __init__(self, history: list[str]) -> None:
        self.history = history
        self.running: dict[int, Spawned] = {}
        self.exit_at_once: int | None = None  # every spawn exits at once with this code
        self.graces: list[float] = []  # what each stop_group was given
        self.output: Path | None = None
        self.port_holders: list[str | None] = []  # who holds the port, at each health answer
        self.ports: list[int] = []  # the port each holder check was about
        self._pids = itertools.count(101)

    async def spawn(
        self, argv: list[str], env: Mapping[str, str], cwd: str | None, output: Path
    ) -> Spawned:
        pid = next(self._pids)
        proc = Spawned(pid, pid, float(pid), asyncio.get_running_loop().create_future())
        self.history.append(f"spawn {pid}")
        self.running[pid] = proc
        self.output = output
        if self.exit_at_once is not None:
            self.exit(pid, self.exit_at_once, "error: failed to load model 'm.gguf'")
        return proc

    async def run(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str | None,
        on_line: Callable[[str], None],
        within: float,
    ) -> int | None:
        self.history.append("run " + " ".join(argv))
        return 0

    def adopt(self, pid: int, started: float) -> Spawned:
        self.history.append(f"adopt {pid}")
        proc = Spawned(pid, pid, started, asyncio.get_running_loop().create_future())
        self.running[pid] = proc
        return proc

    def alive(self, pid: int, started: float) -> bool:
        return pid in self.running or pid == 4242

    def group_alive(self, pgid: int) -> bool:
        return pgid in self.running

    async def stop_group(self, pgid: int, exited: asyncio.Future[int], grace: float) -> str:
        self.history.append(f"stop_group {pgid}")
        self.graces.append(grace)
        self.running.pop(pgid, None)
        if not exited.done():
            exited.set_result(-15)
        await asyncio.sleep(0)
        return "terminated"

    async def port_holder(self, port: int, ours: Spawned) -> str | None:
        self.ports.append(port)
        return self.port_holders.pop(0) if self.port_holders else None

    def print(self, *lines: str) -> None:
        assert self.output is not None
        with self.output.open("a") as out:
            out.writelines(line + "\n" for line in lines)

    def exit(self, pid: int, code: int, *last_words: str) -> None:
        self.print(*last_words)
        self.running.pop(pid).exited.set_result(code)


class World:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.history: list[str] = []
        self.clock = Clock()
        self.probe = Probe()
        self.processes = FakeProcesses(self.history)
        self.bus = Transitions()
        self.bus.subscribe(moved=self._moved)
        self.ready_at = 0.0  # when it last became ready
        self.after_ready: Callable[[], None] = lambda: None  # what the test does then
        self.back_offs: list[float] = []  # the wait before the next start, at each failure
        self.made: list[Supervisor] = []

    def supervisor(self, health_timeout: float = 120.0, **spec: object) -> Supervisor:
        sup = Supervisor(
            f"m#{len(self.made)}",
            Backend(**{"cmd": CMD, "proxy": "5800", **spec}),
            self.probe,
            self.home,
            health_timeout,
            clock=self.clock,
            bus=self.bus,
            processes=self.processes,
            sleep=self.clock.sleep,
        )
        self.made.append(sup)
        return sup

    def mark(self, what: str) -> None:
        self.history.append(what)

    def _moved(self, sup: Supervisor, old: State, new: State) -> None:
        self.history.append(f"{old}->{new}")
        if new is State.READY:
            self.ready_at = self.clock()
            self.after_ready()
        if new is State.FAILED:
            self.back_offs.append(sup.retry_at - self.clock())


async def until(condition: Callable[[], object], turns: int = 1000) -> None:
    """Let the event loop run until `condition` holds (a deadline counted in turns)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached within {turns} event-loop turns: {condition}")


async def failure(awaitable: asyncio.Future[None]) -> str:
    """The type and message a caller waiting on `awaitable` was given."""
    try:
        await awaitable
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
