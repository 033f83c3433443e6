"""SPEC §11 D1, §14: the economics ledger as a long-lived owner, fed by the one transition
bus and reading the config in force from the residency (faked here), the clock passed in."""

from __future__ import annotations

from dataclasses import dataclass, field

from corrallm.cost.economics import Economics
from corrallm.lifecycle.state import State
from corrallm.lifecycle.transitions import Transitions
from corrallm.store.db import Store

GB = 10**9


@dataclass
class Proc:
    id: str
    state: State = State.STOPPED
    last_load_seconds: float | None = None
    last_wake_seconds: float | None = None


@dataclass
class Held:
    supervisor: Proc
    need: dict[str, int]
    sleep_usage: dict[str, int] | None = None


@dataclass
class Server:
    pools: dict[str, int]


@dataclass
class Residency:
    tenancies: dict[str, Held] = field(default_factory=dict)
    servers: dict[str, Server] = field(default_factory=dict)

    def configure(self, *procs: tuple[Proc, int]) -> None:
        """What a reload does to the residency: the new tenancies replace the old."""
        self.tenancies = {p.id: Held(p, {"gpu0": gpu, "ram": 5 * GB}) for p, gpu in procs}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def move(bus: Transitions, proc: Proc, *states: State) -> None:
    for new in states:
        old, proc.state = proc.state, new
        bus.moved(proc, old, new)  # type: ignore[arg-type]


def wake(bus: Transitions, proc: Proc, seconds: float) -> None:
    proc.last_load_seconds = seconds
    move(bus, proc, State.STARTING, State.READY)


def sleep(bus: Transitions, proc: Proc) -> None:
    move(bus, proc, State.DRAINING, State.STOPPING, State.STOPPED)


def ledger(price: float | None = 2.0) -> tuple[Economics, Transitions, Residency, Clock]:
    bus, clock = Transitions(), Clock()
    residency = Residency(servers={"box": Server({"gpu0": 8 * GB, "ram": 64 * GB})})
    economics = Economics(bus, Store(None), residency, lambda: price, clock)  # type: ignore[arg-type]
    return economics, bus, residency, clock


def rows(economics: Economics) -> dict[str, dict[str, object]]:
    return {r["backend"]: r for r in economics.view()["rows"]}


def test_D1_wakes_sleeps_time_asleep_and_gpu_hours_are_counted():
    economics, bus, residency, clock = ledger()
    a = Proc("a#0")
    residency.configure((a, 2 * GB))
    economics.view()  # first seen (at start, a view, a transition or a checkpoint)
    clock.now += 3600  # an hour asleep before its first start: asleep, but nothing given back
    wake(bus, a, 1.5)
    clock.now += 600
    sleep(bus, a)
    clock.now += 1800
    view = economics.view()
    (row,) = view["rows"]
    assert row == {
        "backend": "a#0",
        "asleep_now": True,
        "wakes": 1,
        "sleeps": 1,
        "asleep_seconds": 5400.0,
        "wake_count": 1,
        "wake_seconds_last": 1.5,
        "wake_seconds_avg": 1.5,
        "wake_seconds_max": 1.5,
        "gpu_footprint": 2 * GB,
        "gpu_hours": 0.5 * 2 / 8,  # the half hour after its sleep only
        "first_seen": 1_000_000.0,
    }
    assert (view["gpu_capacity"], view["gpu_hours"], view["avoided_usd"]) == (8 * GB, 0.125, 0.25)


def test_D1_a_backend_that_never_loaded_avoided_nothing():
    """Issue 30: a model that was never loaded held no GPU memory, so its time stopped
    gave nothing back: no GPU-hours, no avoided cost (its time asleep still shows)."""
    economics, bus, residency, clock = ledger()
    never, failed = Proc("never#0"), Proc("failed#0")
    residency.configure((never, 4 * GB), (failed, 4 * GB))
    economics.view()
    clock.now += 1800
    move(bus, failed, State.STARTING, State.FAILED)  # a start that never got to ready
    clock.now += 1800
    economics._fold("never#0", clock.now)  # as a checkpoint does
    view = economics.view()
    assert [(r["backend"], r["asleep_seconds"], r["gpu_hours"]) for r in view["rows"]] == [
        ("failed#0", 3600.0, 0.0),
        ("never#0", 3600.0, 0.0),
    ]
    assert (view["gpu_hours"], view["avoided_usd"]) == (0.0, 0.0)


def test_W1_D1_a_real_sleep_and_its_wake_count_like_a_stop_and_a_start_but_return_less():
    economics, bus, residency, clock = ledger()
    a = Proc("a#0")
    residency.configure((a, 4 * GB))
    residency.tenancies["a#0"].sleep_usage = {"gpu0": GB, "ram": 5 * GB}
    wake(bus, a, 20.0)  # a cold start
    clock.now += 60
    move(bus, a, State.DRAINING, State.ASLEEP)  # W1: asleep, keeping 1 GB of the GPU
    clock.now += 3600  # an hour asleep hands back 3 of its 4 GB of the 8 GB GPU
    a.last_wake_seconds = 1.25
    move(bus, a, State.WAKING)
    clock.now += 1.25
    move(bus, a, State.READY)
    clock.now += 60
    move(bus, a, State.DRAINING, State.ASLEEP)
    clock.now += 10
    move(bus, a, State.WAKING, State.ASLEEP)  # no room to wake: no wake, no second sleep
    clock.now += 3590
    move(bus, a, State.STOPPING, State.STOPPED)  # a sleeper stopped: the same sleep goes on
    clock.now += 3600  # stopped, all 4 GB are back
    row = rows(economics)["a#0"]
    assert {k: row[k] for k in ("wakes", "sleeps", "asleep_now", "wake_count")} | {
        "asleep_hours": round(row["asleep_seconds"] / 3600, 6),
        "wake_seconds": (row["wake_seconds_last"], row["wake_seconds_avg"]),
        "gpu_hours": round(row["gpu_hours"], 6),
    } == {
        "wakes": 2,
        "sleeps": 2,
        "asleep_now": True,
        "wake_count": 2,
        "asleep_hours": round((3600 + 10 + 3590 + 3600) / 3600, 6),
        "wake_seconds": (1.25, (20.0 + 1.25) / 2),
        "gpu_hours": round((1 + 10 / 3600 + 3590 / 3600) * 3 / 8 + 4 / 8, 6),
    }


def test_D1_a_failed_start_is_not_a_sleep():
    economics, bus, residency, _clock = ledger()
    a = Proc("a#0")
    residency.configure((a, GB))
    move(bus, a, State.STARTING, State.FAILED)
    assert (rows(economics)["a#0"]["wakes"], rows(economics)["a#0"]["sleeps"]) == (0, 0)


def test_D1_P6_after_a_reload_every_backend_of_the_new_config_has_a_row_and_is_counted():
    economics, bus, residency, clock = ledger()
    kept, removed = Proc("kept#0"), Proc("removed#0")
    residency.configure((kept, GB), (removed, GB))
    wake(bus, kept, 1.0)
    assert set(rows(economics)) == {"kept#0", "removed#0"}

    added = Proc("added#0")
    residency.configure((kept, GB), (added, 4 * GB))  # the reload: one subscription, no rewiring
    assert set(rows(economics)) == {"kept#0", "added#0"}
    assert rows(economics)["added#0"]["asleep_now"] is True

    clock.now += 100
    sleep(bus, kept)
    wake(bus, kept, 2.0)
    wake(bus, added, 3.0)
    got = rows(economics)
    assert (got["kept#0"]["wakes"], got["kept#0"]["sleeps"]) == (2, 1)
    assert (got["added#0"]["wakes"], got["added#0"]["wake_seconds_last"]) == (1, 3.0)
    assert got["added#0"]["asleep_seconds"] == 100.0  # asleep from when the reload added it
    assert got["added#0"]["gpu_footprint"] == 4 * GB


def test_D1_a_backend_a_reload_removed_stops_counting_time_asleep():
    economics, _bus, residency, clock = ledger()
    gone = Proc("gone#0")
    residency.configure((gone, GB))
    economics.view()
    clock.now += 10
    residency.configure()
    economics.view()
    clock.now += 1000
    assert economics.counters["gone#0"].asleep_seconds == 10.0
    assert economics.view()["rows"] == []


async def test_D1_C5_counters_are_kept_in_the_store_and_added_to_after_a_restart(tmp_path):
    first, bus, residency, _clock = ledger()
    first.store = Store(tmp_path / "corrallm.db")
    await first.store.open()
    a = Proc("a#0")
    residency.configure((a, GB))
    await first.start()
    wake(bus, a, 1.0)
    sleep(bus, a)
    await first.stop()
    await first.store.close()

    second, bus, residency, _clock = ledger()
    second.store = Store(tmp_path / "corrallm.db")
    await second.store.open()
    residency.configure((Proc("a#0"), GB))
    await second.start()
    try:
        a = residency.tenancies["a#0"].supervisor
        wake(bus, a, 3.0)
        row = rows(second)["a#0"]
        assert (row["wakes"], row["sleeps"], row["wake_seconds_avg"]) == (2, 1, 2.0)
    finally:
        await second.stop()
        await second.store.close()


def test_D1_no_price_no_avoided_cost():
    economics, _, _, _ = ledger(price=None)
    view = economics.view()
    assert (view["gpu_hour_price"], view["avoided_usd"], view["rows"]) == (None, None, [])
