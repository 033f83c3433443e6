"""A backend with no `cmd` is a pure proxy: always ready, never spawned (SPEC §4 L7)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from corrallm.lifecycle.description import Description, Kind
from corrallm.lifecycle.state import State


@dataclass
class RemoteEndpoint:
    kind: ClassVar[Kind] = "proxy"
    retired: ClassVar[bool] = False  # a reload replaces a proxy's route; nothing retires it

    id: str
    base_url: str
    state: State = State.READY
    in_flight: int = 0
    last_used: float = 0.0
    pid: None = None
    clock: Callable[[], float] = time.monotonic

    async def ensure_ready(self, cause: object = None) -> None:
        return None

    async def load(self) -> None:
        return None

    def describe(self) -> Description:
        return Description(self.kind, self.state, self.base_url)

    def available(self) -> bool:
        return True

    def enter(self) -> bool:
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        self.last_used = self.clock()
