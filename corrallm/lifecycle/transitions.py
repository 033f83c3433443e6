"""The one transition bus every supervisor publishes to (SPEC §4, §10 P4, §11 D1).

The long-lived owners that care how processes move (residency, the economics ledger,
metrics, the event stream, the load-energy charge) subscribe once, when the gateway is
built; a config reload swaps the supervisors but never the bus, so nobody has to rewire
anyone else's listeners and backends a reload adds are seen like the first ones.
Listeners are synchronous and must not block: they update memory or schedule a task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from corrallm.lifecycle.state import State

# The process that moved: a Supervisor (generic so this module needs none of it).
P = TypeVar("P")
Line = Callable[[str, str], None]  # (backend id, log line)


class Transitions(Generic[P]):
    def __init__(self) -> None:
        self._moved: list[Callable[[P, State, State], None]] = []
        self._idle: list[Callable[[P], None]] = []
        self._lines: list[Line] = []

    def subscribe(
        self,
        *,
        moved: Callable[[P, State, State], None] | None = None,
        idle: Callable[[P], None] | None = None,
        line: Line | None = None,
    ) -> None:
        if moved is not None:
            self._moved.append(moved)
        if idle is not None:
            self._idle.append(idle)
        if line is not None:
            self._lines.append(line)

    def moved(self, process: P, old: State, new: State) -> None:
        for listener in self._moved:
            listener(process, old, new)

    def idle(self, process: P) -> None:
        for listener in self._idle:
            listener(process)

    def line(self, backend: str, text: str) -> None:
        for listener in self._lines:
            listener(backend, text)
