"""Pauses (SPEC §10 P1, §8 F3): an operator's decision to keep a model or an extension out
of service, optionally until a time, kept in the store so it survives a restart.

A paused model's own processes are drained, stopped and held PAUSED: no request, fall-
through, explicit load or boot preload starts them. Pausing an extension pauses its one
process and so every model it hosts. Unpausing a pinned model loads it again, waiting out
the teardown of the process the pause stopped.
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
from corrallm.store.db import Store

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
        rows = await self.store.query("SELECT kind, name, until FROM pauses")
        now = self.wall_clock()
        for row in rows:
            key = (row["kind"], row["name"])
            if key not in self.targets or (row["until"] is not None and row["until"] <= now):
                await self._forget(key)
                continue
            self.until[key] = row["until"]
            await asyncio.gather(*(sup.pause() for sup in self.targets[key].supervisors))

    async def pause(self, kind: Kind, name: str, until: float | None) -> None:
        key = (kind, name)
        self.until[key] = until
        await self.store.execute(
            "INSERT OR REPLACE INTO pauses (kind, name, until, paused_at) VALUES (?, ?, ?, ?)",
            (kind, name, until, self.wall_clock()),
        )
        log.info("pause %s=%s until=%s", kind, name, until or "unpaused")
        await asyncio.gather(*(sup.pause() for sup in self.targets[key].supervisors))

    async def unpause(self, kind: Kind, name: str) -> None:
        key = (kind, name)
        await self._forget(key)
        target = self.targets[key]
        for sup in target.supervisors:
            sup.unpause()
        log.info("unpause %s=%s", kind, name)
        if target.pinned:
            await asyncio.gather(*(self._reload(sup) for sup in target.supervisors))

    async def expire(self) -> None:
        """Unpause every pause whose `until` has passed (called by the gateway's reaper)."""
        now = self.wall_clock()
        for (kind, name), until in list(self.until.items()):
            if until is not None and until <= now:
                await self.unpause(kind, name)

    async def _forget(self, key: tuple[Kind, str]) -> None:
        self.until.pop(key, None)
        await self.store.execute("DELETE FROM pauses WHERE kind = ? AND name = ?", key)

    async def _reload(self, sup: Supervisor) -> None:
        # ensure_ready waits out a teardown still under way (draining or stopping).
        try:
            await sup.ensure_ready()
        except LifecycleError as exc:
            log.warning("reload of pinned backend %s after unpause failed: %s", sup.id, exc)
