"""P6 with R5, D1 and C6: a config reload swaps the topology, never the long-lived owners.

Before the bus, a reload rewrote every supervisor's listeners (the economics ledger
stopped counting) and built a new Residency without the NVML reader (measured memory
stopped). Here the gateway is built in-process, not started; transitions are driven on
its supervisors directly and a fake reader stands in for NVML (no GPU here)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from corrallm.config import load_config_text
from corrallm.gateway import Gateway
from corrallm.lifecycle.state import State

BEFORE = """
servers: {box: {pools: {gpu0: 32GB}}}
models:
  kept: {backends: [{cmd: "kept --port ${PORT}", proxy: "${PORT}", ramUsage: {gpu0: 1GB}}]}
"""
AFTER = (
    BEFORE
    + """
  added: {backends: [{cmd: "added --port ${PORT}", proxy: "${PORT}", ramUsage: {gpu0: 2GB}}]}
"""
)


class FakeReader:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def read(self, pid: int) -> dict[str, int] | None:
        self.asked.append(pid)
        return {"gpu0": 10**9}


async def wake_and_sleep(gw: Gateway, backend: str, pid: int) -> None:
    """A load and an unload of `backend`, with the residency's measurement of the ready
    process (a worker thread behind a task) awaited in between."""
    sup = gw.supervisors[backend]
    tenancy = gw.residency.tenancies[backend]
    tenancy.measured = None
    sup.proc = SimpleNamespace(pid=pid)  # type: ignore[assignment]
    sup._move(State.STARTING)
    sup._move(State.READY)
    others = asyncio.all_tasks() - {asyncio.current_task()}
    await asyncio.wait_for(asyncio.gather(*others), 5)  # the measurement, and nothing else
    assert tenancy.measured is not None
    for state in (State.DRAINING, State.STOPPING, State.STOPPED):
        sup._move(state)
    sup.proc = None


async def test_P6_R5_D1_C6_a_reload_keeps_the_owners_and_their_subscriptions(
    tmp_path: Path,
) -> None:
    gw = Gateway(load_config_text(BEFORE), tmp_path)
    reader = FakeReader()
    gw.residency.reader = reader
    kept = gw.supervisors["kept#0"]
    await wake_and_sleep(gw, "kept#0", 101)
    gw.reconfigure(load_config_text(AFTER))
    assert gw.supervisors["kept#0"] is kept  # unchanged spec: the same process owner
    await wake_and_sleep(gw, "kept#0", 102)
    await wake_and_sleep(gw, "added#0", 201)
    counters = gw.economics.counters
    assert {
        "reader kept": gw.residency.reader is reader,
        "measured": reader.asked,
        "wakes": {b: (counters[b].wakes, counters[b].sleeps) for b in ("kept#0", "added#0")},
        "ready transitions": {
            b: gw.metrics.transitions[(b, "starting", "ready")] for b in ("kept#0", "added#0")
        },
    } == {
        "reader kept": True,
        "measured": [101, 102, 201],
        "wakes": {"kept#0": (2, 2), "added#0": (1, 1)},
        "ready transitions": {"kept#0": 2, "added#0": 1},
    }


async def test_P6_E2_a_reload_sets_changes_and_unsets_the_tracer(tmp_path: Path) -> None:
    gw = Gateway(load_config_text(BEFORE), tmp_path)
    assert gw.tracer is None
    traced = BEFORE + "telemetry:\n  otlp: {endpoint: 'http://127.0.0.1:9'}\n"
    gw.reconfigure(load_config_text(traced))
    first = gw.tracer
    assert first is not None
    gw.reconfigure(load_config_text(traced + "  \n"))  # the same telemetry: the same tracer
    assert gw.tracer is first
    gw.reconfigure(load_config_text(traced + "  sampleRatio: 0.5\n"))  # changed: a new one
    assert gw.tracer is not None and gw.tracer is not first
    gw.reconfigure(load_config_text(BEFORE))
    assert gw.tracer is None
