"""A backend's start attempt (SPEC §4 L1, §17 M5): room in the pools, the spawn (a port
picked for `${PORT}` picked again when another program took it first), the health gate
(an exit, a stall or the start cap fail it), then READY with its watch, or FAILED with
the reason. `Supervisor` (supervisor.py) runs it as part of itself: this is the part of
the supervisor that starts a process, kept apart from the part that keeps one running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corrallm.config.schema import GPU_PLACEHOLDER, PORT_PLACEHOLDER, ProcessSpec
from corrallm.lifecycle import supervision
from corrallm.lifecycle.addresses import free_port, is_loopback, origin, port_of, resolve_url
from corrallm.lifecycle.errors import LifecycleError
from corrallm.lifecycle.liveness import FailureReason, StallWatch
from corrallm.lifecycle.logs import LogBuffer
from corrallm.lifecycle.pidrecords import PidRecord, PidRecords
from corrallm.lifecycle.process import Processes, Spawned, exec_failure
from corrallm.lifecycle.state import State

# A port picked for ${PORT} can be bound by another program before the backend binds it.
PORT_TRIES = 3
HEALTH_POLL_SECONDS = 0.05  # L1: within 250 ms; §13: first byte within 100 ms of healthy


@dataclass(frozen=True)
class Placement:
    """Where the memory planner put a start: the GPU it runs on (its index, as text), which
    becomes `${GPU}` in its cmd and env and its CUDA_VISIBLE_DEVICES (SPEC §17 M3)."""

    gpu: str | None = None


class Starting:
    """The start attempt of a `Supervisor`, which it is a part of."""

    if TYPE_CHECKING:  # what it reads and calls of the rest of its supervisor
        id: str
        spec: ProcessSpec
        probe: Callable[[str], Awaitable[int | None]]
        health_timeout: float
        clock: Callable[[], float]
        sleep: Callable[[float], Coroutine[Any, Any, None]]
        room: Callable[[Any], Awaitable[Placement]] | None
        processes: Processes
        logs: LogBuffer
        records: PidRecords
        port: int | None
        base_url: str
        proc: Spawned | None
        placement: Placement
        last_error: str | None
        last_load_seconds: float | None
        last_used: float
        _predecessor: asyncio.Future[None] | None
        _strategy: supervision.Strategy | None

        def _move(self, new: State) -> None: ...
        def _fail(self, reason: str, kind: FailureReason) -> None: ...
        def _own(self, proc: Spawned) -> None: ...
        def _record(self) -> PidRecord: ...
        @property
        def _output(self) -> Path: ...
        def _start_watch(self, proc: Spawned | None) -> None: ...
        async def _reap(self, proc: Spawned, note: str | None) -> None: ...
        async def _run_stop(self, why: str | None) -> None: ...
        async def _restore_slots(self, cmd: str) -> None: ...

    async def _start(self) -> None:
        try:
            if self._predecessor is not None:
                await asyncio.shield(self._predecessor)
            placement = Placement()
            if self.room is not None:
                try:
                    placement = await self.room(self)
                except LifecycleError:
                    self._move(State.STOPPED)
                    raise
            self.placement = placement
            await self._spawn_and_wait(placement)
        except asyncio.CancelledError:
            self._move(State.STOPPING)
            if self.proc is not None:
                await self._reap(self.proc, "start cancelled")
            else:
                await self._run_stop("start cancelled")
            self._move(State.STOPPED)
            raise

    async def _spawn_and_wait(self, placement: Placement) -> None:
        """Spawn it and wait for a healthy answer from it (L1). A port picked for
        `${PORT}` that another program bound first is picked again, PORT_TRIES times."""
        began = self.clock()
        for attempt in range(1, PORT_TRIES + 1):
            retry = await self._spawn_once(placement, began, attempt == PORT_TRIES)
            if not retry:
                return

    async def _spawn_once(self, placement: Placement, began: float, last: bool) -> bool:
        """One spawn and wait on a freshly picked port; True to try again on another."""
        assert self.spec.proxy is not None
        proxy = self.spec.proxy
        picked = PORT_PLACEHOLDER in proxy
        self.port = free_port() if picked else port_of(proxy)
        self.base_url = resolve_url(proxy, self.port)
        values = {PORT_PLACEHOLDER: str(self.port)}
        env: dict[str, str] = {}
        if placement.gpu is not None:
            values[GPU_PLACEHOLDER] = placement.gpu
            env["CUDA_VISIBLE_DEVICES"] = placement.gpu
        cmd = _substitute(self.spec.cmd, values) if self.spec.cmd else None
        env.update({k: _substitute(v, values) for k, v in self.spec.env.items()})
        plan = self._strategy = supervision.strategy(self.spec, cmd)
        self.logs.open()
        self.logs.note(f"starting: {plan.describe()} (supervision: {self.spec.supervision})")
        proc: Spawned | None = None
        try:
            if plan.start is not None:
                code = await self.processes.run(
                    plan.start, env, self.spec.cwd, self.logs.append, self._start_cap()[0]
                )
                if code != 0:
                    what = "did not finish" if code is None else f"exited with code {code}"
                    reason = f"its start command `{plan.describe()}` {what}"
                    self._fail(reason, "start_exited")
                    return False
            if plan.serve is not None:
                proc = await self.processes.spawn(plan.serve, env, self.spec.cwd, self._output)
        except OSError as exc:
            self._fail(f"could not run its command: {exec_failure(exc)}", "start_exited")
            return False
        if proc is not None:
            self._own(proc)
            self.logs.note(f"spawned pid {proc.pid}")
            self.records.write(self._record())
        outcome = await self._await_health(proc)
        if proc is not None and outcome in ("healthy", "exited"):
            holder = await self._port_holder(proc)
            if holder is not None:
                return await self._port_taken(proc, holder, outcome, picked, last)
        if outcome == "healthy":
            self.logs.catch_up()  # what it printed while loading (n_ctx, n_slots) is parsed now
            if self.spec.slot_save and cmd is not None:
                await self._restore_slots(cmd)
            self.last_load_seconds = self.clock() - began
            self.last_error = None  # `failures` is reset by the watch, once it stays healthy
            self.last_used = self.clock()
            self.logs.note(f"ready in {self.last_load_seconds:.2f}s at {self.base_url}")
            self._move(State.READY)
            self._start_watch(proc)
            return False
        kind: FailureReason = "start_timeout"
        if outcome == "exited" and proc is not None:
            kind, reason = "start_exited", f"exited with code {proc.exited.result()} while starting"
        elif outcome == "stalled":
            kind = "stalled"
            reason = (
                "stalled: no output and no change in its health answer for "
                f"{self.spec.health.stall_timeout:g}s (health.stallTimeout)"
            )
        else:
            cap, flag = self._start_cap()
            reason = f"did not become healthy within {cap:g}s ({flag})"
        if proc is not None:
            await self._reap(proc, reason)
        else:
            await self._run_stop(reason)
        self._fail(reason, kind)
        return False

    async def _port_holder(self, proc: Spawned) -> str | None:
        """Another program listening on the loopback port this backend was to bind: a
        health answer from it is not this backend's (and requests would go to it)."""
        if self.port is None or not is_loopback(self.base_url):
            return None
        return await self.processes.port_holder(self.port, proc)

    async def _port_taken(
        self, proc: Spawned, holder: str, outcome: str, picked: bool, last: bool
    ) -> bool:
        reason = f"port {self.port} is held by {holder}, not by this backend"
        if outcome == "healthy":
            reason += " (it answered the health check in the backend's place)"
        await self._reap(proc, reason)
        if picked and not last:
            self.logs.note(
                "it took the port between corrallm picking it and the backend binding it; "
                "starting again on another port"
            )
            return True
        advice = (
            f"{PORT_TRIES} ports picked in a row were taken before the backend bound them"
            if picked
            else "stop that program, or give this backend another port in `proxy`"
        )
        self._fail(f"{reason}: {advice}", "port_taken")
        return False

    def _start_cap(self) -> tuple[float, str]:
        """The hard cap on a start (M5): health.startTimeout, else --health-timeout."""
        if self.spec.health.start_timeout is not None:
            return self.spec.health.start_timeout, "health.startTimeout"
        return self.health_timeout, "--health-timeout"

    async def _await_health(self, proc: Spawned | None) -> str:
        """Poll health until it answers; an owned process exiting first is a failure, and so
        is one that stalls (M5): no new output and the same health answer for stallTimeout.
        A process we do not own (docker, systemd) shows us no output: only the cap holds."""
        health = self.spec.health
        url = origin(self.base_url) + health.path
        now = self.clock()
        deadline = now + self._start_cap()[0]
        stall = StallWatch(health.stall_timeout, now)
        while True:
            if proc is not None and proc.exited.done():
                return "exited"
            answer = await self.probe(url)
            if answer in health.expect_status:
                return "healthy"
            now = self.clock()
            if proc is not None:
                self.logs.catch_up()
                if stall.observe(now, answer, self.logs.received):
                    return "stalled"
            remaining = deadline - now
            if remaining <= 0:
                return "timeout"
            wait = min(HEALTH_POLL_SECONDS, remaining)
            if proc is not None:
                await _first(proc.exited, self.sleep(wait))
            else:
                await self.sleep(wait)

    async def _healthy(self, url: str) -> bool:
        return await self.probe(url) in self.spec.health.expect_status


async def _first(exited: asyncio.Future[int], pause: Coroutine[Any, Any, None]) -> None:
    """Wait out `pause`, or less if the process exits meanwhile."""
    sleeper = asyncio.ensure_future(pause)
    either: set[asyncio.Future[Any]] = {exited, sleeper}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()


def _substitute(text: str, values: dict[str, str]) -> str:
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text
