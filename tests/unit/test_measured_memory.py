"""R5, M2, M3 in the residency shell: measured memory beside the declaration (a warning
past 10 %), planning with the larger of the two, and GPU placement of a start.

No GPU here: NVML is replaced by a fake reader (the NVML reader itself needs a driver);
supervisors are moved through their states by hand, with no process behind them."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from corrallm.config.schema import BackendConfig as Backend
from corrallm.config.schema import Server
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Placement, Supervisor
from corrallm.lifecycle.transitions import Transitions
from corrallm.residency.manager import NoRoom, Residency, Tenancy

GB = 10**9


class FakeReader:
    def __init__(self, held: dict[str, int]) -> None:
        self.held = held
        self.asked: list[int] = []

    def read(self, pid: int) -> dict[str, int] | None:
        self.asked.append(pid)
        return self.held


async def probe(url: str) -> int | None:
    return None


def supervisor(tmp_path, sid: str, bus=None, pid: int = 4242) -> Supervisor:
    sup = Supervisor(sid, Backend(cmd=f"x {sid}", proxy="${PORT}"), probe, tmp_path)
    if bus is not None:
        sup.bus = bus
    sup.proc = SimpleNamespace(pid=pid)  # type: ignore[assignment]
    return sup


def setup(tmp_path, held: dict[str, int], **tenancy) -> tuple[Residency, Supervisor, FakeReader]:
    reader = FakeReader(held)
    server = Server(pools={"gpu0": 32 * GB, "system": 64 * GB})
    residency = Residency({"box": server}, reader=reader)
    sup = supervisor(tmp_path, "m#0")
    residency.track(Tenancy(sup, "box", **({"declared": {"gpu0": 10 * GB}} | tenancy)))
    return residency, sup, reader


async def test_R5_measured_memory_is_kept_beside_the_declaration(tmp_path, caplog):
    residency, sup, reader = setup(tmp_path, {"gpu0": int(10.5 * GB)})
    with caplog.at_level(logging.WARNING, "corrallm.residency"):
        await residency._measure(sup)
    assert reader.asked == [4242]
    assert residency.tenancies["m#0"].measured == {"gpu0": int(10.5 * GB)}
    assert not caplog.records  # within 10 %: no warning


async def test_R5_a_declaration_off_by_more_than_10_percent_is_warned(tmp_path, caplog):
    residency, sup, _ = setup(tmp_path, {"gpu0": 14 * GB})
    with caplog.at_level(logging.WARNING, "corrallm.residency"):
        await residency._measure(sup)
    assert "ramUsage mismatch backend=m#0 pool=gpu0 declared=10GB measured=14GB" in caplog.text


async def test_R5_M2_an_estimate_off_by_more_than_10_percent_is_warned_once(tmp_path, caplog):
    residency, sup, _ = setup(tmp_path, {"gpu0": 14 * GB}, declared=None, estimated={"gpu0": GB})
    with caplog.at_level(logging.WARNING, "corrallm.residency"):
        await residency._measure(sup)
        await residency._measure(sup)  # the next load: same backend, cmd and pool
    assert [r.getMessage() for r in caplog.records] == [
        "ramUsage mismatch backend=m#0 pool=gpu0 estimated=1GB measured=14GB: the estimate is "
        "off; planning uses the measurement plus 5 % from now on"
    ]


async def test_M2_only_pools_the_server_has_are_counted(tmp_path):
    residency, sup, _ = setup(tmp_path, {"gpu0": 9 * GB, "gpu3": GB, "system": 300 * 10**6})
    await residency._measure(sup)
    assert residency.tenancies["m#0"].measured == {"gpu0": 9 * GB, "system": 300 * 10**6}


async def test_M2_planning_uses_the_larger_of_declared_and_measured_times_1_05(tmp_path):
    residency, sup, _ = setup(tmp_path, {"gpu0": 9 * GB, "system": 300 * 10**6})
    await residency._measure(sup)
    assert residency.tenancies["m#0"].usage == {"gpu0": 10 * GB, "system": 315 * 10**6}


async def test_M2_a_reading_of_a_process_that_is_gone_is_dropped(tmp_path):
    residency, sup, reader = setup(tmp_path, {"gpu0": 20 * GB})
    original = reader.read

    def read_then_restart(pid: int) -> dict[str, int] | None:
        sup.proc = SimpleNamespace(pid=pid + 1)  # type: ignore[assignment]
        return original(pid)

    reader.read = read_then_restart  # type: ignore[method-assign]
    await residency._measure(sup)
    assert residency.tenancies["m#0"].measured is None


# -- M3: placement of a start ----------------------------------------------------------


def two_gpus(tmp_path, *sizes: int, reader=None, max_wait: float = 0.0):
    bus: Transitions[Supervisor] = Transitions()
    server = Server(pools={"gpu0": 24 * GB, "gpu1": 24 * GB}, gpus=["gpu0", "gpu1"])
    residency = Residency({"box": server}, max_wait=max_wait, bus=bus, reader=reader)
    sups = []
    for i, size in enumerate(sizes):
        sup = supervisor(tmp_path, f"m{i}#0", bus, pid=100 + i)
        residency.track(Tenancy(sup, "box", declared={"gpu": size * GB}, gpus=("gpu0", "gpu1")))
        sups.append(sup)
    return residency, sups


async def start(residency: Residency, sup: Supervisor) -> Placement:
    """What a supervisor's start does around its `room` seam, up to READY."""
    sup._move(State.STARTING)
    placement = await residency.make_room(sup)
    sup._move(State.READY)
    return placement


async def test_M3_the_second_start_is_placed_on_the_other_gpu(tmp_path, caplog):
    residency, (a, b) = two_gpus(tmp_path, 18, 18)
    with caplog.at_level(logging.INFO, "corrallm.residency"):
        placements = [await start(residency, a), await start(residency, b)]
    assert {
        "placements": placements,
        "placed": [residency.tenancies[s.id].placed for s in (a, b)],
        "used": residency.used("box"),
        "log": caplog.records[-1].getMessage(),
    } == {
        "placements": [Placement("0"), Placement("1")],
        "placed": ["gpu0", "gpu1"],
        "used": {"gpu0": 18 * GB, "gpu1": 18 * GB},
        "log": "place backend=m1#0 server=box gpu=gpu1 index=1 reason=fits without eviction "
        "(gpu0 would need 1) needs=gpu1 18GB evicts=-",
    }


async def test_M3_the_placement_is_given_back_when_the_process_stops(tmp_path):
    residency, (a,) = two_gpus(tmp_path, 18)
    await start(residency, a)
    for state in (State.DRAINING, State.STOPPING, State.STOPPED):
        a._move(state)
    tenancy = residency.tenancies["m0#0"]
    assert (tenancy.placed, tenancy.granted, residency.used("box")) == (None, False, {})


async def test_M3_a_start_not_yet_let_in_holds_no_memory(tmp_path):
    residency, (a, b) = two_gpus(tmp_path, 18, 18)
    b._move(State.STARTING)  # waiting for the server's lock, say: not counted anywhere
    assert (await start(residency, a), residency.used("box")) == (
        Placement("0"),
        {"gpu0": 18 * GB},
    )


async def test_M3_no_room_names_every_gpu_tried(tmp_path):
    residency, (a, b, c) = two_gpus(tmp_path, 18, 18, 18)
    await start(residency, a)
    await start(residency, b)
    a.in_flight = b.in_flight = 1  # both busy: nothing can be evicted
    c._move(State.STARTING)
    with pytest.raises(NoRoom) as caught:
        await residency.make_room(c)
    assert "No room on server 'box' on any of its GPUs gpu0, gpu1 for backend 'm2#0'" in str(
        caught.value
    )
    assert "short on gpu0 by gpu0 12GB; on gpu1 by gpu1 12GB" in str(caught.value)


async def test_M3_an_idle_resident_is_evicted_from_the_gpu_chosen(tmp_path, caplog):
    residency, (a, b, c) = two_gpus(tmp_path, 18, 10, 16)
    await start(residency, a)
    await start(residency, b)
    residency.tenancies[a.id].evict_cost = "high"
    unloaded: list[str] = []

    async def unload(sup: Supervisor) -> None:
        unloaded.append(sup.id)
        for state in (State.DRAINING, State.STOPPING, State.STOPPED):
            sup._move(state)

    for sup in (a, b):
        sup.unload = lambda force=False, sup=sup: unload(sup)  # type: ignore[method-assign]
    c._move(State.STARTING)
    with caplog.at_level(logging.INFO, "corrallm.residency"):
        placement = await residency.make_room(c)
    # One eviction either way; b (evictCost medium, a's is high) is the cheaper victim.
    assert (placement, unloaded) == (Placement("1"), ["m1#0"])
    assert "evict backend=m1#0 for=m2#0 server=box reason=evictCost=medium" in caplog.text
    assert "gpu=gpu1" in caplog.text
    assert caplog.text.count("place backend=m2#0") == 1  # one line for the decision


async def test_M2_M3_what_was_measured_on_the_placed_gpu_follows_the_backend(tmp_path):
    reader = FakeReader({"gpu1": 20 * GB})
    residency, (a, b) = two_gpus(tmp_path, 2, 16, reader=reader)
    await start(residency, a)  # on gpu0 (first in gpus; most free is the same)
    await start(residency, b)  # on gpu1: most free
    await asyncio.gather(*residency._tasks)  # the measurements after READY
    tenancy = residency.tenancies["m1#0"]
    assert (tenancy.measured, tenancy.usage, tenancy.measured_here) == (
        {"gpu": 20 * GB},
        {"gpu1": 21 * GB},
        {"gpu1": 20 * GB},
    )


async def test_M3_a_reload_keeps_where_a_running_process_was_placed(tmp_path):
    residency, (a, b) = two_gpus(tmp_path, 18, 18)
    await start(residency, a)
    await start(residency, b)
    fresh = [Tenancy(s, "box", declared={"gpu": 18 * GB}, gpus=("gpu0", "gpu1")) for s in (a, b)]
    residency.reconfigure(residency.servers, 0.0, fresh)
    assert residency.used("box") == {"gpu0": 18 * GB, "gpu1": 18 * GB}
