"""The one transition bus every supervisor publishes to (SPEC §4, §10 P4, §11 D1).

The long-lived owners that care how processes move (residency, the economics ledger,
metrics, the event stream, the load-energy charge) subscribe once, when the gateway is
built; a config reload swaps the supervisors but never the bus, so nobody has to rewire
anyone else's listeners and backends a reload adds are seen like the first ones.
Listeners are synchronous and must not block: they update memory or schedule a task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corrallm.lifecycle.state import State
    from corrallm.lifecycle.supervisor import Supervisor

Moved = Callable[["Supervisor", "State", "State"], None]
Idle = Callable[["Supervisor"], None]
Line = Callable[[str, str], None]  # (backend id, log line)


class Transitions:
    def __init__(self) -> None:
        self._moved: list[Moved] = []
        self._idle: list[Idle] = []
        self._lines: list[Line] = []

    def subscribe(
        self, *, moved: Moved | None = None, idle: Idle | None = None, line: Line | None = None
    ) -> None:
        if moved is not None:
            self._moved.append(moved)
        if idle is not None:
            self._idle.append(idle)
        if line is not None:
            self._lines.append(line)

    def moved(self, sup: Supervisor, old: State, new: State) -> None:
        for listener in self._moved:
            listener(sup, old, new)

    def idle(self, sup: Supervisor) -> None:
        for listener in self._idle:
            listener(sup)

    def line(self, backend: str, text: str) -> None:
        for listener in self._lines:
            listener(backend, text)
