"""Prompt caches that survive eviction (SPEC §18 W2): save a llama-server's slot KV caches
before it is stopped and restore them after its next start.

llama-server started with `--slot-save-path DIR` answers `GET /slots` (one object per
slot, with its `id`; a slot that never ran a task has no `id_task`), and
`POST /slots/{id}?action=save|restore` with `{"filename": NAME}` (a bare name inside DIR),
answering `n_saved` / `n_restored` tokens. Everything here goes through an injected `call`
and a clock, never raises on HTTP or file errors, and ends in a `SlotReport` for the
caller to log.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

Call = Callable[[str, str, Any, float], Awaitable[tuple[int | None, bytes]]]
"""(method, url, json body or None, timeout seconds) -> (status, or None if nothing
answered in time; the body)."""

FLAG = "--slot-save-path"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def slot_save_dir(cmd: str) -> str | None:
    """The DIR of `--slot-save-path DIR` in a backend's cmd (split like a shell's), or None.
    `--slot-save-path=DIR` is read too, as the config check accepts it, though llama-server
    itself refuses that form (and refuses to start when DIR is not a directory)."""
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return None
    found: str | None = None
    for i, arg in enumerate(argv):  # the last one wins, as in llama-server's parser
        if arg == FLAG and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(FLAG + "="):
            found = arg[len(FLAG) + 1 :]
    return found or None


def slot_file(backend_id: str, slot: int) -> str:
    """The file that holds this backend's slot cache: a bare name of [A-Za-z0-9._-] with no
    `..` (what llama-server accepts); a short hash of the id keeps `a#0` and `a_0` apart."""
    readable = _UNSAFE.sub("_", backend_id)[:64]
    digest = hashlib.sha256(backend_id.encode()).hexdigest()[:8]
    return f"corrallm-{readable}-{digest}-slot{slot}.bin"


@dataclass(frozen=True)
class SlotReport:
    done: tuple[int, ...]  # slot ids saved (or restored)
    failed: tuple[str, ...]  # one line each: "slot 1: 500 <error message>"
    tokens: int  # sum of n_saved (or n_restored)
    seconds: float

    def describe(self, verb: str) -> str:
        """One log line: "saved 2 slot caches (812 tokens) in 0.03s; slot 3: 500 ..."."""
        plural = "" if len(self.done) == 1 else "s"
        line = f"{verb} {len(self.done)} slot cache{plural} ({self.tokens} tokens)"
        line += f" in {self.seconds:.2f}s"
        return "; ".join((line, *self.failed))


def _answer(status: int | None, body: bytes) -> str:
    """`status` and the error message of llama-server's body (or its first bytes)."""
    if status is None:
        return "no answer"
    text = body.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            text = error["message"]
        elif isinstance(error, str):
            text = error
    return f"{status} {text[:200]}".rstrip()


def _count(body: bytes, key: str) -> int | None:
    """The integer `key` of a JSON object body, or None."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    value = parsed.get(key) if isinstance(parsed, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Run:
    """One save or restore pass: the budget's deadline and what has happened so far."""

    def __init__(self, call: Call, base_url: str, budget: float, clock: Callable[[], float]):
        self.call = call
        self.base = base_url.rstrip("/")
        self.budget = budget
        self.clock = clock
        self.start = clock()
        self.done: list[int] = []
        self.failed: list[str] = []
        self.tokens = 0

    def left(self) -> float:
        return self.start + self.budget - self.clock()

    def report(self) -> SlotReport:
        seconds = max(0.0, self.clock() - self.start)
        return SlotReport(tuple(self.done), tuple(self.failed), self.tokens, seconds)

    async def slots(self) -> list[dict[str, Any]] | None:
        """GET /slots: the slot objects that carry an integer id, or None (reported)."""
        left = self.left()
        if left <= 0:
            self.failed.append(f"GET /slots: not asked, the {self.budget:g}s budget was spent")
            return None
        status, body = await self.call("GET", self.base + "/slots", None, left)
        if status != 200:
            self.failed.append(f"GET /slots: {_answer(status, body)}")
            return None
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, list):
            self.failed.append(f"GET /slots: 200 but not a list: {body[:120]!r}")
            return None
        return [
            s
            for s in parsed
            if isinstance(s, dict) and isinstance(s.get("id"), int) and s["id"] >= 0
        ]

    async def act(self, action: str, slot: int, filename: str, counted: str) -> None:
        """POST /slots/{slot}?action=...; the outcome goes into done/failed/tokens."""
        left = self.left()
        if left <= 0:
            self.failed.append(f"slot {slot}: not {action}d, the {self.budget:g}s budget was spent")
            return
        url = f"{self.base}/slots/{slot}?action={action}"
        status, body = await self.call("POST", url, {"filename": filename}, left)
        n = _count(body, counted) if status == 200 else None
        if n is None:
            self.failed.append(f"slot {slot}: {_answer(status, body)}")
            return
        self.done.append(slot)
        self.tokens += n


def _never_used(slot: dict[str, Any]) -> bool:
    """llama-server lists a slot that never ran a task without `id_task` (older builds: -1)."""
    task = slot.get("id_task")
    return not isinstance(task, int) or task < 0


async def save_slots(
    call: Call,
    base_url: str,
    backend_id: str,
    budget: float,
    clock: Callable[[], float] = time.monotonic,
) -> SlotReport:
    """Save every slot that has run a task to `slot_file(backend_id, id)`, within `budget`
    seconds in all; slots left when the budget is spent are reported failed."""
    run = _Run(call, base_url, budget, clock)
    slots = await run.slots()
    for slot in slots or ():
        if not _never_used(slot):
            await run.act("save", slot["id"], slot_file(backend_id, slot["id"]), "n_saved")
    return run.report()


async def restore_slots(
    call: Call,
    base_url: str,
    backend_id: str,
    directory: str,
    budget: float,
    clock: Callable[[], float] = time.monotonic,
) -> SlotReport:
    """Restore each slot whose `slot_file(backend_id, id)` exists in `directory` (the
    server's --slot-save-path, resolved by the caller), within `budget` seconds in all."""
    run = _Run(call, base_url, budget, clock)
    slots = await run.slots()
    if slots:
        files = await asyncio.to_thread(_files, directory)
        for slot in slots:
            name = slot_file(backend_id, slot["id"])
            if name in files:
                await run.act("restore", slot["id"], name, "n_restored")
    return run.report()


def _files(directory: str) -> frozenset[str]:
    """The plain files in `directory` (none if it cannot be read)."""
    try:
        with os.scandir(directory) as entries:
            return frozenset(e.name for e in entries if e.is_file())
    except OSError:
        return frozenset()
