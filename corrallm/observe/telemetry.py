"""Where what happened goes (SPEC §9 C1, C3, C6, §10 P4): a finished request's cost, spend
and activity row, metrics and usage event; each lifecycle transition's log line, metric,
event and load-energy charge; the admission load the live views draw.

All of it is memory only (rows are batched by the activity writer), so it is safe on the
request path and inside transition listeners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from corrallm.auth.keys import UNKNOWN
from corrallm.cost.ledger import NOTHING, UNKNOWN_MODEL, Ledger, Visit, activity_row
from corrallm.cost.model import FREE, CostModel, Price
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.lifecycle.transitions import Transitions
from corrallm.observe.events import EventBus
from corrallm.observe.metrics import Metrics
from corrallm.scheduler.admission import Admission

log = logging.getLogger("corrallm.lifecycle")


def settlement(costs: CostModel, visit: Visit) -> tuple[Price, tuple[Any, ...] | None]:
    """What the finished visit cost, and its activity row: none for T5's caller nobody
    configured asking for a model nobody serves (a flood of made-up names, perhaps),
    only counted under bounded metric labels: it reserved nothing and reached no
    backend, there is nothing to keep. Pure: a relaying worker settles its own."""
    if visit.model == UNKNOWN_MODEL and visit.key in (None, UNKNOWN):
        return FREE, None
    return activity_row(costs, visit)


class Telemetry:
    def __init__(
        self,
        ledger: Ledger,
        metrics: Metrics,
        events: EventBus,
        admission: Callable[[], Admission],
        models_of: Callable[[Supervisor], list[str]],
        route_ids: Callable[[], list[str]],
    ) -> None:
        self.ledger, self.metrics, self.events = ledger, metrics, events
        self._admission, self._models_of, self._route_ids = admission, models_of, route_ids

    def subscribe(self, bus: Transitions[Supervisor]) -> None:
        bus.subscribe(moved=self._transition, line=self._line)

    def settle(self, visit: Visit) -> None:
        """A request is over: its cost, spend and activity row (no I/O: rows are batched)."""
        price, row = settlement(self.ledger.costs, visit)
        self.metrics.visit(visit, price.cost_usd, price.energy_wh)
        if row is not None:
            self.ledger.activity.add(row)
            m = visit.metered or NOTHING
            self.charge(visit, price, m.prompt_tokens, m.completion_tokens)

    def charge(
        self, visit: Visit, price: Price, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """A settled visit's spend and its usage event, once its row is written (here, or
        by the relaying worker that served it, which counted its metrics too)."""
        self.ledger.charge(visit.group, visit.key, visit.holds, price.cost_usd)
        if self.events.subscribers:
            self.events.publish(
                "usage",
                {
                    "key": visit.key,
                    "user": visit.user,
                    "group": visit.group,
                    "model": visit.model,
                    "backend": visit.backend_id,
                    "status": visit.status,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "cost_usd": price.cost_usd,
                    "energy_wh": price.energy_wh,
                },
            )

    def publish_load(self) -> None:
        """Admission load of every backend, for live views (sent each reaper pass)."""
        if not self.events.subscribers:
            return
        core = self._admission().core
        backends = []
        for route_id in self._route_ids():
            capacity, in_flight, waiting = core.load(route_id)
            backends.append(
                {
                    "backend": route_id,
                    "capacity": capacity,
                    "in_flight": in_flight,
                    "waiting": waiting,
                }
            )
        self.events.publish("admission", {"backends": backends})

    def _transition(self, sup: Supervisor, old: State, new: State) -> None:
        log.info("backend=%s transition=%s->%s pid=%s", sup.id, old, new, sup.pid)
        if old is State.STARTING and new is State.READY and sup.last_load_seconds is not None:
            # C1: a finished start costs its load energy, charged to whoever caused it.
            self.ledger.load(sup.spec, sup.id, sup.last_load_seconds, sup.started_for)
        self.metrics.transition(sup, old, new)
        event = {
            "backend": sup.id,
            "models": self._models_of(sup),
            "old": str(old),
            "new": str(new),
            "pid": sup.pid,
        }
        if new is State.FAILED:  # why (M4, L3, M5): the metric's reason and the message
            event["reason"], event["error"] = sup.failure_reason, sup.last_error
        self.events.publish("lifecycle", event)

    def _line(self, backend: str, text: str) -> None:
        self.events.publish("log", {"backend": backend, "line": text})
