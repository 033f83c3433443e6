"""The owner's end of one worker's hop connection (`serve --workers N`): each of its
requests, as the one owner of state holds them.

A worker asks for what only the owner may decide, in the pipeline's order: a request
is entered in the live list (`OPEN`), then `ACQUIRE` runs the gates that read state —
the pause, the key's rate windows and spend (T3, S6), a slot (the `Admission` every
request of every worker shares) and a ready backend (loads happen here, once) — and
answers `ADMITTED` with the route and its URL, or `REFUSED` with the error the surface
renders. `RELEASE` and `DONE` are never waited for: the worker settled the visit itself
(its price, activity row and metrics are the config's arithmetic, its row written by
its own writer), and its `DONE` carries only what the owner books (the slot given back,
the rate-limit hold, the live entry, the cost for the spend windows). Each worker's
metrics are added to the owner's in bulk (`COUNTED`). Preemption, an operator's cancel
and a peer going down are `INTERRUPT`s sent to the worker holding the request (its
`RemoteStop`).

A worker that goes away (killed, crashed) ends its connection: everything it held is
let go at once — slots, backends' in-flight counts, rate-limit holds — and settled as
499s, so nothing leaks (the pool respawns it: corrallm/workers/pool.py).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from corrallm.auth.limits import Hold
from corrallm.auth.throttle import asks_of
from corrallm.cost.ledger import Visit
from corrallm.cost.model import FREE, Price
from corrallm.http.errors import ApiError, not_found, quoted
from corrallm.lifecycle.errors import RETIRED
from corrallm.observe.live import LiveRequest
from corrallm.proxy.pipeline import enter_ready, ready
from corrallm.proxy.refusals import model_paused, rate_limited, spend_limited, too_many_requests
from corrallm.scheduler.admission import Rejected
from corrallm.scheduler.ticket import Interrupt, Stop, Ticket
from corrallm.workers.hop import Kind, Link, decode, eager, encode

if TYPE_CHECKING:
    from corrallm.auth.keys import Identity
    from corrallm.auth.limits import Ask
    from corrallm.config.schema import PriorityGroup
    from corrallm.gateway import Gateway
    from corrallm.routing.router import Endpoint, Route, ServedModel

log = logging.getLogger("corrallm.workers")
T = TypeVar("T")


class Hub(Protocol):
    """What a link asks of the hop server holding it (owner.py's `Owner`)."""

    @property
    def gateway(self) -> Gateway: ...
    def joined(self, link: WorkerLink) -> None: ...
    def left(self, link: WorkerLink, held: int) -> None: ...
    def counts(self, asks: Sequence[Ask], headers: list[tuple[str, str]]) -> None: ...
    def applied(self, link: WorkerLink) -> None: ...


class RemoteStop(Stop):
    """A worker's request's stop, at the owner: an interrupt is passed to its worker,
    which records it on the request's own `Stop` there (and decides, as in process,
    whether a preemption may cut the answer)."""

    __slots__ = ("link", "rid")

    def __init__(self, link: WorkerLink, rid: int) -> None:
        # The link and the number, not the `Held`: no reference cycle (held -> stop ->
        # held) is left for the garbage collector to find when the request is over.
        Stop.__init__(self, None)
        self.link, self.rid = link, rid

    def interrupt(self, reason: Interrupt, detail: str = "") -> bool:
        self.note(reason, detail)
        self.link.send(Kind.INTERRUPT, self.rid, encode([int(reason), detail]))
        return True

    def cancel(self) -> bool:
        return self.interrupt(Interrupt.CANCELLED)


@dataclass(frozen=True, slots=True)
class Relayed:
    """What a worker last said of an answer it relays (the live list's tokens so far)."""

    events: int


class Held:
    """One request of one worker, from its `OPEN` to its `DONE`.

    Not slotted: what most requests never change is the class's default, so that making
    one sets a few fields, not twenty (it is made for every request the owner admits)."""

    group: PriorityGroup | None = None
    identity: Identity | None = None
    limit: int | None = None  # the completion tokens it asks for (estimates)
    session: str | None = None  # K6
    hop = False  # it came from another gateway (X1)
    ticket: Ticket | None = None  # the slot it holds
    entered: Endpoint | None = None  # the backend it is counted in flight on
    limits: Hold | None = None  # T3: its place in its key's windows
    passed = False  # its limits and spend were checked (once, however routed)
    headers: list[tuple[str, str]] | None = None  # T3: x-ratelimit-* for the answer
    task: asyncio.Task[None] | None = None  # an acquire that waits (kept alive)
    waiting: asyncio.Task[Any] | None = None  # what it waits for in there
    gone = False  # the worker no longer waits for its acquire
    first: Sequence[Route] = ()  # the first tier it was offered (what spilled means)
    load_ms = 0.0

    def __init__(self, link: WorkerLink, rid: int, visit: Visit, live: LiveRequest) -> None:
        self.link, self.rid, self.visit, self.live = link, rid, visit, live
        self.stop = RemoteStop(link, rid)

    def queued(self, ticket_id: int) -> None:
        """K4: it waits; its worker tells its client where, and for how long."""
        core, backend = self.link.gw.admission.core, self.first[0].id
        place = core.position(ticket_id)
        where, position, waiting = place or (backend, 0, core.load(backend)[2])
        note = [ticket_id, where, position, waiting, core.retry_after(where)]
        self.link.send(Kind.QUEUED, self.rid, encode(note))


class WorkerLink(Link):
    """The owner's end of one worker's hop connection."""

    def __init__(self, owner: Hub) -> None:
        super().__init__()
        self.owner = owner
        self.gw = owner.gateway
        self.held: dict[int, Held] = {}
        self.asked: dict[int, asyncio.Future[None]] = {}  # TALLYs not yet answered
        self.index = -1
        self.pid = 0
        self.applied = 0  # the last of the owner's numbered pushes it has in force
        # What each message kind does, by its number: one dict lookup a frame, where
        # comparing with the `Kind` members costs ~60 ns each (an enum class's getattr).
        self.handlers: dict[int, Callable[[int, bytes], None]] = {
            Kind.ACQUIRE: self._on_acquire,
            Kind.DONE: self._on_done,
            Kind.RELEASE: self._on_release,
            Kind.COUNTED: self._on_counted,
            Kind.REQUEUE: self._on_requeue,
            Kind.WITHDRAW: self._on_withdraw,
            Kind.PROGRESS: self._on_progress,
            Kind.CAPTURE: self._on_capture,
            Kind.JOIN: self._on_join,
            Kind.APPLIED: self._on_applied,
        }

    # -- frames in ---------------------------------------------------------------------

    def frame(self, kind: int, rid: int, payload: bytes) -> None:
        handler = self.handlers.get(kind)
        if handler is None:
            log.warning("worker %d sent an unknown message kind %d", self.index, kind)
            return
        try:
            handler(rid, payload)
        except Exception:
            log.exception("worker %d: message %d for request %d failed", self.index, kind, rid)

    def _on_acquire(self, rid: int, payload: bytes) -> None:
        opening, model, limit, session, hop = decode(payload)
        held = self._open(rid, opening) if opening is not None else self.held[rid]
        held.visit.model, held.limit, held.session, held.hop = model, limit, session, hop
        held.gone = False
        self._acquire_now(held)

    def _on_done(self, rid: int, payload: bytes) -> None:
        self._done(rid, decode(payload))

    def _on_release(self, rid: int, payload: bytes) -> None:
        tokens, dollars = decode(payload)
        self._release(self.held[rid], tokens, dollars)

    def _on_counted(self, rid: int, payload: bytes) -> None:
        if payload:
            self.gw.metrics.add(decode(payload))
        if rid:
            self._counted(rid)

    def _on_requeue(self, rid: int, payload: bytes) -> None:
        held = self.held[rid]
        self._leave(held)
        held.task = eager(self._acquire(held, held.ticket))

    def _on_withdraw(self, rid: int, payload: bytes) -> None:
        self._let_go(self.held[rid])

    def _on_progress(self, rid: int, payload: bytes) -> None:
        for rid_, events in decode(payload):
            relayed = self.held.get(rid_)
            if relayed is not None:
                relayed.live.meter = Relayed(events)

    def _on_capture(self, rid: int, payload: bytes) -> None:
        self.gw.captures.ring.add(pickle.loads(payload))

    def _on_join(self, rid: int, payload: bytes) -> None:
        self.index, self.pid = decode(payload)
        self.owner.joined(self)

    def _on_applied(self, rid: int, payload: bytes) -> None:
        self.applied = max(self.applied, rid)
        self.owner.applied(self)

    def _open(self, rid: int, fields: list[Any]) -> Held:
        visit = _visit(fields)
        held = Held(self, rid, visit, self.gw.live.add(LiveRequest(visit, None)))
        held.live.stop = held.stop.cancel
        held.group = self.gw.config.priority_groups.get(visit.group)
        key = visit.key
        held.identity = self.gw.keys.named(key) if key is not None else None
        self.held[rid] = held
        return held

    # -- acquire: the gates that read state, in the pipeline's order ---------------------

    def _acquire_now(self, held: Held) -> None:
        """`ACQUIRE`, decided now where nothing waits (most requests: no limits to pass, a
        free slot on a ready backend): no coroutine is made for it. Where something
        waits, `_acquire` carries on from the slot it got or waits for (or starts over,
        for limits to pass)."""
        gw, visit = self.gw, held.visit
        try:
            if held.passed or not self._limited(held):
                served = self._served(visit.model)
                if gw.pauses.paused("model", served.name):
                    raise model_paused(served.name, gw.pause_remaining("model", served.name))
                tiers = served.tiers_for(held.group, gw.placeable, held.hop)
                held.first = tiers[0]
                held.passed = True
                got = self._queue(held, tiers)
                if isinstance(got, Ticket):
                    held.ticket = got
                    route = got.route
                    if not gw.stale(route) and route.endpoint.enter():
                        visit.admitted_mono = visit.admitted_mono or time.monotonic()
                        held.entered = route.endpoint
                        self._admitted(held, served, got, 0.0)
                        return
                held.task = eager(self._acquire(held, None, (served, got)))
                return
        except Exception as exc:
            self._failed(held, exc)
            return
        held.task = eager(self._acquire(held, None))

    async def _acquire(
        self,
        held: Held,
        requeued: Ticket | None,
        queued: tuple[ServedModel, Ticket | Awaitable[Ticket]] | None = None,
    ) -> None:
        """The gates, in the pipeline's order, for a request that waits somewhere: its
        limits, a slot (`queued`: as `_acquire_now` got it), a reload, a load; or a
        preempted one's place in its queue again (`requeued`)."""
        gw, visit = self.gw, held.visit
        loaded = held.load_ms  # what earlier acquires of it waited for loads (S4)
        try:
            if queued is not None:
                served, got = queued
                if isinstance(got, Ticket):
                    ticket = got
                else:
                    ticket = held.ticket = await got
                    self._still(held)
            elif requeued is not None:
                served = self._served(visit.model)
                ticket = held.ticket = await self._wait(
                    held, gw.admission.requeue(requeued, held.group)
                )
                self._still(held)
            else:
                served = self._served(visit.model)
                if gw.pauses.paused("model", served.name):
                    raise model_paused(served.name, gw.pause_remaining("model", served.name))
                tiers = served.tiers_for(held.group, gw.placeable, held.hop)
                held.first = tiers[0]
                if not held.passed:
                    if self._limited(held):
                        limits = self._limits(held, tiers[0][0])
                        # In memory these wait for nothing; a shared store's round trip
                        # has a timeout, which needs a task of its own.
                        await (self._wait(held, limits) if gw.store.dialect.shared else limits)
                        self._still(held)
                    held.passed = True
                got = self._queue(held, tiers)
                if isinstance(got, Ticket):  # most: nothing waited, nothing to check again
                    ticket = held.ticket = got
                else:
                    ticket = held.ticket = await got
                    self._still(held)
            while True:
                route = ticket.route
                if gw.stale(route):  # P6: a reload took its backend while it waited
                    gw.admission.release(ticket)
                    held.ticket = None
                    served = self._served(served.name)
                    tiers = served.tiers_for(held.group, gw.placeable, held.hop)
                    held.first = tiers[0]
                    if self._all_stale(tiers):
                        await self._wait(held, ready(tiers[0][0]))  # raises why
                    got = self._queue(held, tiers)
                    ticket = held.ticket = got if isinstance(got, Ticket) else await got
                    self._still(held)
                    continue
                endpoint = route.endpoint
                visit.admitted_mono = visit.admitted_mono or time.monotonic()
                if not endpoint.enter():
                    held.live.state = "loading"
                    began = time.monotonic()
                    try:
                        cause = (visit.key, visit.group, served.name)
                        await self._wait(held, enter_ready(route, cause))
                    except ApiError as exc:
                        if exc.code == RETIRED and gw.stale(route):
                            continue
                        raise
                    finally:
                        held.load_ms += (time.monotonic() - began) * 1000
                    held.entered = endpoint
                    self._still(held)
                held.entered = endpoint
                break
            self._admitted(held, served, ticket, held.load_ms - loaded)
        except Exception as exc:
            self._failed(held, exc)
        finally:
            held.task = None

    def _failed(self, held: Held, exc: Exception) -> None:
        """An acquire that ended without a slot (in an `except` clause: a bug is logged)."""
        if isinstance(exc, Rejected):
            self._refuse(held, too_many_requests(exc))
        elif isinstance(exc, ApiError):
            self._refuse(held, exc)
        elif isinstance(exc, _Withdrawn):
            self._release(held)  # what it got as it went (`_let_go` gave back the rest)
        else:
            log.exception("request=%s: acquiring for a worker failed", held.visit.request_id)
            self._refuse(held, ApiError(500, "corrallm hit an unexpected error admitting it."))

    def _all_stale(self, tiers: list[list[Route]]) -> bool:
        return all(self.gw.stale(r) for tier in tiers for r in tier)

    def _served(self, model: str) -> ServedModel:
        """The worker found `model` in its topology: here it can be missing only when a
        reload took it away meanwhile (P6)."""
        served = self.gw.topology.models.get(model)
        if served is None:
            raise not_found(
                f"The model '{quoted(model)}' was removed by a config reload while this "
                "request waited. GET /v1/models lists the models served.",
                code="model_not_found",
            )
        return served

    async def _limits(self, held: Held, first: Route) -> None:
        """T3 then S6: the key's (and its user's) rate windows, then the spend windows."""
        gw, visit, identity = self.gw, held.visit, held.identity
        if identity is not None and identity.limits is not None:
            asks = asks_of(identity, visit.user)
            if asks:
                estimate = gw.ledger.costs.estimate_tokens(first.config, visit.bytes_in, held.limit)
                verdict = gw.throttle.admit_now(asks, estimate)
                if verdict is None:
                    verdict = await gw.throttle.admit(asks, estimate)
                if not isinstance(verdict, Hold):
                    refused, remaining = verdict
                    held.headers = _text(remaining.headers())
                    self.owner.counts(asks, held.headers)
                    raise rate_limited(identity.name, refused)
                held.limits = verdict
                held.headers = _text(verdict.headers)
                self.owner.counts(asks, held.headers)
        key_limit = identity.spend_limit if identity is not None else None
        over = await gw.ledger.reserve(visit, first.config, held.limit, key_limit)
        if over is not None:
            raise spend_limited(over)

    def _limited(self, held: Held) -> bool:
        """Whether the request has limits to pass: its key's rate windows (T3), or a spend
        window of its lane or key (S6). Most have none: no coroutine for them."""
        identity = held.identity
        if identity is not None and (identity.limits is not None or identity.spend_limit):
            return True
        return held.visit.group in self.gw.ledger.spend

    def _queue(self, held: Held, tiers: list[list[Route]]) -> Ticket | Awaitable[Ticket]:
        """A slot, decided now (most requests get one without a task or a coroutine); a
        wait for one in a task of its own (its maxWait is a timeout on it)."""
        got = self.gw.admission.submit(
            held.visit.group, held.group, tiers, held.session, held.queued, held.stop
        )
        return got if isinstance(got, Ticket) else self._wait(held, got)

    async def _wait(self, held: Held, coro: Coroutine[Any, Any, T]) -> T:
        """What may really wait (a queue, a load, a shared store's round trip) runs in a
        task of its own: asyncio's timeouts need one (`eager` ran the rest in place),
        and it is what `_let_go` cancels when the worker stops waiting (the admission
        then hands on a slot granted in the same instant). Never the acquire itself:
        what the wait got as it was let go is given back by the acquire."""
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        held.waiting = task
        try:
            return await task
        except asyncio.CancelledError:
            if held.gone:
                raise _Withdrawn from None
            raise
        finally:
            held.waiting = None

    @staticmethod
    def _still(held: Held) -> None:
        """After a wait: the worker still waits for this request."""
        if held.gone:
            raise _Withdrawn

    def _admitted(self, held: Held, served: ServedModel, ticket: Ticket, loaded: float) -> None:
        """`loaded`: the ms this acquire waited for its backend's load (the worker's
        K4 headers and E2 spans tell it as load time)."""
        visit, route = held.visit, ticket.route
        visit.backend, visit.backend_id = route.config, route.id
        visit.degraded = served.degraded(route)
        visit.spilled = route not in held.first
        held.live.state = "running"
        answer = [
            route.id,
            route.endpoint.base_url,
            ticket.id,
            ticket.preemptible,
            held.headers,
            loaded,
            visit.admitted_mono,
            visit.spilled,
        ]
        self.send(Kind.ADMITTED, held.rid, encode(answer))

    def _refuse(self, held: Held, error: ApiError) -> None:
        self._release(held)
        fields = [
            error.status,
            error.message,
            error.code,
            error.type,
            error.param,
            error.headers,
            error.extra,
            error.recorded,
            held.headers,
        ]
        self.send(Kind.REFUSED, held.rid, encode(fields))

    # -- giving back -----------------------------------------------------------------------

    def _leave(self, held: Held) -> None:
        if held.entered is not None:
            held.entered.leave()
            held.entered = None

    def _release(self, held: Held, tokens: int = 0, dollars: float = 0.0) -> None:
        self._leave(held)
        if held.ticket is not None:
            self.gw.admission.release(held.ticket, tokens, dollars)
            held.ticket = None

    def _let_go(self, held: Held, tokens: int = 0, dollars: float = 0.0) -> None:
        """Whatever it holds is given back (it stopped waiting, or is over, or its worker
        is gone); a wait under way is cancelled."""
        held.gone = True
        if held.waiting is not None:
            # Cancelled on the loop's next turn: a task cancelled before its first turn
            # never runs its coroutine, and the admission's wait must run to withdraw.
            asyncio.get_running_loop().call_soon(held.waiting.cancel)
        self._release(held, tokens, dollars)

    def _done(self, rid: int, fields: list[Any]) -> None:
        """The request is over, settled by its worker (its row written there, its metrics
        coming with the worker's next `COUNTED`): what it held given back, its cost
        charged to its spend windows."""
        opening, status, prompt, completion, usd, wh, released, booked = fields
        held = self.held.pop(rid, None)
        visit = _visit(opening) if held is None else held.visit
        visit.status = status
        if held is not None:  # else refused before it asked for a slot (a gate of the config)
            if released is None:
                self._let_go(held)
            else:
                self._let_go(held, *released)
            self._end(held, prompt + completion if prompt is not None else 0)
        if booked:
            price = Price(wh, usd) if usd or wh else FREE
            self.gw.charge(visit, price, prompt or 0, completion)

    def _end(self, held: Held, tokens: int) -> None:
        """Its rate-limit hold and live entry given back (after `_let_go`)."""
        if held.limits is not None:
            self.gw.throttle.release(held.limits, tokens)
            held.limits = None
        self.gw.live.leave(held.live)

    def _settle(self, held: Held) -> None:
        """Settled here: its worker is gone (the visit as the owner knows it)."""
        visit = held.visit
        self._let_go(held)
        self._end(held, visit.metered.tokens if visit.metered else 0)
        self.gw.settle(visit)

    def _counted(self, ask: int) -> None:
        asked = self.asked.pop(ask, None)
        if asked is not None and not asked.done():
            asked.set_result(None)

    # -- the connection ------------------------------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        for ask in list(self.asked):
            self._counted(ask)  # nothing more will come: /metrics does not wait for it
        held, self.held = self.held, {}
        for one in held.values():
            one.visit.status = one.visit.status or 499
            one.visit.error = one.visit.error or "its worker process ended mid-request"
            self._settle(one)
        self.owner.left(self, len(held))


class _Withdrawn(Exception):
    """The worker stopped waiting for the acquire under way (`WITHDRAW`, `DONE`, or the
    end of its connection)."""


def _visit(fields: list[Any]) -> Visit:
    """The visit a worker opened: [key, group, model, endpoint, bytes in, request id,
    stream, user, arrived, arrived (monotonic)]."""
    key, group, model, endpoint, size, request_id, stream, user, arrived, arrived_mono = fields
    visit = Visit(key, group, model, endpoint, size, arrived, arrived_mono)
    visit.request_id, visit.stream, visit.user = request_id, stream, user
    return visit


def _text(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
