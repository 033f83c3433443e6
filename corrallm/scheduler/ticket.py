"""A request's ticket and what stops it (SPEC §6 S4, S7; §10 P6; §21 O1; X4).

Interrupts are explicit: whoever stops a request (a preemption, an operator's cancel, a
peer going down, the client leaving) says why on its `Stop` *before* cancelling its
task, and the pipeline reads that reason. A reload retiring the backend and a silent
upstream end the request by an error, not a cancel; the pipeline records those on the
same `Stop` so that one place says why every request ended early.

The relay owns a `Progress` (what of the answer has been sent, and whether an
interruption can still be rendered in the answer's own shape); the admission reads it to
leave a shielded answer alone, the pipeline to decide between routing again, a clean
error, or the dialect's error event.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corrallm.routing.router import Route


class Interrupt(enum.IntEnum):
    """Why a request stopped early; a higher value wins over a lower one set before it
    was handled (an operator's cancel over a preemption, the client leaving over all)."""

    UPSTREAM_TIMEOUT = 1  # its backend fell silent (an error, recorded by the pipeline)
    RETIRED = 2  # a reload took its backend away (P6; an error, recorded by the pipeline)
    PREEMPTED = 3  # a higher-priority request took its slot (S4)
    PEER_DOWN = 4  # the peer serving it went down (X4)
    CANCELLED = 5  # an operator cancelled it (O1)
    CLIENT_GONE = 6  # its client went away (S7)


@dataclass(frozen=True, slots=True)
class Interruption:
    reason: Interrupt
    detail: str = ""


class Stop:
    """Where a request's interrupt is recorded, and the one thing that cancels its task
    for one. Each request has one for its whole life, shared by its ticket (admission),
    its live entry (operator cancel) and its disconnect watch."""

    __slots__ = ("_pending", "task", "why")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.why: Interruption | None = None
        self._pending = False  # a cancel of ours not yet absorbed

    def interrupt(self, reason: Interrupt, detail: str = "") -> bool:
        """Record why and cancel the task (once per unhandled interrupt); False if there
        is no task to stop."""
        if self.why is None or reason > self.why.reason:
            self.why = Interruption(reason, detail)
        if self.task is None:
            return False
        if not self._pending:
            self._pending = True
            self.task.cancel()
        return True

    def cancel(self) -> bool:
        """An operator's cancel (O1)."""
        return self.interrupt(Interrupt.CANCELLED)

    def note(self, reason: Interrupt, detail: str = "") -> None:
        """Record an interrupt that came as an error, not a cancel (retired, timeout)."""
        if self.why is None or reason > self.why.reason:
            self.why = Interruption(reason, detail)

    def absorb(self) -> Interruption | None:
        """In an `except CancelledError`: the interrupt this cancel was, its cancel spent;
        None if it was someone else's (a shutdown), which must propagate."""
        if not self._pending or self.task is None:
            return None
        self._pending = False
        if self.task.uncancel() != 0:
            return None  # another cancel is pending too: not only ours
        return self.why

    def clear(self) -> None:
        """The interrupt was handled and the request goes on (requeued, routed again)."""
        self.why = None
        self._pending = False


class Stage(enum.IntEnum):
    NOTHING = 0  # nothing of the answer has gone out
    HEAD = 1  # the head went out (the status is decided)
    EVENTS = 2  # at least one event or piece of body went out


@dataclass(slots=True)
class Progress:
    """How far the relay got with one answer. `render`, set while the answer is a stream
    that ends cleanly at event boundaries, writes an interruption in the dialect's shape;
    None: it cannot be cut (a held or raw body), so a preemption waits for it."""

    stage: Stage = Stage.NOTHING
    render: Callable[[Any], Awaitable[None]] | None = None

    @property
    def started(self) -> bool:
        return self.stage != Stage.NOTHING

    @property
    def shielded(self) -> bool:
        """Begun, and not a stream an interruption can end (S4: it finishes first)."""
        return self.stage != Stage.NOTHING and self.render is None

    def begin(self, render: Callable[[Any], Awaitable[None]] | None = None) -> None:
        self.stage, self.render = Stage.HEAD, render


@dataclass(slots=True)
class Ticket:
    id: int
    group: str
    route: Route
    preemptible: bool
    stop: Stop
    # The relay's progress with the current attempt (a new one each time it is tried).
    progress: Progress = field(default_factory=Progress)
    # K6: the conversation it belongs to (served model, session key), remembered on the
    # backend it is admitted to.
    session: tuple[str, str] | None = None
    # How long its admission itself waited for the backend to be ready, in ms: a
    # `--workers` worker's owner loads before it answers ADMITTED (docs/design.md). In
    # process 0: the pipeline waits for the load itself, after the admission.
    loaded_ms: float = 0.0

    @property
    def task(self) -> asyncio.Task[Any] | None:
        return self.stop.task

    @property
    def interrupt(self) -> Interruption | None:
        return self.stop.why

    @property
    def preempted(self) -> bool:
        why = self.stop.why
        return why is not None and why.reason == Interrupt.PREEMPTED

    @property
    def shielded(self) -> bool:
        return self.progress.shielded
