"""SPEC §4 L2-L6, §10 P1: the supervisor replaying scripted histories, like honcho's
tests/test_manager.py. The process manager, the health probe, the clock and the sleep are
fakes: no process is started and no test sleeps beyond event-loop turns.

Each test is a sequence of events and one equality assert on the history: the supervisor's
transitions (`stopped->starting`), the calls it made to the process manager (`spawn 101`,
`stop_group 101`) and the test's own marks, in the order they happened.
"""

from __future__ import annotations

import asyncio

from corrallm.config.schema import BackendConfig as Backend
from corrallm.lifecycle.pidrecords import PidRecord
from corrallm.lifecycle.starting import HEALTH_POLL_SECONDS
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from tests.support.scripted import CMD, World, failure, until


async def test_L2_concurrent_cold_starts_coalesce_into_one_spawn(world: World) -> None:
    sup = world.supervisor()
    world.probe.status = 200
    await asyncio.gather(*(sup.ensure_ready() for _ in range(5)))
    assert world.history == ["stopped->starting", "spawn 101", "starting->ready"]


async def test_L3_exit_while_starting_fails_every_waiter_at_once_with_the_log_tail(
    world: World,
) -> None:
    sup = world.supervisor()
    waiters = [asyncio.ensure_future(sup.ensure_ready()) for _ in range(3)]
    await until(lambda: world.processes.running)
    exited_at = world.clock()
    world.processes.exit(101, 3, "error: failed to load model 'm.gguf'")
    errors = {await failure(w) for w in waiters}
    waited = world.clock() - exited_at
    (message,) = errors  # every waiter got the same answer
    assert (
        world.history,
        waited <= HEALTH_POLL_SECONDS,  # at once: not at the 120 s health timeout
        message.split(". ")[0],
        "retries in 1.0s" in message,
        "\nerror: failed to load model 'm.gguf'\n" in message,  # its last words
    ) == (
        ["stopped->starting", "spawn 101", "stop_group 101", "starting->failed"],
        True,
        "BackendFailed: backend 'm#0' failed to start: exited with code 3 while starting",
        True,
        True,
    )


async def test_L1_a_picked_port_that_another_program_answers_on_is_picked_again(
    world: World,
) -> None:
    """The health answer came from a stranger on the port picked for ${PORT} (it bound
    the port first): that start is reaped and the next one gets another port."""
    sup = world.supervisor(proxy="${PORT}")
    world.probe.status = 200
    world.processes.port_holders = ["pid 7 (other-server --port 1)", None]
    await sup.ensure_ready()
    assert (world.history, len(world.processes.ports), sup.base_url) == (
        ["stopped->starting", "spawn 101", "stop_group 101", "spawn 102", "starting->ready"],
        2,
        f"http://127.0.0.1:{world.processes.ports[1]}",
    )


async def test_L1_a_fixed_port_held_by_another_program_fails_the_start_naming_it(
    world: World,
) -> None:
    sup = world.supervisor(proxy="5800")
    world.probe.status = 200
    world.processes.port_holders = ["pid 7 (other-server --port 5800)"]
    message = await failure(asyncio.ensure_future(sup.ensure_ready()))
    assert (world.history, sup.failure_reason, message.split(". ")[0]) == (
        ["stopped->starting", "spawn 101", "stop_group 101", "starting->failed"],
        "port_taken",
        "BackendFailed: backend 'm#0' failed to start: port 5800 is held by pid 7 "
        "(other-server --port 5800), not by this backend (it answered the health check "
        "in the backend's place): stop that program, or give this backend another port "
        "in `proxy`",
    )


async def test_L1_picked_ports_taken_every_time_fail_after_three_tries(world: World) -> None:
    sup = world.supervisor(proxy="${PORT}")
    world.probe.status = 200
    world.processes.port_holders = ["pid 7 (x)"] * 3
    message = await failure(asyncio.ensure_future(sup.ensure_ready()))
    spawns = [line for line in world.history if line.startswith("spawn")]
    assert (spawns, world.history[-1], sup.failure_reason) == (
        ["spawn 101", "spawn 102", "spawn 103"],
        "starting->failed",
        "port_taken",
    )
    assert "3 ports picked in a row were taken before the backend bound them" in message


async def test_L3_failed_starts_back_off_before_the_next_try(world: World) -> None:
    sup = world.supervisor()
    world.processes.exit_at_once = 3
    began = world.clock()
    for at in (0.0, 0.5, 1.0, 2.5, 3.0):  # back-off: 1 s after the first failure, then 2 s
        world.clock.now = began + at
        world.mark(f"request at {at}s")
        message = await failure(asyncio.ensure_future(sup.ensure_ready()))
        world.mark(message[message.index("retries in") : message.index("s.")])
    assert world.history == [
        "request at 0.0s",
        "stopped->starting",
        "spawn 101",
        "stop_group 101",
        "starting->failed",
        "retries in 1.0",
        "request at 0.5s",
        "retries in 0.5",
        "request at 1.0s",
        "failed->starting",
        "spawn 102",
        "stop_group 102",
        "starting->failed",
        "retries in 2.0",
        "request at 2.5s",
        "retries in 0.5",
        "request at 3.0s",
        "failed->starting",
        "spawn 103",
        "stop_group 103",
        "starting->failed",
        "retries in 4.0",
    ]


async def test_L3_start_exceeding_the_health_timeout_is_killed_and_fails(world: World) -> None:
    sup = world.supervisor(health_timeout=1.0)
    began = world.clock()
    message = await failure(asyncio.ensure_future(sup.ensure_ready()))
    assert (
        world.history,
        round(world.clock() - began, 6),
        world.processes.running,
        "did not become healthy within 1s (--health-timeout)" in message,
    ) == (
        ["stopped->starting", "spawn 101", "stop_group 101", "starting->failed"],
        1.0,
        {},
        True,
    )


async def test_L4_unload_while_draining_waits_for_in_flight_and_admits_no_new_request(
    world: World,
) -> None:
    sup = world.supervisor()
    world.probe.status = 200
    await sup.ensure_ready()
    assert sup.enter() and sup.enter()
    unloading = asyncio.ensure_future(sup.unload())
    await until(lambda: sup.state is State.DRAINING)
    world.mark(f"enter while draining: {sup.enter()}")
    sup.leave()
    world.mark("one left")
    for _ in range(50):  # time for a wrong stop to show
        await asyncio.sleep(0)
    sup.leave()
    world.mark("last left")
    await unloading
    assert world.history == [
        "stopped->starting",
        "spawn 101",
        "starting->ready",
        "ready->draining",
        "enter while draining: False",
        "one left",
        "last left",
        "draining->stopping",
        "stop_group 101",
        "stopping->stopped",
    ]


async def test_M4_a_ready_process_that_exits_is_failed_and_restarted_on_demand_at_once(
    world: World,
) -> None:
    sup = world.supervisor()
    world.probe.status = 200
    await sup.ensure_ready()
    world.processes.exit(101, 139)
    await until(lambda: sup.state is State.FAILED)
    world.mark(f"{sup.failure_reason}: {sup.last_error}; available: {sup.available()}")
    await sup.ensure_ready()  # not refused for a back-off: it is not persistent
    assert world.history == [
        "stopped->starting",
        "spawn 101",
        "starting->ready",
        "ready->stopping",
        "stop_group 101",
        "stopping->failed",
        "exited: exited unexpectedly with code 139; available: True",
        "failed->starting",
        "spawn 102",
        "starting->ready",
    ]


async def test_P1_pause_during_start_cancels_it_and_leaves_nothing_running(
    world: World,
) -> None:
    sup = world.supervisor()
    waiter = asyncio.ensure_future(sup.ensure_ready())
    await until(lambda: world.processes.running)
    await sup.pause()
    world.mark(await failure(waiter))
    world.mark(await failure(asyncio.ensure_future(sup.ensure_ready())))
    assert (world.history, world.processes.running) == (
        [
            "stopped->starting",
            "spawn 101",
            "starting->stopping",
            "stop_group 101",
            "stopping->stopped",
            "stopped->paused",
            "BackendPaused: backend 'm#0' is paused",
            "BackendPaused: backend 'm#0' is paused",
        ],
        {},
    )


async def test_L4_retire_of_a_starting_backend_cuts_the_start_short(world: World) -> None:
    sup = world.supervisor()
    waiter = asyncio.ensure_future(sup.ensure_ready())
    await until(lambda: world.processes.running)
    await sup.retire()
    world.mark(await failure(waiter))
    world.mark(await failure(asyncio.ensure_future(sup.ensure_ready())))
    retired = "BackendRetired: backend 'm#0' was removed or replaced by a reload"
    assert (world.history, world.processes.running) == (
        [
            "stopped->starting",
            "spawn 101",
            "starting->stopping",
            "stop_group 101",
            "stopping->stopped",
            retired,
            retired,
        ],
        {},
    )


async def test_L4_a_replacement_never_spawns_before_its_predecessor_is_gone(
    world: World,
) -> None:
    sup = world.supervisor()
    world.probe.status = 200
    predecessor: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sup.follows(predecessor)
    starting = asyncio.ensure_future(sup.ensure_ready())
    for _ in range(50):  # however long it takes, nothing is spawned meanwhile
        await asyncio.sleep(0)
    world.mark("predecessor gone")
    predecessor.set_result(None)
    await starting
    assert world.history == [
        "stopped->starting",
        "predecessor gone",
        "spawn 101",
        "starting->ready",
    ]


def record(cmd: str) -> PidRecord:
    return PidRecord(
        backend="m#0",
        pid=4242,
        pgid=4242,
        started=42.0,
        port=5800,
        base_url="http://127.0.0.1:5800",
        health_url="http://127.0.0.1:5800/health",
        cmd=cmd,
    )


async def test_L5_adopt_with_a_mismatched_command_kills_the_group_and_does_not_adopt(
    world: World,
) -> None:
    sup = world.supervisor()
    world.probe.status = 200
    sup.records.write(record("llama-server --port ${PORT} --model other.gguf"))
    adopted = await sup.adopt(record("llama-server --port ${PORT} --model other.gguf"))
    assert (adopted, world.history, sup.state, world.probe.asked, sup.records.all()) == (
        False,
        ["adopt 4242", "stop_group 4242"],
        State.STOPPED,
        0,
        [],
    )


async def test_L5_adopt_of_a_healthy_recorded_process_follows_its_log_from_the_end(
    world: World,
) -> None:
    sup = world.supervisor()
    world.probe.status = 200
    log = sup.logs.path
    assert log is not None
    log.parent.mkdir(parents=True)
    log.write_text("before the crash of corrallm\n")
    adopted = await sup.adopt(record(CMD))
    world.processes.output = log
    world.processes.print("srv  log_server_r: request: POST /v1/chat/completions 200")
    sup.logs.catch_up()  # what the follower does every FOLLOW_SECONDS
    assert (adopted, world.history, [line.split("] ")[-1] for line in sup.logs.tail(5)]) == (
        True,
        ["adopt 4242", "stopped->starting", "starting->ready"],
        [
            "re-adopted pid 4242 after a restart of corrallm",
            "srv  log_server_r: request: POST /v1/chat/completions 200",
        ],
    )


async def test_L6_what_the_backend_prints_while_loading_is_parsed_once_it_is_ready(
    world: World,
) -> None:
    sup = world.supervisor()
    starting = asyncio.ensure_future(sup.ensure_ready())
    await until(lambda: world.processes.running)
    world.processes.print("llama_context: n_ctx = 2048", "initializing slots, n_slots = 3")
    world.probe.status = 200
    await starting
    assert (sup.logs.n_ctx, sup.logs.n_slots, sup.logs.tail(3)[:2]) == (
        2048,
        3,
        ["llama_context: n_ctx = 2048", "initializing slots, n_slots = 3"],
    )


# -- M4: liveness of a ready backend ---------------------------------------------------------


def own_tasks() -> list[str]:
    """The supervisor's watch and revival tasks still running."""
    return sorted(
        t.get_name().split("-")[0]
        for t in asyncio.all_tasks()
        if t.get_name().startswith(("watch-", "revive-")) and not t.done()
    )


async def test_M4_failed_probes_in_a_row_mark_it_failed_and_kill_it_without_the_full_grace(
    world: World,
) -> None:
    sup = world.supervisor(health={"interval": "10s", "failures": 3}, stop_grace=30)
    world.probe.status = 200
    world.after_ready = lambda: setattr(world.probe, "status", 500)
    await sup.ensure_ready()
    used = sup.last_used
    await until(lambda: sup.state is State.FAILED)
    assert (
        world.history,
        world.probe.asked - 1,
        # Probes at +10, +20 and +30 s; the fake sleep moves time at once, so each probe is
        # charged its 2 s bound even when it answers at once.
        world.clock() - world.ready_at,
        sup.failure_reason,
        sup.last_error,
        [line.split("] ")[-1] for line in sup.logs.tail(2)],
        world.processes.graces,  # a hung process is not waited on for stopGrace
        sup.last_used == used,  # health polls are not activity
        sup.available(),
        own_tasks(),
    ) == (
        [
            "stopped->starting",
            "spawn 101",
            "starting->ready",
            "ready->stopping",
            "stop_group 101",
            "stopping->failed",
        ],
        3,
        32.0,
        "unresponsive",
        "unresponsive: 3 health checks in a row failed (the last: answered 500)",
        [
            "failed: unresponsive: 3 health checks in a row failed (the last: answered 500)",
            "stopped (terminated)",
        ],
        [1.0],
        True,
        True,
        [],
    )


async def test_M4_a_successful_probe_resets_the_count_of_failed_ones(world: World) -> None:
    sup = world.supervisor(health={"interval": "10s", "failures": 3})
    world.probe.status = 200

    def script() -> None:
        world.probe.script = [500, None, 200, 503, 503]
        world.probe.status = None  # then nothing answers

    world.after_ready = script
    await sup.ensure_ready()
    await until(lambda: sup.state is State.FAILED)
    assert (world.clock() - world.ready_at, world.probe.asked - 1, sup.last_error) == (
        62.0,  # the 6th probe (at +60 s, its bound charged): the 3rd failure after the success
        6,
        "unresponsive: 3 health checks in a row failed (the last: no answer within 2s)",
    )


async def test_M4_a_probe_that_hangs_is_bounded_and_probes_stay_an_interval_apart(
    world: World,
) -> None:
    sup = world.supervisor(health={"interval": "10s", "failures": 2})
    world.probe.status = 200
    world.after_ready = lambda: setattr(world.probe, "hang", True)
    await sup.ensure_ready()
    await until(lambda: sup.state is State.FAILED)
    # 1st probe at +10 s, given up at +12 s; the 2nd at +20 s, given up at +22 s.
    assert (world.clock() - world.ready_at, world.probe.asked - 1) == (22.0, 2)


async def test_M4_no_probe_runs_unless_ready_and_every_task_ends_with_the_process(
    world: World,
) -> None:
    sup = world.supervisor(health={"interval": "1s"})
    seen: list[str] = []
    world.probe.status = 200
    for how in ("unload", "pause", "stop", "retire"):
        await sup.ensure_ready()
        await until(lambda: world.probe.asked > 3)  # probed while ready
        await {"unload": sup.unload, "pause": sup.pause, "stop": sup.stop, "retire": sup.retire}[
            how
        ]()
        asked = world.probe.asked
        for _ in range(5):
            await world.clock.sleep(10)
        seen.append(f"{how}: {sup.state}, {world.probe.asked - asked} probes, {own_tasks()}")
        sup.unpause()
    assert seen == [
        "unload: stopped, 0 probes, []",
        "pause: paused, 0 probes, []",
        "stop: stopped, 0 probes, []",
        "retire: stopped, 0 probes, []",
    ]


async def test_M4_a_backend_that_fails_while_draining_ends_the_unload_as_failed(
    world: World,
) -> None:
    sup = world.supervisor(health={"interval": "1s", "failures": 1})
    world.probe.status = 200
    await sup.ensure_ready()
    assert sup.enter()
    unloading = asyncio.ensure_future(sup.unload())
    await until(lambda: sup.state is State.DRAINING)
    world.probe.status = None  # hangs with a request in flight
    await unloading
    sup.leave()  # its request ended with a 502 once the group was gone
    assert (world.history[3:], own_tasks()) == (
        ["ready->draining", "draining->stopping", "stop_group 101", "stopping->failed"],
        [],
    )


async def test_M4_a_persistent_backend_is_restarted_with_a_back_off_that_grows_while_it_keeps_dying(
    world: World,
) -> None:
    sup = world.supervisor(health={"interval": "10s"})
    sup.keep_alive = True
    world.probe.status = 200
    await sup.ensure_ready()
    for pid in (101, 102, 103):  # each dies right after it becomes ready
        world.processes.exit(pid, 1)
        await until(lambda p=pid: sup.state is State.READY and sup.pid == p + 1)
    await until(lambda: sup.failures == 0)  # healthy for a probe interval: the count resets
    world.processes.exit(104, 1)
    await until(lambda: sup.state is State.READY and sup.pid == 105)
    await until(lambda: own_tasks() == ["watch"])  # the revival ends once it is ready
    assert (world.back_offs, world.history.count("stopping->failed")) == ([1.0, 2.0, 4.0, 1.0], 4)


async def test_M4_a_persistent_backend_whose_restart_fails_keeps_backing_off(
    world: World,
) -> None:
    sup = world.supervisor(health={"interval": "10s"})
    sup.keep_alive = True
    world.probe.status = 200
    await sup.ensure_ready()
    world.processes.exit_at_once = 3  # restarts fail
    world.processes.exit(101, 1)
    await until(lambda: world.history.count("starting->failed") == 2)
    world.processes.exit_at_once = None
    await until(lambda: sup.state is State.READY)
    # died (1 s) -> failed start (2 s) -> failed start (4 s) -> ready
    assert (world.back_offs, sup.pid) == ([1.0, 2.0, 4.0], 104)


async def test_M4_pausing_a_failed_persistent_backend_ends_its_revival(world: World) -> None:
    sup = world.supervisor(health={"interval": "10s"})
    sup.keep_alive = True
    world.probe.status = 200
    await sup.ensure_ready()
    world.processes.exit(101, 1)
    await until(lambda: sup.state is State.FAILED and own_tasks() == ["revive"])
    await sup.pause()
    for _ in range(5):
        await world.clock.sleep(10)
    assert (sup.state, own_tasks(), world.history.count("spawn 102")) == (State.PAUSED, [], 0)


async def test_M4_a_docker_backend_that_stops_answering_is_stopped_by_its_command(
    world: World,
) -> None:
    spec = Backend(proxy="5800", supervision="docker", docker_container="box", stop_grace=3)
    sup = Supervisor(
        "d#0",
        spec,
        world.probe,
        world.home,
        clock=world.clock,
        bus=world.bus,
        processes=world.processes,
        sleep=world.clock.sleep,
    )
    world.made.append(sup)
    world.probe.status = 200
    world.after_ready = lambda: setattr(world.probe, "status", None)
    await sup.ensure_ready()
    await until(lambda: sup.state is State.FAILED)
    assert (world.history, sup.failure_reason) == (
        [
            "stopped->starting",
            "run docker start box",
            "starting->ready",
            "ready->stopping",
            "run docker stop -t 3 box",
            "stopping->failed",
        ],
        "unresponsive",
    )


# -- M5: stall-aware starts --------------------------------------------------------------------


async def test_M5_a_silent_start_whose_health_answer_does_not_change_fails_as_stalled(
    world: World,
) -> None:
    sup = world.supervisor(health={"stallTimeout": "5s"})
    world.probe.status = 503
    began = world.clock()
    message = await failure(asyncio.ensure_future(sup.ensure_ready()))
    assert (
        world.history,
        round(world.clock() - began, 6) <= 5.0 + HEALTH_POLL_SECONDS,
        sup.failure_reason,
        message.split(". corrallm")[0],
    ) == (
        ["stopped->starting", "spawn 101", "stop_group 101", "starting->failed"],
        True,
        "stalled",
        "BackendFailed: backend 'm#0' failed to start: stalled: no output and no change in its "
        "health answer for 5s (health.stallTimeout)",
    )


async def test_M5_a_start_that_keeps_logging_or_changing_its_answer_is_not_stalled(
    world: World,
) -> None:
    sup = world.supervisor(health={"stallTimeout": "5s"})
    world.probe.status = None
    began = world.clock()
    starting = asyncio.ensure_future(sup.ensure_ready())
    await until(lambda: world.processes.running)
    printed = began
    while not starting.done():  # prints every 2 s for 20 s, then answers 503 and goes quiet
        now = world.clock()
        if now - began < 20 and now - printed >= 2:
            world.processes.print(f"loading tensors ... {int(now - began)}s")
            printed = now
        if now - began >= 20:
            world.probe.status = 503  # a change of answer: the stall clock starts again
        await asyncio.sleep(0)
    message = await failure(starting)
    # The last output at 18 s, the answer's change at 20 s: stalled 5 s later, not before.
    assert (
        25.0 <= world.clock() - began <= 25.0 + 2 * HEALTH_POLL_SECONDS,
        "stalled" in message,
    ) == (
        True,
        True,
    )


async def test_M5_start_timeout_overrides_the_health_timeout_even_for_a_logging_start(
    world: World,
) -> None:
    sup = world.supervisor(health_timeout=120.0, health={"startTimeout": "3s"})
    world.probe.status = 503
    began = world.clock()
    starting = asyncio.ensure_future(sup.ensure_ready())
    await until(lambda: world.processes.running)
    while not starting.done():
        world.processes.print("loading ...")
        await asyncio.sleep(0)
    message = await failure(starting)
    assert (round(world.clock() - began, 6), message.split(". corrallm")[0]) == (
        3.0,
        "BackendFailed: backend 'm#0' failed to start: did not become healthy within 3s "
        "(health.startTimeout)",
    )
