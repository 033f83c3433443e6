"""SPEC §17 M4 (liveness of a ready backend) and M5 (stall-aware starts), through
`corrallm serve` with real fake-backend processes.

Each test prints the timings it measured (`pytest -s` shows them): from the backend's death
or hang (the time the fake backend writes in its log line) to the gateway's transitions
(the `t` of each lifecycle event on /api/v1/events).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import Gateway, fake_cmd, group_alive, wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
Factory = Callable[..., Gateway]


def config(cmd: str, health: str = "", persistent: bool = False, slots: int = 1) -> str:
    return f"""
models:
  m:
    persistent: {json.dumps(persistent)}
    backends:
      - cmd: "{cmd}"
        proxy: ${{PORT}}
        stopGrace: 10s
        maxConcurrent: {slots}
        health: {{{health}}}
"""


class Lifecycle:
    """The lifecycle events of /api/v1/events, collected by a thread from the moment the
    stream is connected."""

    def __init__(self, gw: Gateway) -> None:
        self.events: list[dict[str, Any]] = []
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._gw = gw
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self._connected.wait(10), "the event stream did not connect"

    def _read(self) -> None:
        headers = {"Authorization": f"Bearer {self._gw.token}"}
        url = self._gw.url + "/api/v1/events?kinds=lifecycle"
        try:
            with httpx.stream("GET", url, headers=headers, timeout=None) as response:
                for line in response.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith(": connected"):
                        self._connected.set()
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[len("data: ") :]))
        except httpx.HTTPError:
            return

    def close(self) -> None:
        self._stop.set()

    def moves(self) -> list[str]:
        return [self._move(e) for e in self.events]

    def at(self, move: str, after: dict[str, Any] | None = None) -> dict[str, Any]:
        """The first event of `move` (e.g. "stopping->failed"), or the first one that came
        after the event `after`, once it has come."""

        def find() -> dict[str, Any] | None:
            start = 0 if after is None else self.events.index(after) + 1
            return next((e for e in self.events[start:] if self._move(e) == move), None)

        return wait_for(find, 30, 0.01, f"event {move}; so far {self.moves()}")

    @staticmethod
    def _move(event: dict[str, Any]) -> str:
        return f"{event['old']}->{event['new']}"


@pytest.fixture
def lifecycle() -> Iterator[Callable[[Gateway], Lifecycle]]:
    opened: list[Lifecycle] = []

    def open_(gw: Gateway) -> Lifecycle:
        opened.append(Lifecycle(gw))
        return opened[-1]

    yield open_
    for events in opened:
        events.close()


def backend_log(gw: Gateway) -> str:
    path = gw.home / "logs" / "m_0.log"
    return path.read_text(errors="replace") if path.exists() else ""


def fault_times(gw: Gateway, flag: str) -> list[float]:
    """When the fake backend died or hung (the wall-clock times it logged for `flag`)."""
    return [float(t) for t in re.findall(rf"\({flag}\) t=([0-9.]+)", backend_log(gw))]


# The gateway's log line of each transition of m#0: when (local time, to the ms), and the move.
_LOGGED = re.compile(
    r"^(\S+ \S+),(\d{3}) INFO corrallm\.lifecycle backend=m#0 transition=(\S+)", re.M
)


def logged_moves(gw: Gateway, *moves: str) -> list[float] | None:
    """When m#0 made `moves`, each the first of its kind after the one before, read from
    the gateway's log (every transition since its start, where an events stream shows
    only those after it connected); None until it has made them all."""
    logged = [
        (time.mktime(time.strptime(when, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000, move)
        for when, ms, move in _LOGGED.findall(gw.log())
    ]
    times: list[float] = []
    index = 0
    for wanted in moves:
        found = next((i for i in range(index, len(logged)) if logged[i][1] == wanted), None)
        if found is None:
            return None
        times.append(logged[found][0])
        index = found + 1
    return times


def failures_metric(gw: Gateway, reason: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    match = re.search(
        rf'^corrallm_backend_failures_total{{backend="m#0",reason="{reason}"}} (\S+)$',
        text,
        re.M,
    )
    return float(match.group(1)) if match else 0.0


def test_M4_a_backend_that_dies_after_ready_is_marked_failed_and_restarted_on_demand(
    gateway_factory: Factory, lifecycle: Callable[[Gateway], Lifecycle]
) -> None:
    gw = gateway_factory(config(fake_cmd("--die-after-ready", "1")))
    events = lifecycle(gw)
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    pid = gw.pid_of("m#0")
    failed = events.at("stopping->failed")
    (died,) = fault_times(gw, "--die-after-ready")
    backend = gw.overview_backend("m#0")
    print(f"\nM4 exit: death -> failed {failed['t'] - died:.3f}s")
    assert (
        events.moves(),
        failed["reason"],
        failed["error"],
        backend["state"],
        backend["last_error"],
        failures_metric(gw, "exited"),
        group_alive(pid),
        "failed: exited unexpectedly with code 1" in backend_log(gw),
    ) == (
        ["stopped->starting", "starting->ready", "ready->stopping", "stopping->failed"],
        "exited",
        "exited unexpectedly with code 1",
        "failed",
        "exited unexpectedly with code 1",
        1.0,
        False,
        True,
    )
    assert failed["t"] - died < 1.0
    # Not persistent: the next request starts it again at once, without a back-off.
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    # The answer can beat the events stream to the test: wait for the events it implies.
    events.at("starting->ready", after=events.at("failed->starting"))
    assert events.moves()[4:6] == ["failed->starting", "starting->ready"]


def test_M4_a_persistent_backend_that_dies_is_restarted_with_a_growing_back_off(
    gateway_factory: Factory,
) -> None:
    # It dies 1 s after each start, before a probe interval (10 s) has passed: the
    # failures add up and the back-off grows (1 s, then 2 s).
    gw = gateway_factory(config(fake_cmd("--die-after-ready", "1"), persistent=True))
    # Its preload starts with the gateway: the first failure can come before an events
    # stream connects (under CORRALLM_WORKERS, only once a worker serves), so the moves
    # are read from the gateway's log, which has them all.
    first_failed, restarted, ready_again, second_failed, second_restart = wait_for(
        lambda: logged_moves(
            gw,
            "stopping->failed",
            "failed->starting",
            "starting->ready",
            "stopping->failed",
            "failed->starting",
        ),
        30,
        0.05,
        "two failures and restarts in the log",
    )
    deaths = fault_times(gw, "--die-after-ready")
    died = next(t for t in deaths if t <= first_failed)
    back_offs = [restarted - first_failed, second_restart - second_failed]
    print(
        f"\nM4 persistent: death -> failed {first_failed - died:.3f}s, "
        f"-> restart {restarted - died:.3f}s, -> ready {ready_again - died:.3f}s; "
        f"back-offs {back_offs[0]:.3f}s, {back_offs[1]:.3f}s"
    )
    assert first_failed - died < 1.0
    assert 0.9 <= back_offs[0] < 1.5 and 1.9 <= back_offs[1] < 2.5
    assert failures_metric(gw, "exited") >= 2
    assert "persistent: restarting it in 2s" in backend_log(gw)


def test_M4_a_hung_backend_is_detected_and_its_in_flight_requests_end_with_502_or_an_error_event(
    gateway_factory: Factory, lifecycle: Callable[[Gateway], Lifecycle]
) -> None:
    cmd = fake_cmd("--hang-after-ready", "2", "--tokens", "200", "--token-delay", "0.05")
    gw = gateway_factory(config(cmd, health="interval: 0.5s, failures: 2", slots=2))
    events = lifecycle(gw)
    load = gw.api("POST", "models/load", {"model": "m"})
    assert load.status_code == 200, load.text
    results: dict[str, Any] = {}

    def streamed() -> None:  # a timeout far above the expected detection time
        lines = []
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
            results["stream_status"] = r.status_code
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))
        results["stream"] = lines
        results["stream_ended"] = time.time()

    def plain() -> None:
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
        results["plain"] = (response.status_code, response.json())
        results["plain_ended"] = time.time()

    threads = [threading.Thread(target=f) for f in (streamed, plain)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a request in flight hung"
    failed = events.at("stopping->failed")
    stopping = events.at("ready->stopping")
    hung = fault_times(gw, "--hang-after-ready")[0]
    print(
        f"\nM4 hang (interval 0.5s, failures 2): hang -> detected {stopping['t'] - hung:.3f}s, "
        f"-> failed (killed) {failed['t'] - hung:.3f}s, in-flight ended "
        f"{results['plain_ended'] - hung:.3f}s (502) / {results['stream_ended'] - hung:.3f}s "
        "(error event)"
    )
    status, error = results["plain"]
    last_events = [
        json.loads(line[6:]) for line in results["stream"][-2:] if line != "data: [DONE]"
    ]
    assert (
        failed["reason"],
        failed["error"].startswith("unresponsive: 2 health checks in a row failed"),
        status,
        error["error"]["code"],
        results["stream_status"],
        results["stream"][-1],
        "error" in last_events[-1],
        failures_metric(gw, "unresponsive"),
    ) == ("unresponsive", True, 502, "backend_error", 200, "data: [DONE]", True, 1.0)
    # interval x failures + the probe's bound (0.5 s), with room for a loaded machine.
    assert stopping["t"] - hung < 0.5 * 2 + 0.5 + 1.0
    assert failed["t"] - stopping["t"] < 2.0  # killed after 1 s of grace, not stopGrace (10 s)


def test_M5_a_long_load_that_keeps_logging_outlives_the_stall_timeout(
    gateway_factory: Factory,
) -> None:
    cmd = fake_cmd("--load-seconds", "10", "--load-progress", "1")
    gw = gateway_factory(config(cmd, health="stallTimeout: 2s"), health_timeout="60s")
    began = time.monotonic()
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    took = time.monotonic() - began
    print(f"\nM5 logging load of 10s with stallTimeout 2s: ready after {took:.3f}s")
    assert response.status_code == 200, response.text
    assert took >= 9.5
    assert "loading tensors" in backend_log(gw)


def test_M5_a_silent_load_fails_at_the_stall_timeout_with_its_log_tail(
    gateway_factory: Factory, tmp_path: Path
) -> None:
    cmd = fake_cmd("--load-seconds", "600")
    gw = gateway_factory(config(cmd, health="stallTimeout: 2s"), health_timeout="120s")
    began = time.monotonic()
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    took = time.monotonic() - began
    print(f"\nM5 silent load with stallTimeout 2s: failed after {took:.3f}s (cap 120s)")
    message = response.json()["error"]["message"]
    assert (response.status_code, response.json()["error"]["code"]) == (
        502,
        "backend_start_failed",
    )
    assert "stalled: no output and no change in its health answer for 2s" in message
    assert "initializing slots, n_slots = 1" in message  # its log tail
    assert 2.0 <= took < 6.0  # the stall timeout (after its start-up output), not the cap
    assert failures_metric(gw, "stalled") == 1.0
