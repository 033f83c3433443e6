"""The hop of `serve --workers N` (corrallm/workers/), driven in process: frames fed to
the owner's end with a real (unstarted) `Gateway` behind it, its answers read back from
a fake transport. What a worker holds is given back whatever ends it: its `DONE`, its
`WITHDRAW`, or its connection (S7, and the worker-death fault: nothing leaks)."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from corrallm.config import load_config_text
from corrallm.cost.ledger import Visit
from corrallm.cost.model import Metered
from corrallm.gateway import Gateway
from corrallm.observe.metrics import Tally
from corrallm.workers.held import WorkerLink
from corrallm.workers.hop import HEAD, Kind, Link, eager, encode, frame
from corrallm.workers.owner import Owner
from corrallm.workers.remote import OwnerLink

CONFIG = """
models:
  m: {backends: [{proxy: "http://127.0.0.1:9", maxConcurrent: 1}]}
"""
OPENING = [None, "default", "m", "/v1/chat/completions", 80, "req-{}", False, None, 1e9, 1.0]
DONE_200 = [None, 200, 5, 16, 0.0, 0.0, None, True]  # its row written by its worker


class Wire:
    """A transport that keeps what is written, as frames."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closed

    def frames(self) -> list[tuple[int, int, Any]]:
        out, at = [], 0
        while at < len(self.data):
            length, kind, rid = HEAD.unpack_from(self.data, at)
            payload = bytes(self.data[at + 9 : at + 9 + length])
            out.append((kind, rid, orjson.loads(payload) if payload else None))
            at += 9 + length
        self.data.clear()
        return out

    def heads(self) -> list[tuple[int, int]]:
        """The kind and number of each frame written (for pickled payloads)."""
        out, at = [], 0
        while at < len(self.data):
            length, kind, rid = HEAD.unpack_from(self.data, at)
            out.append((kind, rid))
            at += 9 + length
        self.data.clear()
        return out


@pytest.fixture
async def owner(tmp_path: Path) -> tuple[Gateway, WorkerLink, Wire]:
    gw = Gateway(load_config_text(CONFIG), tmp_path)
    link = WorkerLink(Owner(gw, "127.0.0.1:1", "token"))
    wire = Wire()
    link.connection_made(wire)  # type: ignore[arg-type]
    return gw, link, wire


def acquire(link: WorkerLink, rid: int) -> None:
    opening = [*OPENING[:5], OPENING[5].format(rid), *OPENING[6:]]
    link.frame(Kind.ACQUIRE, rid, encode([opening, "m", 16, None, False]))


async def turns(n: int = 10) -> None:
    """Let the loop run a few turns (a wait's task, its cancel, the corked writes)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def answers(wire: Wire) -> list[tuple[int, int, Any]]:
    await asyncio.sleep(0)  # the corked writes go out at the end of the loop's turn
    return wire.frames()


def load(gw: Gateway) -> tuple[int, int, int]:
    return gw.admission.core.load("m#0")


async def test_a_slot_is_admitted_at_once_and_given_back_by_release_and_done(owner) -> None:
    gw, link, wire = owner
    acquire(link, 1)
    assert link.held[1].task is None  # nothing waited: no task was made for it
    [(kind, rid, fields)] = await answers(wire)
    assert (kind, rid, fields[:2], fields[3]) == (
        Kind.ADMITTED,
        1,
        ["m#0", "http://127.0.0.1:9"],
        False,
    )
    assert fields[6] == gw.live.get("req-1").visit.admitted_mono  # type: ignore[union-attr]
    assert [r["state"] for r in gw.live.views()] == ["running"]
    link.frame(Kind.RELEASE, 1, encode([21, 0.0]))
    link.frame(Kind.DONE, 1, encode(DONE_200))
    assert (load(gw), gw.live.views(), link.held) == ((1, 0, 0), [], {})


async def test_S3_a_done_carries_the_release_that_came_with_it(tmp_path: Path) -> None:
    """One message where a request's end gives its slot back: the lane is charged the
    tokens its release carries (fairshare in tokens), then the request is over."""
    config = CONFIG + "priorityGroups:\n  default: {shareCurrency: tokens}\n"
    gw = Gateway(load_config_text(config), tmp_path)
    link = WorkerLink(Owner(gw, "127.0.0.1:1", "token"))
    link.connection_made(Wire())  # type: ignore[arg-type]
    acquire(link, 1)
    await asyncio.sleep(0)
    link.frame(Kind.DONE, 1, encode([None, 200, 5, 16, 0.0, 0.0, [21, 0.0], True]))
    assert (load(gw), gw.live.views(), link.held) == ((1, 0, 0), [], {})
    assert gw.admission.core.groups["default"].usage == pytest.approx(21, rel=1e-3)


async def test_C1_S6_a_done_charges_the_cost_its_worker_settled_to_the_spend_window(
    tmp_path: Path,
) -> None:
    config = CONFIG + "priorityGroups:\n  default: {spendLimit: {usd: 10, window: 1h}}\n"
    gw = Gateway(load_config_text(config), tmp_path)
    link = WorkerLink(Owner(gw, "127.0.0.1:1", "token"))
    link.connection_made(Wire())  # type: ignore[arg-type]
    acquire(link, 1)
    await asyncio.sleep(0)
    link.frame(Kind.DONE, 1, encode([None, 200, 5, 16, 0.25, 1.5, [21, 0.25], True]))
    assert gw.ledger.spend["default"].spent(time.time()) == pytest.approx(0.25)
    assert gw.activity._pending == []  # the worker wrote its row


async def test_C6_O3_metrics_counted_by_a_worker_are_added_to_the_owners() -> None:
    """/metrics shows one gateway: a worker's counts (`COUNTED`) add to the owner's,
    histograms bucket by bucket."""
    visit = Visit("k", "default", "m", "/v1/chat/completions", 80, 1e9, 1.0)
    visit.backend_id, visit.status, visit.admitted_mono = "m#0", 200, 1.0
    visit.metered = Metered(5, 16)
    worker = Tally()
    worker.visit(visit, 0.5, 2.0)
    worker.visit(visit, 0.5, 2.0)
    taken = worker.take()
    assert taken is not None and worker.take() is None  # taken once, then nothing new
    owner = Tally()
    owner.visit(visit, 0.5, 2.0)
    owner.add(orjson.loads(orjson.dumps(taken)))  # as it crosses the hop
    assert owner.requests[("m", "m#0", "default", "200")] == 3
    assert owner.tokens[("m", "default", "completion")] == 48
    assert owner.cost[("m", "default")] == pytest.approx(1.5)
    queue = owner.latency.series[("m", "default")][0]
    assert sum(queue[:-1]) == 3  # three observations of the queue wait, one bucket each


async def test_C6_reading_metrics_asks_every_worker_for_its_counts_first(owner) -> None:
    gw, link, wire = owner
    link.owner.links.add(link)
    scrape = asyncio.ensure_future(gw.metrics.scrape())
    await asyncio.sleep(0)
    [(kind, ask, _)] = await answers(wire)
    assert kind == Kind.TALLY and not scrape.done()
    visit = Visit(None, "default", "m", "/v1/chat/completions", 80, 1e9, 1.0)
    visit.backend_id, visit.status = "m#0", 200
    counts = Tally()
    counts.visit(visit, 0.0, 0.0)
    link.frame(Kind.COUNTED, ask, encode(counts.take()))
    body = (await asyncio.wait_for(scrape, 5)).decode()
    assert 'corrallm_requests_total{backend="m#0",group="default",model="m",status="200"} 1.0' in (
        body
    )


async def test_a_request_over_leaves_no_cycle_for_the_garbage_collector(owner) -> None:
    """SPEC §13: what the owner made for a request is freed by reference counting when it
    is over. Cycles (a held request and its stop pointing at each other) left six objects
    a request for the collector, whose passes over them cost ~1 µs a request."""
    _, link, wire = owner
    acquire(link, 1)
    link.frame(Kind.DONE, 1, encode(DONE_200))
    await answers(wire)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for rid in range(2, 12):
            acquire(link, rid)
            link.frame(Kind.DONE, rid, encode(DONE_200))
        await answers(wire)
        gc.collect()
        assert gc.garbage == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_S7_a_request_withdrawn_in_the_turn_it_queued_leaves_nothing_behind(owner) -> None:
    gw, link, wire = owner
    acquire(link, 1)
    acquire(link, 2)
    link.frame(Kind.WITHDRAW, 2, b"")  # before its wait's task ever ran
    link.frame(Kind.RELEASE, 1, encode([21, 0.0]))  # the slot it would have had frees
    await turns()
    assert load(gw) == (1, 0, 0)
    assert [k for k, _, _ in wire.frames()] == [Kind.ADMITTED, Kind.QUEUED]


async def test_S7_a_queued_request_withdrawn_leaves_nothing_queued(owner) -> None:
    gw, link, wire = owner
    acquire(link, 1)
    acquire(link, 2)
    assert link.held[2].task is not None  # it waits, in a task of its own
    kinds = [k for k, _, _ in await answers(wire)]
    assert kinds == [Kind.ADMITTED, Kind.QUEUED]
    link.frame(Kind.WITHDRAW, 2, b"")
    await turns()
    assert load(gw) == (1, 1, 0)
    link.frame(Kind.DONE, 2, encode(DONE_200))
    link.frame(Kind.DONE, 1, encode(DONE_200))  # DONE alone gives back its slot too
    assert (load(gw), link.held) == ((1, 0, 0), {})


async def test_a_queued_request_is_admitted_when_the_slot_frees(owner) -> None:
    gw, link, wire = owner
    acquire(link, 1)
    acquire(link, 2)
    await answers(wire)
    link.frame(Kind.RELEASE, 1, encode([21, 0.0]))
    await turns()  # the admission's future, its wait's task, the acquire, the write
    assert [(k, r) for k, r, _ in wire.frames()] == [(Kind.ADMITTED, 2)]
    assert load(gw) == (1, 1, 0)


async def test_a_worker_gone_frees_what_its_requests_held_and_settles_them(owner) -> None:
    gw, link, wire = owner
    acquire(link, 1)  # running
    acquire(link, 2)  # queued
    await answers(wire)
    link.connection_lost(None)
    await turns()
    assert (load(gw), gw.live.views(), link.held) == ((1, 0, 0), [], {})
    assert gw.metrics.requests[("m", "m#0", "default", "499")] == 1  # the running one
    assert gw.metrics.requests[("m", "", "default", "499")] == 1  # the queued one


async def test_a_paused_model_is_refused_by_the_owner(owner) -> None:
    gw, link, wire = owner
    gw.pauses.until[("model", "m")] = None
    acquire(link, 1)
    [(kind, _, fields)] = await answers(wire)
    assert (kind, fields[0], fields[2]) == (Kind.REFUSED, 503, "paused")
    assert load(gw) == (1, 0, 0)


async def test_S4_O1_interrupts_go_to_the_worker_holding_the_request(owner) -> None:
    gw, link, wire = owner
    acquire(link, 1)
    await answers(wire)
    live = gw.live.get("req-1")
    assert live is not None
    gw.live.cancel("req-1")
    [(kind, rid, fields)] = await answers(wire)
    assert (kind, rid, fields) == (Kind.INTERRUPT, 1, [5, ""])  # Interrupt.CANCELLED


async def test_a_release_rides_on_the_done_that_follows_it_else_goes_alone() -> None:
    """The worker's end: a slot given back as a request ends goes in its DONE (one
    message); one that no DONE follows in the same step goes as a RELEASE of its own at
    the end of the loop's turn, and before anything else said of that request."""
    link = OwnerLink(None)  # type: ignore[arg-type]  # (what it sends needs no runtime)
    wire = Wire()
    link.connection_made(wire)  # type: ignore[arg-type]
    link.release(1, 21, 0.5)
    assert link.claim(1) == [21, 0.5]
    link.send(Kind.DONE, 1, encode([None, 200]))
    link.release(2, 0, 0.0)  # P6: routed again, its next ACQUIRE follows
    link.send(Kind.ACQUIRE, 2, encode([None, "m", None, None, False]))
    link.release(3, 7, 0.0)  # nothing follows in this step
    await turns(3)
    assert [(k, r) for k, r, _ in wire.frames()] == [
        (Kind.DONE, 1),
        (Kind.RELEASE, 2),
        (Kind.ACQUIRE, 2),
        (Kind.RELEASE, 3),
    ]


class Frames(Link):
    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[int, int, bytes]] = []

    def frame(self, kind: int, rid: int, payload: bytes) -> None:
        self.got.append((kind, rid, payload))


async def test_P6_T2_a_change_is_answered_once_every_worker_has_applied_it(owner) -> None:
    gw, link, wire = owner
    link.owner.links.add(link)
    await asyncio.wait_for(gw.in_force(), 1)  # nothing pushed: nothing to wait for
    gw.reconfigure(load_config_text(CONFIG))  # a reload: the config (and keys) go out
    settled = asyncio.ensure_future(gw.in_force())
    await turns()
    assert wire.heads() == [(Kind.CONFIG, 1), (Kind.KEYS, 2)] and not settled.done()
    link.frame(Kind.APPLIED, 1, b"")
    await turns()
    assert not settled.done()  # the keys are not in force there yet
    link.frame(Kind.APPLIED, 2, b"")
    await asyncio.wait_for(settled, 1)
    gw.keys.load([])  # a key revoked: pushed once, whoever pushes it first
    settled = asyncio.ensure_future(gw.in_force())
    await turns()
    assert wire.heads() == [(Kind.KEYS, 3)] and not settled.done()
    link.frame(Kind.APPLIED, 3, b"")
    await asyncio.wait_for(settled, 1)


async def test_P6_a_worker_that_never_applies_a_change_delays_its_answer_one_second(
    owner, monkeypatch, caplog
) -> None:
    gw, link, _ = owner
    link.owner.links.add(link)
    monkeypatch.setattr("corrallm.workers.owner.APPLIED_SECONDS", 0.05)
    gw.reconfigure(load_config_text(CONFIG))
    await asyncio.wait_for(gw.in_force(), 1)
    assert "did not apply change 2" in caplog.text
    link.owner.left(link, 0)  # a worker gone is not waited for
    gw.reconfigure(load_config_text(CONFIG))
    await asyncio.wait_for(gw.in_force(), 0.04)


def test_frames_are_read_whole_however_the_bytes_arrive() -> None:
    link = Frames()
    data = frame(Kind.RELEASE, 7, b"[1,2]") + frame(Kind.WITHDRAW, 8) + frame(Kind.DONE, 9, b"x")
    for cut in (data[:3], data[3:12], data[12:20], data[20:]):
        link.data_received(cut)
    assert link.got == [(Kind.RELEASE, 7, b"[1,2]"), (Kind.WITHDRAW, 8, b""), (Kind.DONE, 9, b"x")]


async def test_eager_runs_to_the_first_wait_and_a_task_carries_on_from_there() -> None:
    steps: list[str] = []
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def quick() -> None:
        steps.append("quick")

    async def slow() -> None:
        steps.append("before")
        try:
            steps.append(await gate)
        except asyncio.CancelledError:
            steps.append("cancelled")

    assert eager(quick()) is None and steps == ["quick"]
    task = eager(slow())
    assert task is not None and steps == ["quick", "before"]
    gate.set_result("after")
    await task
    assert steps == ["quick", "before", "after"]
    gate2: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    gate = gate2
    task = eager(slow())
    assert task is not None
    await asyncio.sleep(0)  # (a cancel before the task's first turn never reaches `slow`)
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert steps[-1] == "cancelled"
