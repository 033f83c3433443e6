"""A relaying worker's `Runtime` (proxy/runtime.py): the pipeline runs here unchanged,
and what only the owner of state may decide it asks across the hop.

Read here, from the same config as the owner's: the topology (`mirror.py`), callers and
keys, prices. Asked of the owner: admission with everything that reads state (pauses,
rate windows, spend, slots, loads: one `ACQUIRE`, answered once the backend is ready),
and the live list. Told, never waited for: `RELEASE`, `DONE` and captures. A request is
settled here, as a single process settles it (its price, activity row and metrics are
the config's arithmetic): the row goes to this worker's own batched writer (the store's
upserts add, as several gateways' writers do on a shared store, SPEC §19 X5), the
metrics reach the owner's /metrics in bulk (`COUNTED`, every PROGRESS_SECONDS and
whenever it is read), and its `DONE` carries only what the owner keeps: its slot and
live entry given back, its cost for the spend windows.

Each request's hop state (`Pending`) is found through a context variable its live entry
sets: every member the pipeline calls for a request runs in that request's task.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from corrallm.auth.callers import Caller, Callers
from corrallm.auth.keys import Identity, KeyRing
from corrallm.auth.limits import Ask, Hold, LimitRefusal, Remaining
from corrallm.auth.throttle import asks_of
from corrallm.config import Config
from corrallm.config.schema import BackendConfig, PriorityGroup, SpendLimit, TelemetryConfig
from corrallm.cost.ledger import OverSpend, Visit, price_of
from corrallm.cost.model import CostModel, Price
from corrallm.http.errors import ApiError
from corrallm.observe.captures import Captures
from corrallm.observe.context import CURRENT as EXCHANGE
from corrallm.observe.live import LiveRequest
from corrallm.observe.metrics import Tally
from corrallm.observe.ring import Record, Ring
from corrallm.observe.telemetry import settlement
from corrallm.observe.traces import Tracer, retrace
from corrallm.routing.router import Route, ServedModel
from corrallm.scheduler.ticket import Interrupt, Stop, Ticket
from corrallm.store.activity import ActivityLog
from corrallm.store.db import Store
from corrallm.workers.hop import Kind, Link, decode, encode
from corrallm.workers.mirror import Mirror, mirrored

log = logging.getLogger("corrallm.workers")


class Pending:
    """One request of this worker, from its live entry to its settle."""

    __slots__ = (
        "future",
        "limit",
        "live",
        "on_queued",
        "opened",
        "rid",
        "spilled",
        "stop",
        "ticket",
    )

    def __init__(self, rid: int, live: LiveRequest) -> None:
        self.rid, self.live = rid, live
        self.opened = False  # the owner knows it (its first ACQUIRE, or its DONE)
        self.limit: int | None = None  # the completion tokens it asks for (estimates)
        self.stop: Stop | None = None
        self.ticket: Ticket | None = None  # the slot the owner gave it
        self.on_queued: Callable[[int], None] | None = None
        self.future: asyncio.Future[tuple[int, list[Any]]] | None = None
        self.spilled = False  # R2, as the owner's tiers said when it admitted it

    def opening(self) -> list[Any] | None:
        """What the owner needs to enter it in the live list, the first time only."""
        if self.opened:
            return None
        self.opened = True
        v = self.live.visit
        return [
            v.key,
            v.group,
            v.model,
            v.endpoint,
            v.bytes_in,
            v.request_id,
            v.stream,
            v.user,
            v.arrived,
            v.arrived_mono,  # the same clock in every process (CLOCK_MONOTONIC)
        ]


PROGRESS_SECONDS = 0.25

CURRENT: contextvars.ContextVar[Pending] = contextvars.ContextVar("corrallm_hop")


class Heard:
    """Where this worker's queued requests wait, as the owner said when it queued them
    (K4's note: a place by arrival and an expected wait, at the time it was queued)."""

    def __init__(self) -> None:
        self.places: dict[int, tuple[str, int, int, float]] = {}

    def position(self, request_id: int) -> tuple[str, int, int] | None:
        place = self.places.get(request_id)
        return None if place is None else place[:3]

    def load(self, backend: str) -> tuple[int, int, int]:
        return 0, 0, 0

    def retry_after(self, backend: str) -> float:
        return next((p[3] for p in self.places.values() if p[0] == backend), 1.0)


class OwnerLink(Link):
    """The worker's end of the hop: answers to its requests, interrupts, config."""

    def __init__(self, runtime: RemoteRuntime) -> None:
        super().__init__()
        self.runtime = runtime
        self.pending: dict[int, Pending] = {}
        self.released: dict[int, list[Any]] = {}  # RELEASEs a DONE may still carry

    def release(self, rid: int, tokens: int, dollars: float) -> None:
        """A slot given back: the request's `DONE` carries it when it follows in the same
        step of its task, as it does when a request ends (one message, not two); else it
        goes as a `RELEASE` of its own, before anything else said of that request."""
        if not self.released:
            assert self._loop is not None
            self._loop.call_soon(self._unclaimed)
        self.released[rid] = [tokens, dollars]

    def claim(self, rid: int) -> list[Any] | None:
        return self.released.pop(rid, None) if self.released else None

    def _unclaimed(self) -> None:
        released, self.released = self.released, {}
        for rid, given in released.items():
            super().send(Kind.RELEASE, rid, encode(given))

    def send(self, kind: Kind, rid: int, payload: bytes = b"") -> None:
        if self.released and rid in self.released:
            super().send(Kind.RELEASE, rid, encode(self.released.pop(rid)))
        super().send(kind, rid, payload)

    def frame(self, kind: int, rid: int, payload: bytes) -> None:
        if kind == Kind.CONFIG:
            self.runtime.reconfigure(pickle.loads(payload))
            Link.send(self, Kind.APPLIED, rid)  # (not a request's number: no RELEASE first)
            return
        if kind == Kind.KEYS:
            self.runtime.keys.load(*pickle.loads(payload))
            Link.send(self, Kind.APPLIED, rid)
            return
        if kind == Kind.COUNTS:
            subjects, headers = decode(payload)
            self.runtime.throttle.heard[tuple(subjects)] = _raw(headers)
            return
        if kind == Kind.TALLY:
            self.counted(rid)
            return
        pending = self.pending.get(rid)
        if pending is None:
            if kind == Kind.ADMITTED:  # it was over before its answer came: hand it back
                self.send(Kind.RELEASE, rid, encode([0, 0.0]))
            return
        if kind in (Kind.ADMITTED, Kind.REFUSED):
            future = pending.future
            if future is not None and not future.done():
                future.set_result((kind, decode(payload)))
            elif kind == Kind.ADMITTED:
                self.send(Kind.RELEASE, rid, encode([0, 0.0]))
        elif kind == Kind.QUEUED:
            ticket, backend, position, waiting, eta = decode(payload)
            self.runtime.heard.places[ticket] = (backend, position, waiting, eta)
            if pending.on_queued is not None:
                pending.on_queued(ticket)
        elif kind == Kind.INTERRUPT:
            reason, detail = decode(payload)
            self._interrupt(pending, Interrupt(reason), detail)

    def _interrupt(self, pending: Pending, reason: Interrupt, detail: str) -> None:
        live = pending.live
        if reason is Interrupt.CANCELLED:  # O1, as `LiveRequests.cancel` does in process
            if not live.cancelled:
                live.cancelled = True
                if live.stop is not None:
                    live.stop()
            return
        ticket = pending.ticket
        if ticket is None or pending.stop is None:
            return
        if reason is Interrupt.PREEMPTED and ticket.shielded:
            return  # S4: it ends by itself; the owner admits the taker then
        pending.stop.interrupt(reason, detail)

    def counted(self, rid: int) -> None:
        """The metrics counted since they were last sent (`rid` 0: unasked)."""
        taken = self.runtime.counts.take()
        if taken is not None or rid:
            self.send(Kind.COUNTED, rid, b"" if taken is None else encode(taken))

    async def report(self) -> None:
        """O1: every `PROGRESS_SECONDS`, the events relayed so far of each answer under
        way (the owner's live list shows them as tokens so far); nothing when none is.
        And the metrics counted meanwhile: a worker that dies loses at most these."""
        while True:
            await asyncio.sleep(PROGRESS_SECONDS)
            self.counted(0)
            counts = [
                [p.rid, p.live.meter.events]
                for p in self.pending.values()
                if p.live.meter is not None and p.live.meter.events
            ]
            if counts:
                self.send(Kind.PROGRESS, 0, encode(counts))

    def connection_lost(self, exc: Exception | None) -> None:
        # The owner is gone: no request can be admitted or settled any more. The next
        # start of `corrallm serve` re-adopts the backends, as after any crash.
        log.error("the owner of state went away; this worker exits")
        os._exit(3)


class RemoteAdmission:
    def __init__(self, link: OwnerLink, heard: Heard) -> None:
        self.link, self.core = link, heard

    async def acquire(
        self,
        group_name: str,
        group: PriorityGroup | None,
        tiers: Sequence[Sequence[Route]],
        affinity: str | None = None,
        on_queued: Callable[[int], None] | None = None,
        stop: Stop | None = None,
    ) -> Ticket:
        pending = CURRENT.get()
        pending.stop, pending.on_queued = stop, on_queued
        exchange = EXCHANGE.get()
        hop = exchange is not None and exchange.hop
        model = tiers[0][0].model
        asked = [pending.opening(), model, pending.limit, affinity, hop]
        return await self._answer(pending, Kind.ACQUIRE, encode(asked), group_name)

    def release(self, ticket: Ticket, tokens: int = 0, dollars: float = 0.0) -> None:
        pending = CURRENT.get()
        pending.ticket = None
        self.link.release(pending.rid, tokens, dollars)

    async def requeue(self, ticket: Ticket, group: PriorityGroup | None) -> Ticket:
        pending = CURRENT.get()
        pending.ticket = None
        return await self._answer(pending, Kind.REQUEUE, b"", ticket.group)

    async def _answer(self, pending: Pending, kind: Kind, asked: bytes, group: str) -> Ticket:
        future = pending.future = asyncio.get_running_loop().create_future()
        self.link.send(kind, pending.rid, asked)
        try:
            answer, fields = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.result()[0] == Kind.ADMITTED:
                self.link.send(Kind.RELEASE, pending.rid, encode([0, 0.0]))
            else:
                self.link.send(Kind.WITHDRAW, pending.rid)
            raise
        finally:
            pending.future = None
        exchange = EXCHANGE.get()
        if answer == Kind.REFUSED:
            status, message, code, type_, param, headers, extra, recorded, counts = fields
            if counts is not None and exchange is not None:
                exchange.headers = _raw(counts)
            error = ApiError(status, message, code, type=type_, param=param, headers=headers)
            error.extra, error.recorded = extra, recorded
            raise error
        route_id, url, ticket_id, preemptible, counts, loaded, admitted, spilled = fields
        self.core.places.pop(ticket_id, None)
        visit = pending.live.visit
        # When the owner admitted it (before any load), as the row and histograms count.
        visit.admitted_mono = visit.admitted_mono or admitted
        pending.spilled = spilled
        if counts is not None and exchange is not None:
            exchange.headers = _raw(counts)
        route = self.link.runtime.routes.get(route_id)
        if route is None:  # only a peer's route (peers are the owner's alone)
            self.link.send(Kind.RELEASE, pending.rid, encode([0, 0.0]))
            raise ApiError(503, f"The backend '{route_id}' is not known to this worker.")
        mirror = route.endpoint
        if isinstance(mirror, Mirror) and mirror.base_url != url:
            mirror.base_url = url
        assert pending.stop is not None
        ticket = pending.ticket = Ticket(ticket_id, group, route, preemptible, pending.stop)
        ticket.loaded_ms = loaded
        return ticket


def _raw(headers: list[list[str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]


class RemoteSpend:
    """S6: reserved by the owner as part of `ACQUIRE`; prices are the config's."""

    def __init__(self, config: Config) -> None:
        self.costs = CostModel(config)

    async def reserve(
        self,
        visit: Visit,
        backend: BackendConfig,
        max_tokens: int | None,
        key_limit: SpendLimit | None = None,
        usd: float | None = None,
    ) -> OverSpend | None:
        CURRENT.get().limit = max_tokens  # the owner estimates with it
        return None

    def price(self, visit: Visit) -> Price:
        return price_of(self.costs, visit)


# T3: counted by the owner as part of `ACQUIRE` (its answer carries the counts for the
# x-ratelimit-* headers); the pipeline's pass here holds nothing.
_COUNTED_THERE = Hold((), 0, 0.0)


class RemoteLimits:
    def __init__(self) -> None:
        # The counts the owner last sent for each set of subjects (`COUNTS`).
        self.heard: dict[tuple[str, ...], list[tuple[bytes, bytes]]] = {}

    def counts(self, identity: Identity, user: str | None) -> list[tuple[bytes, bytes]]:
        """An answer refused before the limits were asked: the counts last heard."""
        return self.heard.get(tuple(a.subject for a in asks_of(identity, user)), [])

    def admit_now(
        self, asks: Sequence[Ask], estimate: int
    ) -> Hold | tuple[LimitRefusal, Remaining] | None:
        return _COUNTED_THERE

    async def admit(
        self, asks: Sequence[Ask], estimate: int
    ) -> Hold | tuple[LimitRefusal, Remaining]:
        return _COUNTED_THERE

    def release(self, admitted: Hold, tokens: int) -> None:
        return None  # the owner releases it with the request's DONE


class RemoteLive:
    def __init__(self, link: OwnerLink) -> None:
        self.link = link
        self._ids = itertools.count(1)

    def enter(self, visit: Visit) -> LiveRequest:
        live = LiveRequest(visit, asyncio.current_task())
        pending = Pending(next(self._ids) & 0xFFFFFFFF, live)
        self.link.pending[pending.rid] = pending
        CURRENT.set(pending)
        return live

    def leave(self, live: LiveRequest) -> None:
        return None  # with the settle (`DONE`)


class Forwarding(Ring):
    """The worker's capture ring: each record kept goes to the owner's ring (O2)."""

    def __init__(self, link: OwnerLink) -> None:
        super().__init__(0)
        self.link = link

    def add(self, record: Record) -> bool:
        self.link.send(Kind.CAPTURE, 0, pickle.dumps(record))
        return True

    def resize(self, bound: int) -> None:
        return None


class RemoteRuntime:
    """proxy/runtime.py's `Runtime`, for a relaying worker."""

    def __init__(self, config: Config, store: Store) -> None:
        self.link = OwnerLink(self)
        self.store = store  # the owner's store (its file, or a shared PostgreSQL)
        self.activity = ActivityLog(store)  # this worker's requests' rows (C3)
        self.heard = Heard()
        self.keys = KeyRing()
        self.callers = Callers(config, self.keys)
        self.captures = Captures(config, self.keys)
        self.captures.ring = Forwarding(self.link)
        self.admission = RemoteAdmission(self.link, self.heard)
        self.throttle = RemoteLimits()
        self.live = RemoteLive(self.link)
        self.counts = Tally()  # its visits' metrics, for the owner's /metrics
        self.mirrors: dict[str, Mirror] = {}
        # E2: each worker exports the spans of the requests it relays.
        self.tracer: Tracer | None = None
        self.telemetry = TelemetryConfig()  # unset: no tracer
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """The owner's config now in force (at the start, and after each reload)."""
        if config.telemetry != self.telemetry:
            self.tracer, self.telemetry = retrace(self.tracer, config.telemetry), config.telemetry
        self.keys.reconfigure(config.keys)
        self.callers.reconfigure(config)
        self.captures.reconfigure(config)
        self.ledger = RemoteSpend(config)
        self.topology = mirrored(config, self.mirrors)
        self.mirrors = {
            r.id: r.endpoint
            for r in self.topology.routes.values()
            if isinstance(r.endpoint, Mirror)
        }

    @property
    def config(self) -> Config:
        return self.topology.config

    @property
    def models(self) -> dict[str, ServedModel]:
        return self.topology.models

    @property
    def served(self) -> list[ServedModel]:
        return self.topology.served

    @property
    def routes(self) -> dict[str, Route]:
        return self.topology.routes

    def caller(self, key: str | None, signed: str | None = None) -> Caller:
        return self.callers(key, signed)

    def user_header(self) -> bytes | None:
        return self.callers.user_header

    # Pauses are the owner's: `ACQUIRE` refuses a paused model (F3) with its Retry-After.
    def paused(self, kind: Any, name: str) -> bool:
        return False

    def pause_remaining(self, kind: Any, name: str) -> float | None:
        return None

    def stale(self, route: Route) -> bool:
        return route.id not in self.topology.routes

    def placeable(self, route: Route) -> bool:
        return True  # the owner places (R2): it chooses the tiers again at `ACQUIRE`

    def upstream_idle(self, route: Route) -> float:
        return self.config.upstream_idle(route.config)

    def peer_failed(self, route: Route, message: str) -> None:
        return None  # peers are the owner's alone: a worker never routes to one

    def settle(self, visit: Visit) -> None:
        """As `Gateway.settle` in process, less what only the owner keeps: that goes in the
        request's `DONE` (its cost and tokens, its slot if given back just now)."""
        pending = CURRENT.get()
        self.link.pending.pop(pending.rid, None)
        if visit.backend_id is not None:
            visit.spilled = pending.spilled  # the owner's tiers, not this worker's (R2)
        price, row = settlement(self.ledger.costs, visit)
        self.counts.visit(visit, price.cost_usd, price.energy_wh)
        if row is not None:
            self.activity.add(row)
        m = visit.metered
        done = [
            pending.opening(),
            visit.status,
            m.prompt_tokens if m is not None else None,
            m.completion_tokens if m is not None else 0,
            price.cost_usd,
            price.energy_wh,
            self.link.claim(pending.rid),
            row is not None,
        ]
        self.link.send(Kind.DONE, pending.rid, encode(done))
