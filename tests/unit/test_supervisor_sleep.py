"""SPEC §18 W1/W2: the supervisor's sleep, wake and slot caches, replayed with the scripted
fakes of test_supervisor.py (no process, no network): each test is a sequence of events
and one equality assert on the history of transitions, process calls and backend calls."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from corrallm.lifecycle.pidrecords import PidRecords
from corrallm.lifecycle.slots import slot_file
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from tests.support.scripted import World, failure, until

VLLM = {"kind": "vllm", "level": 1}


class Calls:
    """The backend's own API: every call is written to the history; `answers` maps a
    path (without the origin) to (status, body), anything else answers 200 {}."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.sleeping = False
        self.answers: dict[str, tuple[int | None, bytes]] = {}

    async def __call__(
        self, method: str, url: str, body: Any, within: float
    ) -> tuple[int | None, bytes]:
        path = url.split("5800", 1)[1]
        self.world.mark(f"{method} {path}")
        await asyncio.sleep(0)
        if path in self.answers:
            return self.answers[path]
        if path.startswith("/sleep"):
            self.sleeping = True
        elif path == "/wake_up":
            self.sleeping = False
        elif path == "/is_sleeping":
            return 200, json.dumps({"is_sleeping": self.sleeping}).encode()
        return 200, b"{}"


def sleeper(world: World, **spec: object) -> tuple[Supervisor, Calls]:
    sup = world.supervisor(**{"sleep": VLLM, **spec})
    calls = Calls(world)
    sup.call = calls
    world.probe.status = 200
    return sup, calls


async def test_W1_a_sleep_drains_then_calls_sleep_and_requests_wake_it_once(world: World) -> None:
    sup, _ = sleeper(world)
    await sup.ensure_ready()
    assert await sup.fall_asleep()
    await asyncio.gather(*(sup.ensure_ready() for _ in range(3)))  # coalesced (L2)
    assert world.history == [
        "stopped->starting",
        "spawn 101",
        "starting->ready",
        "ready->draining",
        "POST /sleep?level=1",
        "GET /is_sleeping",
        "draining->asleep",
        "asleep->waking",
        "POST /wake_up",
        "GET /is_sleeping",
        "waking->ready",
    ]


async def test_W1_a_sleep_waits_for_requests_in_flight(world: World) -> None:
    sup, _ = sleeper(world)
    await sup.ensure_ready()
    assert sup.enter()
    sleeping = asyncio.ensure_future(sup.fall_asleep())
    await until(lambda: sup.state is State.DRAINING)
    world.mark(f"enter refused: {not sup.enter()}")
    sup.leave()
    assert await sleeping
    assert world.history[3:] == [
        "ready->draining",
        "enter refused: True",
        "POST /sleep?level=1",
        "GET /is_sleeping",
        "draining->asleep",
    ]


async def test_W1_a_failed_sleep_stops_the_process(world: World) -> None:
    sup, calls = sleeper(world)
    calls.answers["/sleep?level=1"] = (500, b'{"error": "no"}')
    await sup.ensure_ready()
    assert not await sup.fall_asleep()
    assert world.history[3:] == [
        "ready->draining",
        "POST /sleep?level=1",
        "draining->stopping",
        "stop_group 101",
        "stopping->stopped",
    ]


async def test_W1_a_failed_wake_falls_back_to_a_restart(world: World) -> None:
    sup, calls = sleeper(world)
    await sup.ensure_ready()
    await sup.fall_asleep()
    calls.answers["/wake_up"] = (500, b'{"error": "cuda oom"}')
    del world.history[:]
    await sup.ensure_ready()
    assert (world.history, "wake failed: POST" in "\n".join(sup.logs.tail(20))) == (
        [
            "asleep->waking",
            "POST /wake_up",
            "waking->stopping",
            "stop_group 101",
            "stopping->stopped",
            "stopped->starting",
            "spawn 102",
            "starting->ready",
        ],
        True,
    )


async def test_W1_unload_pause_and_exit_of_a_sleeper(world: World) -> None:
    seen = []
    for how in ("unload", "pause", "exit"):
        sup, _ = sleeper(world)
        await sup.ensure_ready()
        await sup.fall_asleep()
        del world.history[:]
        if how == "unload":
            await sup.unload()
        elif how == "pause":
            await sup.pause()
        else:
            assert sup.pid is not None
            world.processes.exit(sup.pid, 9)
            await until(lambda s=sup: s.state is State.FAILED)
        seen.append((how, [h for h in world.history if "->" in h]))
    assert seen == [
        ("unload", ["asleep->stopping", "stopping->stopped"]),
        ("pause", ["asleep->stopping", "stopping->stopped", "stopped->paused"]),
        ("exit", ["asleep->stopping", "stopping->failed"]),
    ]


async def test_W1_a_sleeper_is_not_probed_but_its_pid_record_says_asleep(world: World) -> None:
    sup, _ = sleeper(world, health={"interval": "1s"})
    await sup.ensure_ready()
    await sup.fall_asleep()
    asked = world.probe.asked
    for _ in range(5):
        await world.clock.sleep(1)
    record = PidRecords(world.home).read(sup.id)
    assert (world.probe.asked - asked, record is not None and record.asleep) == (0, True)


async def test_W1_re_adoption_keeps_a_sleeper_asleep_or_stops_it(world: World) -> None:
    outcomes = []
    for still_sleeping in (True, False):
        first, calls = sleeper(world)
        await first.ensure_ready()
        await first.fall_asleep()
        record = PidRecords(world.home).read(first.id)
        assert record is not None
        first.proc = None  # corrallm "died": the process lives on
        first.state = State.STOPPED
        second = world.supervisor(sleep=VLLM)
        second.id = first.id
        second.call = calls
        calls.sleeping = still_sleeping
        del world.history[:]
        adopted = await second.adopt(record)
        outcomes.append((adopted, second.state, [h for h in world.history if "->" in h]))
        await second.stop()
    assert outcomes == [
        (True, State.ASLEEP, ["stopped->starting", "starting->asleep"]),
        (
            False,
            State.STOPPED,
            ["stopped->starting", "starting->ready", "ready->stopping", "stopping->stopped"],
        ),
    ]


async def test_W1_no_room_to_wake_leaves_it_asleep(world: World) -> None:
    from corrallm.lifecycle.errors import LifecycleError

    sup, _ = sleeper(world)

    async def no_room(_: Supervisor):
        raise LifecycleError("no room")

    await sup.ensure_ready()
    await sup.fall_asleep()
    sup.room = no_room
    del world.history[:]
    message = await failure(asyncio.ensure_future(sup.ensure_ready()))
    assert (message, world.history) == (
        "LifecycleError: no room",
        ["asleep->waking", "waking->asleep"],
    )


async def test_W2_slots_are_saved_before_a_stop_and_restored_before_ready(
    world: World, tmp_path: Path
) -> None:
    saves = tmp_path / "slots"
    saves.mkdir()
    sup = world.supervisor(
        cmd="llama-server --slot-save-path slots --port ${PORT}", slotSave=True, cwd=str(tmp_path)
    )
    calls = Calls(world)
    calls.answers["/slots"] = (200, json.dumps([{"id": 0, "id_task": 3}, {"id": 1}]).encode())
    calls.answers["/slots/0?action=save"] = (200, b'{"n_saved": 40}')
    calls.answers["/slots/0?action=restore"] = (200, b'{"n_restored": 40}')
    sup.call = calls
    world.probe.status = 200
    await sup.ensure_ready()  # nothing saved yet: nothing restored
    await sup.unload()
    (saves / slot_file(sup.id, 0)).write_bytes(b"kv")  # what llama-server wrote
    await sup.ensure_ready()
    assert world.history == [
        "stopped->starting",
        "spawn 101",
        "GET /slots",
        "starting->ready",
        "ready->draining",
        "GET /slots",
        "POST /slots/0?action=save",
        "draining->stopping",
        "stop_group 101",
        "stopping->stopped",
        "stopped->starting",
        "spawn 102",
        "GET /slots",
        "POST /slots/0?action=restore",
        "starting->ready",
    ]
