"""The owner's relaying workers (`serve --workers N`): started, kept running, stopped.

Each worker is `python -m corrallm.workers.worker <hop> <index>` in the owner's process
group (a signal to the group reaches them all; the tests' cleanup kills the group). One
that exits while the gateway runs is started again (its requests were let go by the
owner when its hop ended), at once the first time, then backing off while it keeps
failing within seconds. Stopping sends SIGTERM (each worker drains its open streams, up
to the graceful bound), then SIGKILL to any still there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time

log = logging.getLogger("corrallm.workers")

STABLE_SECONDS = 10.0  # a worker that ran this long before it exited is restarted at once
MAX_BACKOFF = 5.0


class Pool:
    def __init__(self, count: int, hop_path: str) -> None:
        self.count = count
        self.hop_path = hop_path
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for index in range(self.count):
            task = asyncio.create_task(self._keep(index))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _keep(self, index: int) -> None:
        backoff = 0.0
        while not self.stopping:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "corrallm.workers.worker", self.hop_path, str(index)
            )
            self.procs[index] = proc
            began = time.monotonic()
            code = await proc.wait()
            if self.stopping:
                return
            quick = time.monotonic() - began < STABLE_SECONDS
            backoff = min(MAX_BACKOFF, max(0.2, backoff * 2)) if quick else 0.0
            log.warning(
                "worker %d (pid %d) exited with %s; starting it again%s",
                index,
                proc.pid,
                code,
                f" in {backoff:g}s" if backoff else "",
            )
            await asyncio.sleep(backoff)

    async def stop(self, grace: float) -> None:
        """SIGTERM to every worker, then SIGKILL to those still there after `grace` s."""
        self.stopping = True
        procs = [p for p in self.procs.values() if p.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(p.wait()) for p in procs]
        if waits:
            _, late = await asyncio.wait(waits, timeout=grace)
            for proc in procs:
                if proc.returncode is None:
                    log.warning("worker pid %d did not drain in %gs: killed", proc.pid, grace)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            if late:
                await asyncio.wait(late, timeout=5)
        for task in list(self._tasks):
            task.cancel()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.returncode is None]
