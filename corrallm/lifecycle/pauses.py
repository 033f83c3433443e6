"""Pauses (SPEC §10 P1, §8 F3): an operator's decision to keep a model or an extension out
of service, optionally until a time, kept in the store so it survives a restart.

A paused model's own processes are drained, stopped and held PAUSED: no request, fall-
through, explicit load or boot preload starts them. Pausing an extension pauses its one
process and so every model it hosts. Unpausing a pinned model loads it again, waiting out
the teardown of the process the pause stopped.

Durable first: a pause or an unpause is written to the store before anything changes in
memory or any process is touched, so a write the store refuses (a full disk) raises
`StoreUnavailable` and changes nothing. An expired pause is lifted even when the store
cannot forget it: the stored row's `until` has passed, so a restart ignores it too.

Gateways sharing a store (SPEC §19 X5) enforce each other's pauses: each follows the
table (`follow`: LISTEN/NOTIFY on PostgreSQL), re-reads it on every change and applies the
difference (`sync`) to its own processes, as a pause or unpause made here would. A lock
keeps a re-read from racing a pause or unpause made here (read-then-apply is atomic
against write-then-apply); the processes are stopped and restarted outside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from corrallm.lifecycle.errors import LifecycleError
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.store import pauses as table
from corrallm.store.db import Store, StoreUnavailable

log = logging.getLogger("corrallm.lifecycle")

Kind = Literal["model", "extension"]


@dataclass
class Pausable:
    """A model or an extension: the processes a pause stops, and whether it is pinned."""

    kind: Kind
    name: str
    supervisors: Sequence[Supervisor]
    pinned: bool = False


@dataclass
class Pauses:
    store: Store
    targets: dict[tuple[Kind, str], Pausable]
    wall_clock: Callable[[], float] = time.time
    until: dict[tuple[Kind, str], float | None] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def paused(self, kind: Kind, name: str) -> bool:
        key = (kind, name)
        if key not in self.until:
            return False
        until = self.until[key]
        return until is None or until > self.wall_clock()

    def remaining(self, kind: Kind, name: str) -> float | None:
        """Seconds until a pause with an `until` ends (F3: its 503's Retry-After); None
        when it has no `until` or there is no pause in force."""
        until = self.until.get((kind, name))
        if until is None:
            return None
        left = until - self.wall_clock()
        return left if left > 0 else None

    async def restore(self) -> None:
        """At boot: apply the pauses kept in the store; forget the ones that have expired
        (and, on an embedded store, the ones of models and extensions no longer configured:
        a shared store's may be another gateway's)."""
        now = self.wall_clock()
        for kind, name, until in await table.read(self.store):
            key: tuple[Kind, str] = (_kind(kind), name)
            expired = until is not None and until <= now
            if expired or (key not in self.targets and not self.store.dialect.shared):
                await self._forget(key, lenient=True)
                continue
            if key not in self.targets:
                continue
            self.until[key] = until
            await asyncio.gather(*(sup.pause() for sup in self.targets[key].supervisors))

    async def follow(self) -> None:
        """X5: enforce the pauses and unpauses other gateways sharing the store write, for
        as long as the gateway runs (re-reading on each change, and on each reconnection:
        nothing missed while the connection was down stays missed). Returns at once on an
        embedded store, which nobody else writes."""
        async with contextlib.aclosing(table.follow(self.store)) as changes:
            async for _ in changes:
                while True:
                    try:
                        await self.sync()
                        break
                    except StoreUnavailable as exc:
                        log.warning("pauses: re-reading the shared store failed: %s", exc)
                        await asyncio.sleep(1.0)

    async def sync(self) -> None:
        """Apply the stored pauses to this gateway's processes: pause what another gateway
        paused, unpause what it unpaused (nothing is written: it already is)."""
        async with self._lock:
            now = self.wall_clock()
            stored: dict[tuple[Kind, str], float | None] = {}
            for kind, name, until in await table.read(self.store):
                key: tuple[Kind, str] = (_kind(kind), name)
                if key in self.targets and (until is None or until > now):
                    stored[key] = until
            began = [key for key in stored if key not in self.until]
            ended = [key for key in self.until if key not in stored]
            self.until.update(stored)  # the new ones, and a changed `until`
            for key in ended:
                del self.until[key]
            stopping = [sup for key in began for sup in self.targets[key].supervisors]
        for key in began:
            log.info("pause %s=%s until=%s (by a gateway sharing the store)", *key, stored[key])
        await asyncio.gather(
            *(sup.pause() for sup in stopping),
            *(self._resume(key, "by a gateway sharing the store") for key in ended),
        )

    async def pause(self, kind: Kind, name: str, until: float | None) -> None:
        """Raises `StoreUnavailable` (and changes nothing) if the store cannot keep it."""
        key = (kind, name)
        async with self._lock:
            await table.save(self.store, kind, name, until, self.wall_clock())
            self.until[key] = until
        log.info("pause %s=%s until=%s", kind, name, until or "unpaused")
        await asyncio.gather(*(sup.pause() for sup in self.targets[key].supervisors))

    async def unpause(self, kind: Kind, name: str) -> None:
        """Raises `StoreUnavailable` (and changes nothing) if the store cannot forget it."""
        await self._unpause((kind, name), lenient=False)

    async def expire(self) -> None:
        """Unpause every pause whose `until` has passed (called by the gateway's reaper)."""
        now = self.wall_clock()
        for key, until in list(self.until.items()):
            if until is not None and until <= now:
                await self._unpause(key, lenient=True)

    async def _unpause(self, key: tuple[Kind, str], lenient: bool) -> None:
        async with self._lock:
            await self._forget(key, lenient)
        await self._resume(key)

    async def _resume(self, key: tuple[Kind, str], why: str = "") -> None:
        """Back in service: its processes may start again (a pinned one is reloaded)."""
        target = self.targets.get(key)
        if target is None:  # a reload took the model or extension away
            return
        for sup in target.supervisors:
            sup.unpause()
        log.info("unpause %s=%s%s", *key, f" ({why})" if why else "")
        if target.pinned:
            await asyncio.gather(*(self._reload(sup) for sup in target.supervisors))

    async def _forget(self, key: tuple[Kind, str], lenient: bool) -> None:
        """Delete the stored pause, then the one in memory. `lenient`: for a pause that has
        expired, whose stored row no restart would apply; a failed delete is only logged."""
        try:
            await table.delete(self.store, *key)
        except StoreUnavailable as exc:
            if not lenient:
                raise
            log.warning("expired pause %s=%s stays in the store for now: %s", *key, exc)
        self.until.pop(key, None)

    async def _reload(self, sup: Supervisor) -> None:
        # ensure_ready waits out a teardown still under way (draining or stopping).
        try:
            await sup.ensure_ready()
        except LifecycleError as exc:
            log.warning("reload of pinned backend %s after unpause failed: %s", sup.id, exc)


def _kind(value: str) -> Kind:
    return "extension" if value == "extension" else "model"
