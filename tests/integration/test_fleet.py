"""SPEC §23 E3 through a real gateway and a fake backend: `/metrics` carries, per served
model, `corrallm_model_queue_depth` and `corrallm_model_slot_usage_ratio`, the gauges an
endpoint picker reads (docs/fleet.md), read with Prometheus' own parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.calls import Call
from tests.support.processes import fake_cmd, wait_for

CONFIG = """
models:
  local:
    backends:
      - {{ cmd: "{cmd}", proxy: "${{PORT}}", maxConcurrent: 1 }}
  idle:
    backends:
      - {{ cmd: "{cmd}", proxy: "${{PORT}}", maxConcurrent: 4 }}
"""
GAUGES = ("corrallm_model_queue_depth", "corrallm_model_slot_usage_ratio")


def gauges(gw) -> dict[str, tuple[float, float]]:
    """(queue depth, slot usage ratio) by model."""
    r = httpx.get(gw.url + "/metrics", timeout=10)
    assert r.status_code == 200
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(r.text):
        if family.name in GAUGES:
            assert family.type == "gauge", family
            for sample in family.samples:
                found.setdefault(sample.labels["model"], {})[family.name] = sample.value
    return {model: (g[GAUGES[0]], g[GAUGES[1]]) for model, g in found.items()}


def test_E3_a_running_request_shows_in_the_ratio_and_a_queued_one_in_the_depth(
    gateway_factory, calls
):
    gw = gateway_factory(CONFIG.format(cmd=fake_cmd("--tokens", "40", "--token-delay", "0.05")))
    assert gauges(gw) == {"local": (0, 0.0), "idle": (0, 0.0)}  # nothing loaded
    calls.append(Call(gw, "local", stream=True))  # a 2 s stream on the only slot
    wait_for(lambda: gauges(gw)["local"] == (0, 1.0), 20, what="one slot of one busy")
    calls.append(Call(gw, "local", stream=True))
    wait_for(lambda: gauges(gw)["local"] == (1, 1.0), 10, what="the second one queued")
    assert gauges(gw)["idle"] == (0, 0.0)
    wait_for(lambda: all(c.finished() for c in calls), 30, what="both streams")
    assert [c.status for c in calls] == [200, 200]
    wait_for(lambda: gauges(gw)["local"] == (0, 0.0), 10, what="the slot free again")
