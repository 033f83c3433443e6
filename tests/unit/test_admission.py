"""S1, S4, S5, S7, V2, P6, K6: `Admission`, the async owner applying the scheduling core's
decisions, on its race paths. A real event loop, a fake clock and routes whose endpoints
are plain fakes: no process, no socket, no wall-clock sleep. Each test is an event
sequence and one equality assert on what was observed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from corrallm.config.schema import BackendConfig as Backend
from corrallm.config.schema import Config, PriorityGroup
from corrallm.config.schema import PolicyConfig as Policy
from corrallm.config.schema import SchedulerConfig as Scheduler
from corrallm.lifecycle.state import State
from corrallm.routing.router import Route
from corrallm.scheduler.admission import Admission, Rejected, Ticket

LO = PriorityGroup(weight=1, interruptible=True)  # queues (the default policy)
HI = PriorityGroup(weight=10, on_saturated={"default": Policy(preempt=True, queue=True)})


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeEndpoint:
    """What a route needs of a backend's process; Admission never touches it."""

    id: str
    state: State = State.READY
    base_url: str = "http://127.0.0.1:9"
    in_flight: int = 0
    last_used: float = 0.0

    async def ensure_ready(self, cause: tuple[str | None, str, str] | None = None) -> None:
        return None

    def available(self) -> bool:
        return True

    def enter(self) -> bool:
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1


def route(backend: str, slots: int = 1) -> Route:
    config = Backend(proxy="http://127.0.0.1:9", max_concurrent=slots)
    return Route(backend, "m", config, FakeEndpoint(backend))


def admission(
    *routes: Route, groups: dict[str, PriorityGroup] | None = None, max_wait: float = 60.0
) -> tuple[Admission, Clock]:
    clock = Clock()
    config = Config(priority_groups=groups or {}, scheduler=Scheduler(max_wait=max_wait))
    return Admission(config, {r.id: r for r in routes}, clock=clock), clock


async def settle() -> None:
    """Let every ready callback and task run (the loop's own order; no wall clock)."""
    for _ in range(20):
        await asyncio.sleep(0)


@dataclass
class Worker:
    """A request's handler as the pipeline drives it: acquire, work until told to finish,
    release. A preemption of work not yet begun requeues it (S4); a shielded ticket is
    never cancelled. What happens is appended to the shared `log`."""

    name: str
    adm: Admission
    lane: str
    group: PriorityGroup | None
    tiers: list[list[Route]]
    log: list[str]
    shielded: bool = False
    finish: asyncio.Event = field(default_factory=asyncio.Event)
    ticket: Ticket | None = None
    task: asyncio.Task[None] | None = None

    def start(self) -> Worker:
        self.task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        ticket = await self.adm.acquire(self.lane, self.group, self.tiers)
        while True:
            self.ticket = ticket
            if self.shielded:
                ticket.progress.begin()  # a body under way that cannot be cut
            self.log.append(f"{self.name} admitted on {ticket.route.id}")
            try:
                await self.finish.wait()
                break
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not (ticket.preempted and task is not None and task.uncancel() == 0):
                    raise
                self.log.append(f"{self.name} preempted")
                ticket = await self.adm.requeue(ticket, self.group)
        self.adm.release(ticket)
        self.log.append(f"{self.name} released")


def outcome(task: asyncio.Task[Ticket]) -> str:
    if not task.done():
        return "waiting"
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return (
        f"rejected: {exc.reason}" if isinstance(exc, Rejected) else f"on {task.result().route.id}"
    )


async def test_S7_admitted_in_the_same_instant_as_cancelled_hands_the_slot_on():
    b = route("b")
    adm, _ = admission(b)
    first = await adm.acquire("default", None, [[b]])
    second = asyncio.create_task(adm.acquire("default", None, [[b]]))
    third = asyncio.create_task(adm.acquire("default", None, [[b]]))
    await settle()
    # The slot frees (its Admit goes to the second) as the second's client leaves.
    adm.release(first)
    second.cancel()
    await settle()
    seen = [outcome(second), outcome(third), adm.core.load("b")]
    assert seen == ["cancelled", "on b", (1, 1, 0)]


async def test_S1_a_slot_freed_before_a_submitted_wait_first_runs_is_not_lost():
    # `submit`'s wait runs a loop turn later where the workers' owner runs it (a task of
    # its own): a release meanwhile admits it all the same, not a future made later.
    b = route("b")
    adm, _ = admission(b, max_wait=1.0)
    first = await adm.acquire("default", None, [[b]])
    wait = adm.submit("default", None, [[b]])
    assert not isinstance(wait, Ticket)
    adm.release(first)  # the core admits the waiter now
    ticket = await asyncio.wait_for(wait, 0.5)
    assert [ticket.route.id, adm.core.load("b")] == ["b", (1, 1, 0)]


async def test_S7_a_client_that_leaves_the_queue_withdraws_and_takes_no_slot():
    b = route("b")
    adm, _ = admission(b)
    first = await adm.acquire("default", None, [[b]])
    leaving = asyncio.create_task(adm.acquire("default", None, [[b]]))
    await settle()
    waiting_before = adm.core.load("b")
    leaving.cancel()
    await settle()
    adm.release(first)
    await settle()
    assert [waiting_before, outcome(leaving), adm.core.load("b")] == [
        (1, 1, 1),
        "cancelled",
        (1, 0, 0),
    ]


async def test_S4_a_shielded_victim_is_not_cancelled_and_the_taker_is_admitted_when_it_releases():
    b = route("b")
    adm, _ = admission(b, groups={"lo": LO, "hi": HI})
    log: list[str] = []
    victim = Worker("victim", adm, "lo", LO, [[b]], log, shielded=True).start()
    await settle()
    taker = Worker("taker", adm, "hi", HI, [[b]], log).start()
    await settle()
    log.append(f"victim preempted={victim.ticket.preempted if victim.ticket else None}")
    victim.finish.set()
    await settle()
    taker.finish.set()
    await settle()
    assert log == [
        "victim admitted on b",
        "victim preempted=False",
        "victim released",
        "taker admitted on b",
        "taker released",
    ]


async def test_S4_a_preempted_victim_that_sent_nothing_is_requeued_at_the_head_of_its_queue():
    b = route("b")
    adm, clock = admission(b, groups={"lo": LO, "hi": HI})
    log: list[str] = []
    victim = Worker("victim", adm, "lo", LO, [[b]], log).start()
    await settle()
    clock.now = 1.0
    later = Worker("later", adm, "lo", LO, [[b]], log).start()  # queued behind the victim
    await settle()
    clock.now = 2.0
    taker = Worker("taker", adm, "hi", HI, [[b]], log).start()
    await settle()
    for worker in (taker, victim, later):
        clock.now += 1.0
        worker.finish.set()
        await settle()
    assert log == [
        "victim admitted on b",
        "victim preempted",
        "taker admitted on b",
        "taker released",
        "victim admitted on b",
        "victim released",
        "later admitted on b",
        "later released",
    ]


async def test_S5_max_wait_expiry_raises_rejected_and_withdraws_the_request():
    b = route("b")
    adm, _ = admission(b, max_wait=0.001)
    first = await adm.acquire("default", None, [[b]])
    with pytest.raises(Rejected) as rejected:
        await adm.acquire("default", None, [[b]])
    after_expiry = adm.core.load("b")
    adm.release(first)  # nobody is left to admit: the expired request withdrew
    await settle()
    seen = [rejected.value.reason, rejected.value.decision.backend, after_expiry]
    assert [*seen, adm.core.load("b")] == ["max_wait_exceeded", "b", (1, 1, 0), (1, 0, 0)]


async def test_V2_a_lease_reduces_the_capacity_other_lanes_see_until_it_expires():
    b = route("b", slots=2)
    lanes = {"holder": PriorityGroup(), "other": PriorityGroup()}
    adm, clock = admission(b, groups=lanes)
    log: list[str] = []
    adm.lease("holder", b, 1, ttl=60.0)
    one = Worker("other-1", adm, "other", lanes["other"], [[b]], log).start()
    two = Worker("other-2", adm, "other", lanes["other"], [[b]], log).start()
    await settle()
    holder = Worker("holder", adm, "holder", lanes["holder"], [[b]], log).start()
    await settle()
    holder.finish.set()  # its reserved slot is free again, but still reserved
    await settle()
    clock.now = 61.0
    log.append("lease expired")
    adm.expire_leases()
    await settle()
    for worker in (one, two):
        worker.finish.set()
    await settle()
    assert log == [
        "other-1 admitted on b",
        "holder admitted on b",
        "holder released",
        "lease expired",
        "other-2 admitted on b",
        "other-1 released",
        "other-2 released",
    ]


async def test_P6_reconfigure_keeps_running_tickets_and_hands_out_new_slots():
    b = route("b", slots=1)
    adm, _ = admission(b)
    log: list[str] = []
    running = Worker("running", adm, "default", None, [[b]], log).start()
    queued = Worker("queued", adm, "default", None, [[b]], log).start()
    await settle()
    wider = route("b", slots=2)
    adm.reconfigure(Config(), {"b": wider})
    await settle()
    log.append(f"load {adm.core.load('b')}")
    for worker in (running, queued):
        worker.finish.set()
        await settle()
    log.append(f"load {adm.core.load('b')}")
    assert log == [
        "running admitted on b",
        "queued admitted on b",
        "load (2, 2, 0)",
        "running released",
        "queued released",
        "load (2, 0, 0)",
    ]


async def test_S1_queued_requests_of_one_lane_are_admitted_first_in_first_out():
    b = route("b")
    adm, clock = admission(b)
    log: list[str] = []
    workers: list[Worker] = []
    for name in ("w1", "w2", "w3"):
        clock.now += 1.0
        workers.append(Worker(name, adm, "default", None, [[b]], log).start())
        await settle()
    for worker in workers:
        worker.finish.set()
        await settle()
    assert log == [
        "w1 admitted on b",
        "w1 released",
        "w2 admitted on b",
        "w2 released",
        "w3 admitted on b",
        "w3 released",
    ]


async def test_K6_a_conversation_returns_to_its_backend_while_it_has_room():
    b1, b2 = route("b1", slots=2), route("b2", slots=2)
    adm, _ = admission(b1, b2)
    tier = [[b1, b2]]
    first = await adm.acquire("default", None, tier, "chat-x")
    adm.release(first)
    other = await adm.acquire("default", None, tier, "chat-y")  # in turn: the other one
    adm.release(other)
    follow_ups = [await adm.acquire("default", None, tier, "chat-x") for _ in range(3)]
    seen = [first.route.id, other.route.id, *(t.route.id for t in follow_ups)]
    home, away = first.route.id, other.route.id
    assert seen == [home, away, home, home, away]  # the third finds it full: no waiting


async def test_K6_a_conversation_that_waited_is_remembered_where_it_was_admitted():
    b1, b2 = route("b1"), route("b2")
    adm, _ = admission(b1, b2)
    tier = [[b1, b2]]
    running = [await adm.acquire("default", None, tier) for _ in range(2)]
    waiting = asyncio.create_task(adm.acquire("default", None, tier, "chat-x"))
    await settle()
    adm.release(next(t for t in running if t.route.id == "b1"))  # it queued on b1
    await settle()
    assert [outcome(waiting), adm.sessions.get(("m", "chat-x"))] == ["on b1", "b1"]


async def test_T5_a_lanes_leases_are_its_holders_together_each_told_what_it_held():
    b = route("b", slots=4)
    adm, clock = admission(b, groups={"team": PriorityGroup()})
    told: list[tuple[str, float]] = []

    def ended(lease, slot_seconds: float) -> None:
        told.append((lease.holder, slot_seconds))

    adm.lease("team", b, 1, ttl=10.0, holder="ann", ended=ended)
    adm.lease("team", b, 2, ttl=30.0, holder="bob", ended=ended)
    both = dict(adm.core.backends["b"].leases)
    clock.now = 5.0
    adm.lease("team", b, 1, ttl=10.0, holder="ann", ended=ended)  # renewed: its 5 s end
    clock.now = 15.0
    adm.expire_leases()  # ann's renewal (1 slot, 5 s to 15 s) expires: 10 slot-seconds
    bob_only = dict(adm.core.backends["b"].leases)
    released = adm.unlease("bob", b)
    assert adm.unlease("bob", b) is None
    assert [both, bob_only, told, adm.core.backends["b"].leases, adm.held.held("team")] == [
        {"team": (3, 30.0)},
        {"team": (2, 30.0)},
        [("ann", 5.0), ("ann", 10.0), ("bob", 30.0)],
        {},
        0,
    ]
    assert released is not None and released.holder == "bob"
