"""SPEC §6 S4/S7, §10 P6, §16 K4, §21 O1, X4: the request pipeline replaying scripted histories, as
test_supervisor.py does for the supervisor. The runtime is a fake (`World`: the real
admission and live-request owners, fake endpoints, a ledger that never refuses), the
surface's work is a script that says how far its answer got (`admitted.progress`), and
whoever stops a request does it as the gateway would: the admission preempts or evacuates,
the live registry cancels, the client's watch sees it leave. No process, socket or sleep.

Each test is a sequence of events and one equality assert on the history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from corrallm.auth.callers import Caller, Callers
from corrallm.auth.keys import KeyRing
from corrallm.config import Config, load_config_text
from corrallm.cost.ledger import Visit
from corrallm.http.errors import ApiError
from corrallm.lifecycle.errors import RETIRED
from corrallm.lifecycle.state import State
from corrallm.observe.events import EventBus
from corrallm.observe.live import LiveRequests
from corrallm.observe.spans import SpanRecord
from corrallm.observe.traces import Tracer
from corrallm.proxy.forward import DisconnectWatch
from corrallm.proxy.pipeline import Admitted, Inbound, Pipeline
from corrallm.proxy.runtime import Runtime
from corrallm.routing.router import Route, ServedModel
from corrallm.scheduler.admission import Admission

CONFIG = """
priorityGroups:
  batch: {weight: 1, interruptible: true}
  urgent: {weight: 10, onSaturated: {default: {preempt: true, queue: true}}}
keys: {batch-key: batch, urgent-key: urgent}
models:
  m:
    backends:
      - {name: one, proxy: "http://127.0.0.1:9", maxConcurrent: 1}
"""


@dataclass
class FakeEndpoint:
    id: str
    state: State = State.READY
    base_url: str = "http://127.0.0.1:9"
    in_flight: int = 0
    last_used: float = 0.0
    up: bool = True

    async def ensure_ready(self, cause: tuple[str | None, str, str] | None = None) -> None:
        return None

    def available(self) -> bool:
        return self.up

    def enter(self) -> bool:
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1


class _Price:
    cost_usd = 0.0


class _Ledger:
    async def reserve(self, *_: Any) -> None:
        return None

    def price(self, visit: Visit) -> _Price:
        return _Price()


@dataclass
class World:
    """A fake `Runtime`: one model, its routes swappable (a reload), stale routes named."""

    config: Config = field(default_factory=lambda: load_config_text(CONFIG))
    history: list[str] = field(default_factory=list)
    settled: list[Visit] = field(default_factory=list)
    retired: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.served_model = self._model("one")
        self.admission = Admission(self.config, {r.id: r for r in self.served_model.routes})
        self.ledger: Any = _Ledger()
        self.throttle: Any = None
        self.live = LiveRequests(EventBus())
        self.tracer: Tracer | None = None  # E2: set by a test that traces
        ring = KeyRing()
        ring.reconfigure(self.config.keys)
        self.callers = Callers(self.config, ring)

    def _model(self, backend: str) -> ServedModel:
        model = self.config.models["m"]
        routes = [Route(f"m#{backend}", "m", model.backends[0], FakeEndpoint(backend))]
        return ServedModel("m", model, routes)

    def reload(self, backend: str) -> Route:
        """P6: the model's backend replaced by a new one; the old one retired."""
        old = self.served_model.primary
        self.retired.add(old.id)
        self.served_model = self._model(backend)
        self.admission.reconfigure(self.config, {r.id: r for r in self.served_model.routes})
        return self.served_model.primary

    @property
    def models(self) -> dict[str, ServedModel]:
        return {"m": self.served_model}

    @property
    def served(self) -> list[ServedModel]:
        return [self.served_model]

    def caller(self, key: str | None, signed: str | None = None) -> Caller:
        return self.callers(key, signed)

    def user_header(self) -> bytes | None:
        return None

    def paused(self, kind: str, name: str) -> bool:
        return False

    def stale(self, route: Route) -> bool:
        return route.id in self.retired or not route.endpoint.available()

    def placeable(self, route: Route) -> bool:
        return True

    def upstream_idle(self, route: Route) -> float:
        return 5.0

    def peer_failed(self, route: Route, message: str) -> None:
        self.history.append(f"peer {route.id} failed")

    def settle(self, visit: Visit) -> None:
        self.settled.append(visit)


def _runtime(world: World) -> Runtime:
    return world  # type: ignore[return-value]  # the fake owners are duck-typed


@pytest.fixture
def world() -> World:
    return World()


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


Script = Callable[[Admitted], Awaitable[int]]


class Surface:
    """A surface's work, scripted: each attempt logs where it runs and waits for `go`;
    `stream` begins a stream that an interruption may end (rendered into the history),
    `body` a held answer that none may cut."""

    def __init__(self, world: World, name: str, begin: str | None = None) -> None:
        self.world, self.name, self.begin = world, name, begin
        self.go = asyncio.Event()
        self.attempts = 0
        self.fail: ApiError | None = None

    async def __call__(self, admitted: Admitted) -> int:
        self.attempts += 1
        log = self.world.history
        log.append(f"{self.name} on {admitted.route.id}")
        if self.begin == "stream":
            admitted.progress.begin(self._render)
        elif self.begin == "body":
            admitted.progress.begin()
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        await self.go.wait()
        log.append(f"{self.name} done")
        return 200

    async def _render(self, error: ApiError) -> None:
        self.world.history.append(f"{self.name} ends with {error.code}")


def start(
    world: World,
    work: Surface,
    key: str = "batch-key",
    watch: Callable[[], DisconnectWatch] | None = None,
) -> asyncio.Task[None]:
    pipeline = Pipeline(_runtime(world))

    async def run() -> None:
        try:
            await pipeline.run(Inbound("m", "/v1/chat/completions", key), work, watch and watch())
        except ApiError as exc:
            world.history.append(f"{work.name} refused {exc.status} {exc.code}")

    return asyncio.create_task(run())


async def holder_then(
    world: World,
    holder: Surface,
    second: Surface,
    key: str = "batch-key",
    watch: Callable[[], DisconnectWatch] | None = None,
) -> tuple[asyncio.Task[None], asyncio.Task[None]]:
    """`holder` takes the model's one slot, then `second` arrives: queued behind it, or
    preempting it with the urgent key."""
    first = start(world, holder)
    await turns()
    later = start(world, second, key, watch)
    await turns()
    return first, later


def leaving() -> tuple[asyncio.Event, Callable[[], DisconnectWatch]]:
    """A client that goes away once the event is set, and how its watch is made."""
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    return gone, lambda: DisconnectWatch(receive)


def live_id(world: World, index: int = 0) -> str:
    return [v["id"] for v in world.live.views()][index]


async def test_S4_a_preempted_request_that_sent_nothing_waits_again_and_is_served(
    world: World,
) -> None:
    victim, taker = Surface(world, "victim"), Surface(world, "taker")
    first, second = await holder_then(world, victim, taker, "urgent-key")
    taker.go.set()
    victim.go.set()
    await asyncio.gather(first, second)
    assert (world.history, [(v.preempted, v.status) for v in world.settled]) == (
        ["victim on m#one", "taker on m#one", "taker done", "victim on m#one", "victim done"],
        [(False, 200), (True, 200)],  # the taker settled first
    )


class Spans:
    """A tracer's sink that keeps what it is given (E2)."""

    def __init__(self) -> None:
        self.got: list[list[SpanRecord]] = []

    def export(self, trace_id: int, spans: Sequence[SpanRecord]) -> None:
        self.got.append(list(spans))

    def close(self) -> None:
        pass


async def test_E2_S4_a_preempted_request_is_one_trace_one_queue_one_upstream_span(
    world: World,
) -> None:
    sink = Spans()
    world.tracer = Tracer(sink)
    victim, taker = Surface(world, "victim"), Surface(world, "taker")
    first = start(world, victim)
    await turns()
    second = start(world, taker, "urgent-key")
    await turns()
    taker.go.set()
    victim.go.set()
    await asyncio.gather(first, second)
    names = [[s.name for s in spans] for spans in sink.got]
    assert names == [["chat m", "queue", "upstream"], ["chat m", "queue", "upstream"]]
    victim_spans = sink.got[1]  # the taker settled first
    request, queue, upstream = victim_spans
    assert request.start_ns <= queue.start_ns <= queue.end_ns <= upstream.start_ns
    assert upstream.end_ns == request.end_ns


async def test_S4_a_stream_under_way_is_ended_at_an_event_boundary_when_preempted(
    world: World,
) -> None:
    victim, taker = Surface(world, "victim", "stream"), Surface(world, "taker")
    first, second = await holder_then(world, victim, taker, "urgent-key")
    taker.go.set()
    await asyncio.gather(first, second)
    assert (world.history, victim.attempts) == (
        ["victim on m#one", "victim ends with preempted", "taker on m#one", "taker done"],
        1,
    )


async def test_S4_a_held_answer_is_not_cut_by_a_preemption_the_taker_waits(
    world: World,
) -> None:
    victim, taker = Surface(world, "victim", "body"), Surface(world, "taker")
    first, second = await holder_then(world, victim, taker, "urgent-key")
    victim.go.set()
    taker.go.set()
    await asyncio.gather(first, second)
    assert world.history == ["victim on m#one", "victim done", "taker on m#one", "taker done"]


async def test_O1_a_request_cancelled_while_queued_is_a_503_cancelled(world: World) -> None:
    holder, waiter = Surface(world, "holder"), Surface(world, "waiter")
    first, second = await holder_then(world, holder, waiter)
    world.live.cancel(live_id(world, 1))
    await turns()
    holder.go.set()
    await asyncio.gather(first, second)
    assert world.history == ["holder on m#one", "waiter refused 503 cancelled", "holder done"]


async def test_O1_a_request_cancelled_before_its_answer_began_is_a_503_cancelled(
    world: World,
) -> None:
    work = Surface(world, "req")
    task = start(world, work)
    await turns()
    world.live.cancel(live_id(world))
    await task
    assert world.history == ["req on m#one", "req refused 503 cancelled"]


async def test_O1_a_stream_cancelled_mid_way_ends_with_the_dialects_error_event(
    world: World,
) -> None:
    work = Surface(world, "req", "stream")
    task = start(world, work)
    await turns()
    world.live.cancel(live_id(world))
    await task
    assert (world.history, world.settled[0].status) == (
        ["req on m#one", "req ends with cancelled"],
        503,
    )


async def test_P6_a_reload_retiring_the_backend_while_queued_routes_the_request_again(
    world: World,
) -> None:
    holder, waiter = Surface(world, "holder"), Surface(world, "waiter")
    first, second = await holder_then(world, holder, waiter)
    world.reload("two")
    holder.go.set()
    waiter.go.set()
    await asyncio.gather(first, second)
    assert world.history == ["holder on m#one", "holder done", "waiter on m#two", "waiter done"]


async def test_P6_a_retired_backend_mid_request_is_routed_again_when_nothing_was_sent(
    world: World,
) -> None:
    work = Surface(world, "req")
    old = world.served_model.primary

    async def retire_then(admitted: Admitted) -> int:
        if admitted.route is old:
            world.reload("two")
            world.history.append("req on m#one")
            raise ApiError(502, "backend 'm#one' was retired by a reload", RETIRED)
        return await work(admitted)

    work.go.set()
    pipeline = Pipeline(_runtime(world))
    await pipeline.run(Inbound("m", "/v1/chat/completions", "batch-key"), retire_then)
    assert world.history == ["req on m#one", "req on m#two", "req done"]


async def test_X4_a_peer_down_before_the_head_routes_the_request_again(world: World) -> None:
    work = Surface(world, "req")
    task = start(world, work)
    await turns()
    old = world.served_model.primary
    world.reload("two")
    world.retired.discard(old.id)
    assert isinstance(old.endpoint, FakeEndpoint)
    old.endpoint.up = False  # stale because its peer is down
    world.admission.evacuate({old.id})
    await turns()
    work.go.set()
    await task
    assert world.history == ["req on m#one", "req on m#two", "req done"]


async def test_X4_a_peer_down_after_the_head_ends_the_stream_with_peer_down(
    world: World,
) -> None:
    work = Surface(world, "req", "stream")
    task = start(world, work)
    await turns()
    world.admission.evacuate({world.served_model.primary.id})
    await task
    assert (world.history, world.settled[0].status) == (
        ["req on m#one", "req ends with peer_down"],
        503,
    )


async def test_S7_a_client_gone_mid_request_is_recorded_as_499(world: World) -> None:
    work = Surface(world, "req", "stream")
    gone, watch = leaving()
    task = start(world, work, watch=watch)
    await turns()
    gone.set()
    await task
    assert (world.history, world.settled[0].status) == (["req on m#one"], 499)


async def test_S7_a_client_gone_while_queued_frees_its_place_as_499(world: World) -> None:
    holder, waiter = Surface(world, "holder"), Surface(world, "waiter")
    gone, watch = leaving()
    first, second = await holder_then(world, holder, waiter, watch=watch)
    gone.set()
    await turns()
    holder.go.set()
    await asyncio.gather(first, second)
    assert (world.history, sorted(v.status for v in world.settled)) == (
        ["holder on m#one", "holder done"],
        [200, 499],
    )


async def test_S4_an_upstream_that_falls_silent_is_a_504_and_its_slot_is_freed(
    world: World,
) -> None:
    work, after = Surface(world, "req"), Surface(world, "after")
    work.fail = ApiError(504, "backend 'm#one' sent nothing for 5s", "upstream_timeout")
    await start(world, work)
    after.go.set()
    await start(world, after)
    assert world.history == [
        "req on m#one",
        "req refused 504 upstream_timeout",
        "after on m#one",
        "after done",
    ]


class Stalling(Admission):
    """An admission whose thread loses 20 ms inside `acquire` and then admits at once, as
    on a busy machine (another thread holding the GIL, the process descheduled)."""

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        lost = time.monotonic() + 0.02
        while time.monotonic() < lost:  # the stall itself: no await, nothing queued
            pass
        return await super().acquire(*args, **kwargs)


async def test_K4_queue_ms_count_only_a_wait_in_a_queue(world: World) -> None:
    world.admission = Stalling(world.config, {r.id: r for r in world.served_model.routes})
    holder, waiter = Surface(world, "holder"), Surface(world, "waiter")
    first, second = await holder_then(world, holder, waiter)
    holder.go.set()
    waiter.go.set()
    await asyncio.gather(first, second)
    # The holder was admitted at once (0 ms, whatever the stall); the waiter queued.
    assert [(v.queue_ms > 0, v.status) for v in world.settled] == [(False, 200), (True, 200)]
