"""Live requests (SPEC §21 O1): every request corrallm holds now, and cancelling one.

A long-lived owner. The pipeline enters each request when it starts, moves it from
`queued` to `loading` (its backend starting or waking) to `running` (talking to the
backend), and takes it out when it is settled. Nothing here does I/O; the lifecycle
events (`request` on the event bus) go out only while someone listens.

Cancelling marks the request and cancels its task; the pipeline, which owns what a
cancel means where the request is, turns it into 503 `cancelled` (nothing sent yet) or
the surface's error event and `[DONE]` (a stream under way). Tokens so far are the
events its meter counted on the relayed stream (no parse per chunk).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from corrallm.cost.ledger import Visit
    from corrallm.observe.events import EventBus

Phase = Literal["queued", "loading", "running"]


class MeterReading(Protocol):
    """What a relay's meter says of the answer so far (`proxy.metering.Meter`)."""

    @property
    def events(self) -> int: ...


@dataclass(slots=True, eq=False)
class LiveRequest:
    visit: Visit
    task: asyncio.Task[Any] | None
    state: Phase = "queued"
    meter: MeterReading | None = None  # set by the surface once it relays an answer
    cancelled: bool = False  # an operator asked for it to end
    # How the pipeline stops it for that (its interrupt recorded, then its task cancelled)
    stop: Callable[[], object] | None = None

    @property
    def id(self) -> str:
        assert self.visit.request_id is not None, "entered with its id"
        return self.visit.request_id

    def view(self, now: float) -> dict[str, Any]:
        visit = self.visit
        return {
            "id": self.id,
            "key": visit.key,
            "user": visit.user,
            "group": visit.group,
            "model": visit.model,
            "backend": visit.backend_id,
            "endpoint": visit.endpoint,
            "state": self.state,
            "age_ms": round((now - visit.arrived_mono) * 1000, 1),
            "stream": visit.stream,
            "completion_tokens": self.meter.events if self.meter is not None else 0,
        }


class LiveRequests:
    def __init__(self, events: EventBus) -> None:
        self.events = events
        self._held: dict[str, LiveRequest] = {}

    def __len__(self) -> int:
        return len(self._held)

    def enter(self, visit: Visit) -> LiveRequest:
        return self.add(LiveRequest(visit, asyncio.current_task()))

    def add(self, live: LiveRequest) -> LiveRequest:
        """A request held elsewhere (a relaying worker's: it has no task here)."""
        self._held[live.id] = live
        if self.events.subscribers:
            self.events.publish("request", {"event": "started", **live.view(time.monotonic())})
        return live

    def leave(self, live: LiveRequest) -> None:
        self._held.pop(live.id, None)
        if self.events.subscribers:
            view = live.view(time.monotonic())
            view.update(event="ended", status=live.visit.status, cancelled=live.cancelled)
            self.events.publish("request", view)

    def views(self) -> list[dict[str, Any]]:
        """Oldest first."""
        now = time.monotonic()
        return [live.view(now) for live in self._held.values()]

    def get(self, request_id: str) -> LiveRequest | None:
        return self._held.get(request_id)

    def cancel(self, request_id: str) -> LiveRequest | None:
        """Ask the request to end; None if it is not held (any more)."""
        live = self._held.get(request_id)
        if live is None:
            return None
        if not live.cancelled:
            live.cancelled = True
            if live.stop is not None:
                live.stop()
            elif live.task is not None:
                live.task.cancel()
        return live
