"""One supervisor per backend process: the sole owner of its state machine (SPEC §4).

Callers never read the state and act on it; they ask: `ensure_ready()` (spawn if needed,
coalescing concurrent cold requests into one start), `enter()`/`leave()` around each
forwarded request, `load()`, `unload()`, `stop()`, `pause()`, `retire()`. Everything it
asks of the world goes through seams injected at construction, as in honcho's Manager:
the process manager (`processes`: spawn, run a start/stop command, adopt, liveness, stop
a group), the health `probe`, the `clock` and `sleep`, the memory pools (`room`) and the
transition `bus`. tests/unit/test_supervisor.py drives it with scripted fakes of them all.

Its own tasks: the start under way (`_start_task`), the watch of a ready process (`_watcher`:
its exit, and a liveness probe every `health.interval`, SPEC §17 M4), the revival of a
persistent backend that failed (`_reviver`) and the log follower. A deliberate stop,
unload, pause or retire cancels the watch and the revival; a failure being handled is
never cancelled half way (the watcher detaches itself first), so no hung group is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from corrallm.config.schema import ProcessSpec
from corrallm.lifecycle import sleep as sleeping
from corrallm.lifecycle import slots, supervision
from corrallm.lifecycle.addresses import (
    origin,
)
from corrallm.lifecycle.description import Description, Kind
from corrallm.lifecycle.errors import (
    BackendFailed,
    BackendPaused,
    BackendRetired,
    LifecycleBusy,
    LifecycleError,
)
from corrallm.lifecycle.liveness import (
    HUNG_GRACE,
    PROBE_BOUND,
    FailureReason,
    Misses,
    bounded,
)
from corrallm.lifecycle.logs import LogBuffer
from corrallm.lifecycle.pidrecords import PidRecord, PidRecords, file_name
from corrallm.lifecycle.process import Processes, ProcessGroups, Spawned
from corrallm.lifecycle.starting import (
    Placement,
    Starting,
    _first,
)
from corrallm.lifecycle.state import BUSY, COMING, State, check_transition
from corrallm.lifecycle.transitions import Transitions

Probe = Callable[[str], Awaitable[int | None]]
Call = sleeping.Call


Room = Callable[["Supervisor"], Awaitable[Placement]]
Sleep = Callable[[float], Coroutine[Any, Any, None]]
# Who asked for a start, charged for its load energy: (key name, group, model).
Cause = tuple[str | None, str, str]

LOG_TAIL_LINES = 15
SLEEP_TIMEOUT = 60.0  # W1: a sleep call that takes longer has failed (the process is stopped)
# W2: saving or restoring slot caches never holds a stop or a start up for longer.
SLOT_BUDGET = 30.0


@dataclass
class Backoff:
    """Failed starts back off before the next try: base, doubling, capped."""

    base: float = 1.0
    cap: float = 30.0

    def delay(self, failures: int) -> float:
        return min(self.cap, self.base * 2.0 ** max(0, failures - 1))


@dataclass
class Supervisor(Starting):
    kind: ClassVar[Kind] = "process"

    id: str
    spec: ProcessSpec
    probe: Probe
    home: Path
    health_timeout: float = 120.0
    backoff: Backoff = field(default_factory=Backoff)
    clock: Callable[[], float] = time.monotonic
    # Where every transition, idle moment and log line is published; the gateway's one bus.
    bus: Transitions[Supervisor] = field(default_factory=Transitions)
    # Called before each spawn to make room in the memory pools; raises a LifecycleError
    # (NoRoom) when it cannot, which every caller waiting on that start receives.
    room: Room | None = None
    # The process manager: every spawn, start/stop command, adoption and group signal.
    processes: Processes = field(default_factory=ProcessGroups)
    # Every wait on time (the health polls); `clock` is every read of it.
    sleep: Sleep = asyncio.sleep
    # Any other request to the backend's own API: sleep and wake (W1), slot caches (W2).
    call: Call | None = None

    state: State = State.STOPPED
    in_flight: int = 0
    last_used: float = 0.0
    last_error: str | None = None
    last_load_seconds: float | None = None
    last_wake_seconds: float | None = None
    retired: bool = False  # removed or replaced by a config reload: never started again
    keep_alive: bool = False  # persistent (R3): restarted, with back-off, after it fails (M4)
    started_for: Cause | None = None
    # Consecutive failures (starts, and deaths after ready); reset only once a start has
    # stayed healthy for a probe interval, so the back-off grows for one that keeps dying.
    failures: int = 0
    failure_reason: FailureReason | None = None  # of the latest failure
    retry_at: float = 0.0
    port: int | None = None
    base_url: str = ""
    proc: Spawned | None = None
    placement: Placement = field(default_factory=Placement)  # of the latest start

    def __post_init__(self) -> None:
        assert self.spec.proxy is not None, "validated config"
        self.logs = LogBuffer(self.home / "logs" / f"{file_name(self.id)}.log")
        self.logs.listeners.append(lambda line: self.bus.line(self.id, line))
        self.records = PidRecords(self.home)
        self._changed = asyncio.Event()
        self._start_task: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._reviver: asyncio.Task[None] | None = None
        self._dying: asyncio.Task[None] | None = None  # a failure being handled (M4)
        self._follower: asyncio.Task[None] | None = None
        self._pause_wanted = False
        self._keep_record = False
        self._strategy: supervision.Strategy | None = None
        # A config reload's replacement never starts before its predecessor is gone (L4).
        self._predecessor: asyncio.Future[None] | None = None

    # -- what callers ask ------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def ensure_ready(self, cause: Cause | None = None) -> None:
        """Return once the backend is ready, starting it if needed (L1, L2, L3)."""
        while self.state is not State.READY:
            if self.retired:
                raise BackendRetired(f"backend '{self.id}' was removed or replaced by a reload")
            if self.state is State.PAUSED or self._pause_wanted:
                raise BackendPaused(f"backend '{self.id}' is paused")
            if self.state is State.FAILED and self.clock() < self.retry_at:
                raise BackendFailed(self._failure_message())
            if self.state in (State.STOPPED, State.FAILED, State.ASLEEP):
                # Move before yielding, so concurrent cold callers coalesce (L2, W1).
                self.started_for = cause
                if self.state is State.ASLEEP:
                    self._move(State.WAKING)
                    work = self._wake()
                else:
                    self._move(State.STARTING)
                    work = self._start()
                self._start_task = asyncio.create_task(work, name=f"{self.state}-{self.id}")
                self._start_task.add_done_callback(_retrieve)
            task = self._start_task
            if self.state in COMING and task is not None and not task.done():
                await asyncio.wait({task})
                error = None if task.cancelled() else task.exception()
                if isinstance(error, LifecycleError) and not self.retired:
                    raise error
            else:
                await self._next_change()

    def available(self) -> bool:
        """Worth routing to: not paused and not backing off after a failed start (F1)."""
        if self.state is State.FAILED:
            return self.clock() >= self.retry_at
        return self.state is not State.PAUSED

    def enter(self) -> bool:
        """Count a request in flight; False if the backend is not ready to take one."""
        if self.state is not State.READY:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        self.last_used = self.clock()
        if self.in_flight == 0:
            if self.state is State.DRAINING:
                self._notify()
            self.bus.idle(self)

    def describe(self) -> Description:
        return Description(
            self.kind,
            self.state,
            self.base_url,
            pid=self.pid,
            last_error=self.last_error,
            load_seconds=self.last_load_seconds,
            sleeps=self.spec.sleep is not None,
            retired=self.retired,
            logs=self.logs,
        )

    async def load(self) -> None:
        """An explicit load: refused while another lifecycle action runs (L4)."""
        if self.state in BUSY:
            raise LifecycleBusy(f"backend '{self.id}' is {self.state}; try again when it settles")
        await self.ensure_ready()

    async def unload(self, force: bool = False) -> None:
        """Drain in-flight requests (unless forced), then stop the process group. A
        persistent backend's revival (M4) ends with it: unloaded is what was asked for."""
        while True:
            if self.state in (State.STOPPED, State.FAILED, State.PAUSED):
                await self._calm()
                return
            if self.state in COMING and not force:
                raise LifecycleBusy(f"backend '{self.id}' is {self.state}; unload it once ready")
            if self.state in (State.DRAINING, State.STOPPING):
                await self._next_change()
                continue
            if self.state in COMING:
                await self._cancel_start()
                continue
            if self.state is State.ASLEEP:
                await self._stop_process()
                return
            self._move(State.DRAINING)
            while self.in_flight > 0 and not force and self._still(State.DRAINING):
                await self._next_change()
            if self._still(State.DRAINING):
                await self._stop_process()
                return
            # It failed while draining (M4): the loop waits out its teardown.

    async def fall_asleep(self) -> bool:
        """Put a ready backend to sleep instead of stopping it (W1): drain it (no new request
        is let in), then its sleep call. True once ASLEEP; a sleep call that fails stops the
        process instead (it is not known to hold less), and a backend that is not ready, or
        has no `sleep`, is left as it is (False)."""
        spec = self.spec.sleep
        if spec is None or self.call is None or self.state is not State.READY:
            return False
        await self._cancel(self._watcher)
        self._move(State.DRAINING)
        while self.in_flight > 0 and self._still(State.DRAINING):
            await self._next_change()
        if not self._still(State.DRAINING):
            return False  # it failed meanwhile (M4)
        began = self.clock()
        problem = await sleeping.fall_asleep(self.call, origin(self.base_url), spec, SLEEP_TIMEOUT)
        if not self._still(State.DRAINING):
            return False
        if problem is not None:
            self.logs.note(f"sleep failed: {problem}; stopping it instead")
            await self._stop_process()
            return False
        self.logs.note(f"asleep (sleep took {self.clock() - began:.2f}s)")
        self._move(State.ASLEEP)
        self.records.write(self._record())
        self._start_watch(self.proc)  # its exit is still noticed; it is not probed
        return True

    async def stop(self) -> None:
        """Shutdown: stop whatever runs now, without draining (L5)."""
        while True:
            await self._calm()
            await self._cancel_start()
            if self.state in (State.READY, State.DRAINING, State.ASLEEP):
                await self._stop_process()
            elif self.state is State.STOPPING:  # a failure being handled (M4) ends first
                await self._next_change()
            else:
                break
        await self._calm()
        self._stop_following()
        self.logs.close()

    async def pause(self) -> None:
        """Drain and stop, then stay PAUSED: no request or load starts it (P1)."""
        self._pause_wanted = True
        await self._cancel(self._reviver)
        if self.state in COMING:
            await self._cancel_start()
        await self.unload()
        # unload() returned without yielding after STOPPED: nobody restarted it in between.
        if self._pause_wanted and self.state in (State.STOPPED, State.FAILED):
            self._move(State.PAUSED)

    def unpause(self) -> None:
        """Back in service; a pause still tearing the process down stops short of PAUSED."""
        self._pause_wanted = False
        if self.state is State.PAUSED:
            self._move(State.STOPPED)

    async def retire(self) -> None:
        """A config reload removed or replaced this backend: never start it again, drain
        and stop what runs (a start under way is cut short), close its log."""
        self.retired = True
        self._notify()
        try:
            await self.unload(force=self.state in COMING)
        except LifecycleError as exc:
            self.logs.note(f"retiring: {exc}")
        await self._calm()
        self._stop_following()
        self.logs.close()

    def follows(self, predecessor: asyncio.Future[None]) -> None:
        """Start only once `predecessor` (the retirement of the process this one replaces)
        is over: ports and unit names would race (L4)."""
        self._predecessor = predecessor

    async def adopt(self, record: PidRecord) -> bool:
        """After a crash of corrallm: take over a recorded process only if it is healthy (L5).

        Its output still goes to its log file, which is followed again from the file's end."""
        if not self.processes.alive(record.pid, record.started):
            self.records.remove(self.id)
            return False
        proc = self.processes.adopt(record.pid, record.started)
        healthy = record.cmd == self.spec.cmd and await self._healthy(record.health_url)
        if not healthy:
            await self.processes.stop_group(record.pgid, proc.exited, self.spec.stop_grace)
            self.records.remove(self.id)
            return False
        self.port, self.base_url = record.port, record.base_url
        self.logs.open()
        self.logs.note(f"re-adopted pid {record.pid} after a restart of corrallm")
        self._own(proc)
        self._move(State.STARTING)
        if record.asleep and not await self._still_asleep():
            self.logs.note("it was asleep, and corrallm cannot wake it: stopping it")
            self._move(State.READY)
            await self._stop_process()
            return False
        self._move(State.ASLEEP if record.asleep else State.READY)
        self.last_used = self.clock()
        self._start_watch(proc)
        return True

    async def _still_asleep(self) -> bool:
        """A re-adopted process recorded asleep (W1) can be woken: it has a `sleep` config
        and (vLLM) says it is still sleeping."""
        spec = self.spec.sleep
        if spec is None or self.call is None:
            return False
        if isinstance(spec, sleeping.VllmSleep):
            return await sleeping.is_sleeping(self.call, origin(self.base_url)) is True
        return True

    # -- the machinery ---------------------------------------------------------------

    async def _wake(self) -> None:
        """ASLEEP -> WAKING -> READY (W1): room for its whole footprint first (its GPU is the
        one it sleeps on), then the wake call and a healthy answer. A wake that fails stops
        the process (-> STOPPED), and the callers' ensure_ready() then starts it anew."""
        spec = self.spec.sleep
        assert spec is not None and self.call is not None, "only a sleeper wakes"
        try:
            if self.room is not None:
                try:
                    await self.room(self)
                except LifecycleError:
                    self._move(State.ASLEEP)
                    if self._watcher is None or self._watcher.done():
                        self._start_watch(self.proc)
                    raise
            await self._cancel(self._watcher)
            began = self.clock()
            cap, _ = self._start_cap()
            problem = await sleeping.wake(self.call, origin(self.base_url), spec, cap)
            if problem is None and not await self._healthy(
                origin(self.base_url) + self.spec.health.path
            ):
                problem = "its health check did not answer after the wake"
            if problem is not None:
                self.logs.note(f"wake failed: {problem}; restarting it")
                await self._stop_process()
                return
            self.last_wake_seconds = self.clock() - began
            self.last_used = self.clock()
            self.logs.note(f"awake in {self.last_wake_seconds:.2f}s")
            self._move(State.READY)
            self.records.write(self._record())
            self._start_watch(self.proc)
        except asyncio.CancelledError:
            await self._stop_process()
            raise

    def _start_watch(self, proc: Spawned | None) -> None:
        self._watcher = asyncio.create_task(self._watch(proc), name=f"watch-{self.id}")

    def _live(self, proc: Spawned | None) -> bool:
        """Still the ready (draining, asleep) process this watch is about."""
        return self.proc is proc and self.state in (State.READY, State.DRAINING, State.ASLEEP)

    async def _watch(self, proc: Spawned | None) -> None:
        """While ready or draining (M4): notice the process exiting on its own, and probe its
        health every health.interval (polls are not activity: last_used is left alone).
        `health.failures` failed probes in a row, or an exit, mark it failed."""
        health = self.spec.health
        url = origin(self.base_url) + health.path
        bound = min(health.interval, PROBE_BOUND)
        misses = Misses(health.failures)
        next_probe = self.clock() + health.interval
        exited = proc.exited if proc is not None else None
        while True:
            wait = max(0.0, next_probe - self.clock())
            if exited is None:
                await self.sleep(wait)
            elif not exited.done():
                await _first(exited, self.sleep(wait))
            if not self._live(proc):
                return
            if exited is not None and exited.done():
                reason = f"exited unexpectedly with code {exited.result()}"
                return await self._die(proc, "exited", reason, self.spec.stop_grace)
            next_probe = self.clock() + health.interval  # probes start an interval apart
            if self.state is State.ASLEEP:
                continue  # a sleeper need not answer; only its exit is watched (W1)
            answer = await bounded(self.probe, url, bound, self.sleep, exited)
            if not self._live(proc) or (exited is not None and exited.done()):
                continue  # gone while asked: the exit is handled above
            if misses.observe(answer, answer in health.expect_status):
                reason = f"unresponsive: {misses.describe(bound)}"
                return await self._die(proc, "unresponsive", reason, HUNG_GRACE)
            if misses.count == 0:
                self.failures = 0  # healthy for a probe interval after its start

    async def _die(
        self, proc: Spawned | None, kind: FailureReason, reason: str, grace: float
    ) -> None:
        """A ready backend failed (M4): stop what is left of it, then FAILED. In-flight
        requests lose their upstream connection when the group goes, and end with a 502 or
        an error event. A persistent backend is revived after the start back-off; another
        may be started again by the next request at once."""
        self._watcher, self._dying = None, asyncio.current_task()  # never cancelled half way
        self.failure_reason, self.last_error = kind, reason
        self.logs.note(f"failed: {reason}")
        self._move(State.STOPPING)
        await self._run_stop(None)
        if proc is not None:
            self.logs.note(f"stopped ({await self._end_group(proc, grace)})")
            self._forget_process()
        self.failures += 1
        delay = self.backoff.delay(self.failures) if self.keep_alive else 0.0
        self.retry_at = self.clock() + delay
        self._dying = None
        self._move(State.FAILED)
        reviving = self._reviver is not None and not self._reviver.done()
        if self._may_revive() and not reviving:
            self.logs.note(f"persistent: restarting it in {delay:g}s")
            self._reviver = asyncio.create_task(self._revive(), name=f"revive-{self.id}")
            self._reviver.add_done_callback(_retrieve)

    def _may_revive(self) -> bool:
        return self.keep_alive and not self.retired and not self._pause_wanted

    async def _revive(self) -> None:
        """Restart a persistent backend that failed, with the start back-off, until it is
        ready again (a failed restart backs off further)."""
        while self._may_revive() and self.state is not State.READY:
            wait = self.retry_at - self.clock() if self.state is State.FAILED else 0.0
            if wait > 0:
                await self.sleep(wait)
                continue
            try:
                await self.ensure_ready()
            except LifecycleError:
                if self.state is not State.FAILED:  # e.g. no room: wait before asking again
                    await self.sleep(self.backoff.delay(max(1, self.failures)))
        if self._reviver is asyncio.current_task():
            self._reviver = None

    async def _calm(self) -> None:
        """Cancel the watch and the revival (a deliberate stop, unload, pause or retire)."""
        await self._cancel(self._watcher)
        await self._cancel(self._reviver)

    async def _cancel(self, task: asyncio.Task[None] | None) -> None:
        if task is None or task is asyncio.current_task():
            return
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._watcher is task:
            self._watcher = None
        if self._reviver is task:
            self._reviver = None

    async def _stop_process(self) -> None:
        await self._calm()
        if self.spec.slot_save and self.state in (State.READY, State.DRAINING):
            await self._save_slots()
        self._move(State.STOPPING)
        await self._run_stop(None)
        if self.proc is not None:  # what a stop command left of our own group goes too
            how = await self._end_group(self.proc)
            self.logs.note(f"stopped ({how})")
            self._forget_process()
        self._move(State.STOPPED)

    async def _save_slots(self) -> None:
        """W2: every slot's cache to --slot-save-path before the process goes; bounded, and
        a failure is only logged (the stop goes ahead)."""
        if self.call is None:
            return
        report = await slots.save_slots(
            self.call, origin(self.base_url), self.id, SLOT_BUDGET, self.clock
        )
        self.logs.note(report.describe("saved"))

    async def _restore_slots(self, cmd: str) -> None:
        """W2: the caches saved at the last stop, before any request is let in; bounded."""
        directory = slots.slot_save_dir(cmd)
        if self.call is None or directory is None:
            return
        where = Path(self.spec.cwd or ".") / directory
        report = await slots.restore_slots(
            self.call, origin(self.base_url), self.id, str(where), SLOT_BUDGET, self.clock
        )
        self.logs.note(report.describe("restored"))

    async def _run_stop(self, why: str | None) -> None:
        """The strategy's stop command (command, docker, systemd), if it has one."""
        plan = self._strategy
        if plan is None or plan.stop is None:
            return
        if why:
            self.logs.note(why)
        self.logs.note(f"stopping: {' '.join(plan.stop)}")
        try:
            code = await self.processes.run(
                plan.stop, {}, self.spec.cwd, self.logs.append, self.spec.stop_grace + 15
            )
        except OSError as exc:
            self.logs.note(f"stop command failed to run: {exc}")
            return
        if code != 0:
            self.logs.note(f"stop command ended with {code}")

    async def _reap(self, proc: Spawned, note: str | None) -> None:
        """Make sure nothing of the group is left before the state moves on (L4)."""
        if note:
            self.logs.note(note)
        await self._end_group(proc)
        self._forget_process()

    async def _end_group(self, proc: Spawned, grace: float | None = None) -> str:
        """SIGTERM, stopGrace (or less), SIGKILL. A group that outlives SIGKILL keeps its PID
        record, so that a later run of corrallm still knows it is ours."""
        grace = self.spec.stop_grace if grace is None else min(grace, self.spec.stop_grace)
        how = await self.processes.stop_group(proc.pgid, proc.exited, grace)
        if how == "killed" and self.processes.group_alive(proc.pgid):
            self._keep_record = True
            self.logs.note(f"process group {proc.pgid} outlived SIGKILL")
        return how

    async def _cancel_start(self) -> None:
        task = self._start_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def _output(self) -> Path:
        """Where an owned process writes its stdout and stderr: its log file, which outlives
        corrallm (a pipe would break when corrallm dies, and SIGPIPE the backend)."""
        assert self.logs.path is not None
        return self.logs.path

    def _own(self, proc: Spawned) -> None:
        """`proc` is ours from now on: follow what it writes to its log until it is gone."""
        self.proc, self._keep_record = proc, False
        if self._follower is None:
            self._follower = asyncio.create_task(self.logs.follow(), name=f"follow-{self.id}")

    def _forget_process(self) -> None:
        self.proc = None
        if not self._keep_record:
            self.records.remove(self.id)
        self._stop_following()

    def _stop_following(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            self._follower = None
        self.logs.catch_up()  # its last words, before a failure quotes them

    def _fail(self, reason: str, kind: FailureReason) -> None:
        self.failures += 1
        delay = self.backoff.delay(self.failures)
        self.retry_at = self.clock() + delay
        self.failure_reason, self.last_error = kind, reason
        self.logs.note(f"failed to start: {reason}; next try in {delay:g}s")
        self._move(State.FAILED)

    def _failure_message(self) -> str:
        wait = max(0.0, self.retry_at - self.clock())
        tail = "\n".join(self.logs.tail(LOG_TAIL_LINES))
        what = "failed" if self.failure_reason in ("exited", "unresponsive") else "failed to start"
        return (
            f"backend '{self.id}' {what}: {self.last_error}. "
            f"corrallm retries in {wait:.1f}s. Last lines of its log:\n{tail}"
        )

    def _record(self) -> PidRecord:
        assert self.proc is not None and self.spec.cmd is not None
        return PidRecord(
            backend=self.id,
            pid=self.proc.pid,
            pgid=self.proc.pgid,
            started=self.proc.started,
            port=self.port,
            base_url=self.base_url,
            health_url=origin(self.base_url) + self.spec.health.path,
            cmd=self.spec.cmd,
            asleep=self.state is State.ASLEEP,
        )

    def _move(self, new: State) -> None:
        old = self.state
        check_transition(old, new)
        self.state = new
        self._notify()
        self.bus.moved(self, old, new)

    def _still(self, state: State) -> bool:
        """The state is still `state` (after awaits mypy cannot see through)."""
        return self.state is state

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _next_change(self) -> None:
        await self._changed.wait()


def _retrieve(task: asyncio.Task[None]) -> None:
    """A start nobody waits on any more must not warn that its error was never retrieved."""
    if not task.cancelled():
        task.exception()
