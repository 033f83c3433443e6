"""vLLM's sleep mode on the fake backend (--sleep-mode): POST /sleep?level=N, POST /wake_up
(optional `tags`), GET /is_sleeping, as vLLM's OpenAI server exposes them.

As in vLLM's executor, a sleep puts both tags (`weights`, `kv_cache`) to sleep; a wake with
`tags` wakes only those, and the engine is awake once no tag sleeps; a sleep while asleep
or a wake while awake is logged and answered 200 without doing anything. The held memory
(--hold-mb) stands in for the weights: it shrinks to --asleep-mb on sleep and is allocated
again when `weights` wakes. Inference is refused (503) from the moment a sleep starts until
the wake is complete; /health keeps answering 200.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson

from corrallm.fake_backend.exchange import JSON, FakeExchange, Route
from corrallm.fake_backend.memory import HeldMemory
from corrallm.fake_backend.options import Options
from corrallm.fake_backend.responses import error_body

TAGS = ("weights", "kv_cache")
LEVELS = (1, 2)
SLEEPING_BODY = orjson.dumps(
    {
        "error": {
            "message": "model is sleeping; POST /wake_up first",
            "type": "unavailable",
            "param": None,
            "code": 503,
        }
    }
)
_EMPTY = b"text/plain; charset=utf-8"  # vLLM answers these calls 200 with an empty body


class SleepMode:
    """The sleep state of one fake backend and its three routes (none without --sleep-mode)."""

    def __init__(self, opts: Options, log: Callable[[str], None], memory: HeldMemory) -> None:
        self.opts = opts
        self.log = log
        self.memory = memory
        self.sleeping_tags: set[str] = set()
        self.level: int | None = None  # the level of the current sleep; None when awake
        self.counts = {"sleeps": 0, "wakes": 0, "wake_failures": 0}
        self._lock = asyncio.Lock()  # one transition at a time, like vLLM's engine core

    @property
    def asleep(self) -> bool:
        return bool(self.sleeping_tags)

    def routes(self) -> dict[str, Route]:
        if not self.opts.sleep_mode:
            return {}  # like vLLM without the dev endpoints: 404
        return {
            "/sleep": ("POST", self.sleep),
            "/wake_up": ("POST", self.wake_up),
            "/is_sleeping": ("GET", self.is_sleeping),
        }

    def load(self) -> None:
        """The model finished loading: hold its memory (--hold-mb), or less if put to sleep
        already."""
        self.memory.resize(self._asleep_mib() if self.asleep else self.opts.hold_mb)

    def stats(self) -> dict[str, Any]:
        return {
            "sleeping": self.asleep,
            "sleep_level": self.level,
            **self.counts,
            "held_mb": self.memory.mib,
        }

    def _asleep_mib(self) -> int:
        return min(self.opts.asleep_mb, self.opts.hold_mb)

    # --- routes ------------------------------------------------------------------------------

    async def sleep(self, ex: FakeExchange, faulty: bool = False) -> None:
        query = ex.query()
        raw = query.get("level", ["1"])[-1]
        level = int(raw) if raw.strip().isdigit() else None
        if level not in LEVELS:
            msg = f"level must be 1 or 2, got {raw!r}"
            await ex.respond(400, error_body(msg, "invalid_request_error", 400))
            return
        mode = query.get("mode", ["abort"])[-1]
        self.log(f"INFO api_server: sleep the engine with level {level} (mode {mode})")
        async with self._lock:
            if self.asleep:
                self.log("WARNING executor: Executor is already sleeping.")
            else:
                began = time.monotonic()
                self.sleeping_tags = set(TAGS)  # inference is refused from now on
                self.level = level
                await asyncio.sleep(self.opts.sleep_seconds)
                before = self.memory.mib
                self.memory.resize(self._asleep_mib())
                self.counts["sleeps"] += 1
                self.log(
                    f"INFO gpu_worker: It took {time.monotonic() - began:.6f} seconds to fall "
                    f"asleep. Sleep mode freed {before - self.memory.mib} MiB memory, "
                    f"{self.memory.mib} MiB memory is still in use."
                )
        await ex.respond(200, b"", _EMPTY)

    async def wake_up(self, ex: FakeExchange, faulty: bool = False) -> None:
        tags = ex.query().get("tags") or None  # None: every tag, as in vLLM
        self.log(f"INFO api_server: wake up the engine with tags: {tags}")
        async with self._lock:
            status, body = await self._wake(tags)
        await ex.respond(status, body, _EMPTY if status == 200 else JSON)

    async def _wake(self, tags: list[str] | None) -> tuple[int, bytes]:
        if not self.asleep:
            self.log("WARNING executor: Executor is not sleeping.")
            return 200, b""
        unknown = sorted(set(tags or ()) - self.sleeping_tags)
        if unknown:
            sleeping = sorted(self.sleeping_tags)
            self.log(f"WARNING executor: Tag {unknown[0]} is not in sleeping tags {sleeping}")
            return 200, b""
        began = time.monotonic()
        await asyncio.sleep(self.opts.wake_seconds)
        if self.opts.wake_fails:
            self.counts["wake_failures"] += 1
            msg = "failed to wake up the engine (--wake-fails); it is still sleeping"
            self.log(f"ERROR api_server: {msg}")
            return 500, error_body(msg, "server_error", 500)
        waking = set(tags) if tags else set(self.sleeping_tags)
        if "weights" in waking:
            self.memory.resize(self.opts.hold_mb)
        self.sleeping_tags -= waking
        if not self.sleeping_tags:
            self.level = None
            self.counts["wakes"] += 1
        self.log(
            f"INFO gpu_worker: It took {time.monotonic() - began:.6f} seconds to wake up tags "
            f"{sorted(waking)}."
        )
        return 200, b""

    async def is_sleeping(self, ex: FakeExchange, faulty: bool = False) -> None:
        await ex.respond(200, orjson.dumps({"is_sleeping": self.asleep}))
