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
"""

from __future__ import annotations

import asyncio
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

    def paused(self, kind: Kind, name: str) -> bool:
        key = (kind, name)
        if key not in self.until:
            return False
        until = self.until[key]
        return until is None or until > self.wall_clock()

    async def restore(self) -> None:
        """At boot: apply the pauses kept in the store; forget the ones that have expired."""
        now = self.wall_clock()
        for kind, name, until in await table.read(self.store):
            key: tuple[Kind, str] = (_kind(kind), name)
            if key not in self.targets or (until is not None and until <= now):
                await self._forget(key, lenient=True)
                continue
            self.until[key] = until
            await asyncio.gather(*(sup.pause() for sup in self.targets[key].supervisors))

    async def pause(self, kind: Kind, name: str, until: float | None) -> None:
        """Raises `StoreUnavailable` (and changes nothing) if the store cannot keep it."""
        key = (kind, name)
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
        await self._forget(key, lenient)
        target = self.targets.get(key)
        if target is None:  # a reload took the model or extension away
            return
        for sup in target.supervisors:
            sup.unpause()
        log.info("unpause %s=%s", *key)
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
