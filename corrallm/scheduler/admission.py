"""The async wrapper around the scheduling core: one owner applying its decisions.

A request `acquire()`s a ticket (admitted to one backend), does its work, and
`release()`s it. Queued requests wait on a future the core's `Admit`s resolve, bounded by
`maxWait`; a client that leaves withdraws. A `Preempt` decision cancels the victim's task
with the ticket's interrupt set to `PREEMPTED` first; the victim's handler then
requeues itself (nothing sent yet) or ends its stream at an event boundary (S4).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from corrallm.config.schema import Config, PolicyConfig, PriorityGroup
from corrallm.config.units import rfc3339
from corrallm.routing.affinity import Affinity
from corrallm.routing.choice import ranks
from corrallm.routing.router import Route
from corrallm.scheduler.core import (
    Admit,
    GroupSpec,
    Policy,
    Preempt,
    Queued,
    Reject,
    Request,
    Scheduler,
)
from corrallm.scheduler.leases import Lease, Leases
from corrallm.scheduler.ticket import Interrupt, Stop, Ticket

log = logging.getLogger("corrallm.scheduler")

BUILTIN_DEFAULT = PolicyConfig(queue=True)  # the built-in default group queues (SPEC §2)
REJECT = PolicyConfig(reject=True)  # a configured group without a "default" policy
# Every policy there is, made once (a frozen dataclass costs ~20 opcodes a request).
POLICIES = {
    (p, s, q): Policy(preempt=p, spill=s, queue=q)
    for p in (False, True)
    for s in (False, True)
    for q in (False, True)
}


class Rejected(Exception):
    """The caller cannot be served now (S5): everything a 429 needs."""

    def __init__(self, decision: Reject, reason: str) -> None:
        super().__init__(reason)
        self.decision = decision
        self.reason = reason


@dataclass
class Admission:
    config: Config
    routes: dict[str, Route]
    clock: Callable[[], float] = time.monotonic
    sessions: Affinity = field(default_factory=Affinity)  # K6: where conversations ran
    core: Scheduler = field(init=False)

    def __post_init__(self) -> None:
        scheduler = self.config.scheduler
        self.core = Scheduler(
            _groups(self.config), scheduler.max_queue_depth, scheduler.default_group
        )
        for route in self.routes.values():
            self.core.add_backend(route.id, route.config.max_concurrent)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[str]] = {}
        self._running: dict[int, Ticket] = {}
        self.held = Leases()  # who holds which lease (the core knows lanes only)

    def reconfigure(self, config: Config, routes: dict[str, Route]) -> None:
        """A config reload (SPEC §10 P6): lanes and slots change, requests in flight stay."""
        self.config = config
        # Routes of removed backends stay known until their queued requests are gone.
        self.routes = {**self.routes, **routes}
        capacities = {r.id: r.config.max_concurrent for r in routes.values()}
        scheduler = config.scheduler
        self._dispatch(
            self.core.reconfigure(
                _groups(config),
                scheduler.max_queue_depth,
                scheduler.default_group,
                capacities,
                self.clock(),
            )
        )

    # -- what a request does ---------------------------------------------------------

    async def acquire(
        self,
        group_name: str,
        group: PriorityGroup | None,
        tiers: Sequence[Sequence[Route]],
        affinity: str | None = None,
        on_queued: Callable[[int], None] | None = None,
        stop: Stop | None = None,
    ) -> Ticket:
        """A slot on one backend of `tiers`, waiting for it if the policy says so.
        `affinity`: the request's session key (K6); its conversation's last backend is
        preferred among equal ones while it has room. `on_queued` hears the request's id
        when it has to wait (to tell its client where it stands, K4)."""
        got = self.submit(group_name, group, tiers, affinity, on_queued, stop)
        return got if isinstance(got, Ticket) else await got

    def submit(
        self,
        group_name: str,
        group: PriorityGroup | None,
        tiers: Sequence[Sequence[Route]],
        affinity: str | None = None,
        on_queued: Callable[[int], None] | None = None,
        stop: Stop | None = None,
    ) -> Ticket | Coroutine[Any, Any, Ticket]:
        """`acquire()`'s decision, made now: the ticket, or the wait for one (to be
        awaited in a task: its `maxWait` is a timeout on that task). The relaying
        workers' owner admits most requests without a task of their own this way."""
        request = Request(next(self._ids), group_name, self.clock())
        first = tiers[0][0]
        policy = self._policy(group, first.config.type)
        # K6: one conversation's key is per served model (a session may span models).
        session = (first.model, affinity) if affinity is not None else None
        if len(tiers) == 1 and len(tiers[0]) == 1:  # perf (SPEC §13): most models
            ids, peers = [[first.id]], bool(first.config.peer)
        else:
            ids = [[r.id for r in tier] for tier in tiers]
            peers = any(r.config.peer for tier in tiers for r in tier)
        decision = self.core.submit(
            request,
            ids,
            policy,
            self.clock(),
            self.sessions.get(session) if session is not None else None,
            ranks(tiers, self.config.peer_order == "first") if peers else None,
        )
        if isinstance(decision, Reject):
            raise Rejected(
                decision, "saturated" if decision.reason == "saturated" else "queue_full"
            )
        if isinstance(decision, Preempt):
            self._preempt(decision.victim)
        interruptible = group is not None and group.interruptible
        if stop is None:
            stop = Stop(asyncio.current_task())
        ticket = Ticket(request.id, group_name, first, interruptible, stop)
        ticket.session = session
        if isinstance(decision, Admit):
            return self._admitted(ticket, decision.backend)
        assert isinstance(decision, Queued | Preempt)
        # Its place among the waiters now, not when the wait first runs: the owner of
        # `--workers` runs it in a task of its own, a loop turn later, and a slot freed
        # meanwhile (a worker's RELEASE read in the same turn) is handed to it here.
        future = self._expect(request.id)
        if on_queued is not None:
            on_queued(request.id)
        return self._wait(ticket, group, decision.backend, future)

    def release(self, ticket: Ticket, tokens: int = 0, dollars: float = 0.0) -> None:
        """The request is done; `tokens` and `dollars` charge lanes sharing in those."""
        if self._running.pop(ticket.id, None) is not None:
            currency = self.core.groups[ticket.group].spec.currency
            usage = float(tokens) if currency == "tokens" else dollars
            admits = self.core.release(ticket.id, self.clock(), usage)
            if admits:
                self._dispatch(admits)

    def evacuate(self, route_ids: set[str]) -> None:
        """X4: the requests running on these routes (a peer that went down) are cancelled,
        their interrupt `PEER_DOWN`; those queued there follow as their slots free (the
        pipeline sees the route stale and routes them again)."""
        for ticket in list(self._running.values()):
            why = ticket.interrupt
            if ticket.route.id in route_ids and (why is None or why.reason < Interrupt.PEER_DOWN):
                ticket.stop.interrupt(Interrupt.PEER_DOWN, ticket.route.id)

    async def requeue(self, ticket: Ticket, group: PriorityGroup | None) -> Ticket:
        """A preempted request that sent nothing waits again, at the head of its queue."""
        self._running.pop(ticket.id, None)
        ticket.stop.clear()
        backend = ticket.route.id
        future = self._expect(ticket.id)  # before the core may admit it at once
        self._dispatch(self.core.requeue(ticket.id, self.clock()))
        return await self._wait(ticket, group, backend, future)

    # -- leases (SPEC §7) --------------------------------------------------------------

    def lease(
        self,
        group: str,
        route: Route,
        slots: int,
        ttl: float,
        holder: str | None = None,
        ended: Callable[[Lease, float], None] | None = None,
    ) -> Lease:
        """Hold `slots` on the route's backend for `group` (V1), as `holder`'s lease (by
        default the lane's own); a lease of the same holder there is replaced (renewed)
        and ends now. `ended` hears the slot-seconds the lease held when it ends."""
        now = self.clock()
        lease = Lease(holder or group, group, route, slots, now, now + ttl, ended)
        old = self.held.put(lease)
        self._lane(group, route, now)
        if old is not None:
            if old.group != group:  # its key moved to another lane (a reload)
                self._lane(old.group, old.route, now)
            _end(old, now)
        return lease

    def leases(self) -> list[Lease]:
        """Live leases."""
        return self.held.live(self.clock())

    def unlease(self, holder: str, route: Route) -> Lease | None:
        """End `holder`'s lease on the route's backend early; None if it holds none."""
        lease = self.held.take(holder, route.id)
        if lease is not None:
            now = self.clock()
            self._lane(lease.group, route, now)
            _end(lease, now)
        return lease

    def expire_leases(self) -> None:
        now = self.clock()
        for lease in self.held.expired(now):
            self._lane(lease.group, lease.route, now)
            _end(lease, now)
        self._dispatch(self.core.expire_leases(now))

    def end_leases(self) -> None:
        """At shutdown: every lease ends now (each told what it held)."""
        now = self.clock()
        for lease in self.held.everything():
            self._lane(lease.group, lease.route, now)
            _end(lease, now)

    def _lane(self, group: str, route: Route, now: float) -> None:
        """The core's lease of `group` on the route's backend: its holders' together."""
        total = self.held.lane(group, route.id)
        if total is None:
            self._dispatch(self.core.unlease(group, route.id, now))
        else:
            self._dispatch(self.core.lease(group, route.id, total[0], total[1], now))

    # -- the machinery -----------------------------------------------------------------

    def _expect(self, request_id: int) -> asyncio.Future[str]:
        """Where the core's admission of a waiting request lands (`_dispatch`)."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    async def _wait(
        self,
        ticket: Ticket,
        group: PriorityGroup | None,
        backend: str,
        future: asyncio.Future[str],
    ) -> Ticket:
        max_wait = (group.max_wait if group else None) or self.config.scheduler.max_wait
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands
            # once the future is done, and a client gone at the instant it was admitted
            # would go on to the backend holding the slot (S7).
            async with asyncio.timeout(max_wait):
                admitted = await asyncio.shield(future)
        except TimeoutError:
            self._withdraw(ticket.id, future)
            capacity, in_flight, waiting = self.core.load(backend)
            raise Rejected(
                Reject(
                    ticket.id,
                    backend,
                    "saturated",
                    self.core.retry_after(backend),
                    capacity,
                    in_flight,
                    waiting,
                ),
                "max_wait_exceeded",
            ) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._admitted(ticket, future.result())
                self.release(ticket)  # admitted in the same instant: hand the slot on
            else:
                self._withdraw(ticket.id, future)
            raise
        return self._admitted(ticket, admitted)

    def _admitted(self, ticket: Ticket, backend: str) -> Ticket:
        ticket.route = self.routes[backend]
        self._running[ticket.id] = ticket
        if ticket.session is not None:
            self.sessions.put(ticket.session, backend)
        return ticket

    def _withdraw(self, request_id: int, future: asyncio.Future[str]) -> None:
        self._waiting.pop(request_id, None)
        future.cancel()
        self._dispatch(self.core.withdraw(request_id, self.clock()))

    def _dispatch(self, admits: list[Admit]) -> None:
        for admit in admits:
            future = self._waiting.pop(admit.request, None)
            if future is not None and not future.done():
                future.set_result(admit.backend)

    def _preempt(self, victim_id: int) -> None:
        victim = self._running.get(victim_id)
        if victim is None or victim.shielded:
            return  # it ends by itself; the hand-off admits the taker then
        # A stop with no task of its own here (a relaying worker's request, held by the
        # owner: corrallm/workers/held.py) passes the interrupt on to its worker.
        victim.stop.interrupt(Interrupt.PREEMPTED)

    def _policy(self, group: PriorityGroup | None, backend_type: str) -> Policy:
        if group is None:
            chosen = BUILTIN_DEFAULT
        else:
            chosen = group.on_saturated.get(backend_type) or group.on_saturated.get(
                "default", REJECT
            )
        return POLICIES[chosen.preempt, chosen.spill, chosen.queue]


def _end(lease: Lease, now: float) -> None:
    """Tell the lease's `ended` what it held; its failure must not stop the others'."""
    if lease.ended is None:
        return
    try:
        lease.ended(lease, lease.slot_seconds(now))
    except Exception:
        log.exception("lease of %s on %s: settling it failed", lease.holder, lease.route.id)


def _groups(config: Config) -> list[GroupSpec]:
    return [
        GroupSpec(
            name,
            weight=g.weight,
            currency=g.share_currency,
            interruptible=g.interruptible,
            max_queue_depth=g.max_queue_depth,
        )
        for name, g in config.priority_groups.items()
    ]


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


def live_leases(admission: Admission, holder: str | None = None) -> list[dict[str, Any]]:
    """Live leases (SPEC §7): who holds how many slots of which backend, until when;
    `holder`: only that key's. What GET /v1/reservations and the management API show."""
    now, clock = time.time(), admission.clock()
    return [
        {
            "model": lease.route.model,
            "backend": lease.route.id,
            "lane": lease.group,
            "key": lease.holder,
            "slots": lease.slots,
            "expires_at": rfc3339(now + lease.until - clock),
        }
        for lease in admission.leases()
        if holder is None or lease.holder == holder
    ]
