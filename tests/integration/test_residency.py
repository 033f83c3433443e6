"""SPEC §5 R1-R4 through a real gateway: pools, eviction order, busy residents, ttl."""

from __future__ import annotations

import threading

import httpx
import psutil

from tests.support.processes import fake_cmd, wait_for


def chat(gw, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)


def backend(gpu: str, *flags: str, extra: str = "") -> str:
    return (
        f'{{cmd: "{fake_cmd(*flags)}", proxy: "${{PORT}}", server: box, '
        f"ramUsage: {{gpu0: {gpu}}}{extra}}}"
    )


def servers(gpu: str = "10GB", max_wait: str = "30s") -> str:
    return f"""
scheduler: {{maxWait: {max_wait}}}
servers:
  box: {{pools: {{gpu0: {gpu}, system: 64GB}}, reserve: {{gpu0: 0}}}}
"""


def test_R1_R2_two_models_that_do_not_fit_together_evict_each_other(gateway_factory):
    gw = gateway_factory(
        servers()
        + f"""
models:
  a: {{backends: [{backend("6GB")}]}}
  b: {{backends: [{backend("6GB")}]}}
"""
    )
    assert chat(gw, "a").status_code == 200
    pid_a = gw.pid_of("a#0")
    assert chat(gw, "b").status_code == 200
    assert gw.state("a#0") == "stopped" and not psutil.pid_exists(pid_a)
    assert gw.state("b#0") == "ready"
    assert "evict backend=a#0 for=b#0 server=box reason=evictCost=medium" in gw.log()
    pools = gw.api("GET", "overview").json()["servers"][0]["pools"]
    assert pools["gpu0"] == {"capacity": 10 * 10**9, "reserve": 0, "used": 6 * 10**9}
    assert chat(gw, "a").status_code == 200  # and back again
    assert gw.state("b#0") == "stopped"


def test_R2_R3_eviction_order_pinned_never_then_cost_then_lru(gateway_factory):
    gw = gateway_factory(
        servers()
        + f"""
models:
  pinned: {{persistent: true, backends: [{backend("4GB")}]}}
  cheap: {{sticky: {{evictCost: low}}, backends: [{backend("2GB")}]}}
  dear: {{sticky: {{evictCost: high}}, backends: [{backend("2GB")}]}}
  older: {{backends: [{backend("1GB")}]}}
  newer: {{backends: [{backend("1GB")}]}}
  new: {{backends: [{backend("2GB")}]}}
  big: {{backends: [{backend("4GB")}]}}
"""
    )
    wait_for(lambda: gw.state("pinned#0") == "ready", 20, what="R3: preloaded at boot")
    for model in ("cheap", "dear", "older", "newer"):
        assert chat(gw, model).status_code == 200  # 4 + 2 + 2 + 1 + 1 = 10GB: full
    assert chat(gw, "new").status_code == 200  # needs 2GB: the low-cost one goes
    assert gw.state("cheap#0") == "stopped"
    assert {gw.state(b) for b in ("pinned#0", "dear#0", "older#0", "newer#0")} == {"ready"}
    assert chat(gw, "big").status_code == 200  # needs 4GB: the 2 mediums by LRU, then 'new'
    states = {b: gw.state(b) for b in ("pinned#0", "dear#0", "older#0", "newer#0", "new#0")}
    assert states["pinned#0"] == "ready" and states["dear#0"] == "ready"
    assert states["older#0"] == states["newer#0"] == states["new#0"] == "stopped"


def test_R2_a_busy_resident_is_kept_until_its_stream_finishes_intact(gateway_factory):
    gw = gateway_factory(
        servers()
        + f"""
models:
  a: {{backends: [{backend("6GB", "--tokens", "20", "--token-delay", "0.1")}]}}
  b: {{backends: [{backend("6GB")}]}}
"""
    )
    assert chat(gw, "a", max_tokens=1).status_code == 200
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "a", "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                started.set()
                if line:
                    lines.append(line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(10)
    response = chat(gw, "b")  # waits (maxWait 30s) for a to go idle, then evicts it
    streamer.join(30)
    assert response.status_code == 200
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 23  # role chunk, 20 tokens, the finish chunk, [DONE]: all of it
    assert gw.state("a#0") == "stopped"


def test_R2_no_room_within_max_wait_is_503_naming_what_holds_the_memory(gateway_factory):
    gw = gateway_factory(
        servers(max_wait="1s")
        + f"""
models:
  holder: {{persistent: true, backends: [{backend("8GB")}]}}
  b: {{backends: [{backend("6GB")}]}}
"""
    )
    wait_for(lambda: gw.state("holder#0") == "ready", 20, what="preload")
    response = chat(gw, "b")
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "insufficient_capacity"
    assert "holder#0" in error["message"] and "pinned" in error["message"]
    assert "Retry-After" not in response.headers or response.headers["Retry-After"]


def test_R2_spills_to_the_next_backend_when_no_room_can_be_made(gateway_factory):
    gw = gateway_factory(
        servers()
        + f"""
models:
  holder: {{persistent: true, backends: [{backend("7GB")}]}}
  m:
    backends:
      - {backend("8GB", extra=", name: m-big")}
      - {backend("2GB", extra=", name: m-small")}
"""
    )
    wait_for(lambda: gw.state("holder#0") == "ready", 20, what="preload")
    for _ in range(2):  # whichever the round-robin turn, the one that fits serves
        response = chat(gw, "m")
        assert response.status_code == 200
        assert response.headers["x-corrallm-backend"] == "m-small"


def test_R4_sticky_ttl_unloads_an_idle_model(gateway_factory):
    gw = gateway_factory(
        servers()
        + f"""
models:
  brief: {{sticky: {{ttl: 1s}}, backends: [{backend("1GB")}]}}
  forever: {{backends: [{backend("1GB")}]}}
"""
    )
    assert chat(gw, "brief").status_code == 200
    assert chat(gw, "forever").status_code == 200
    wait_for(lambda: gw.state("brief#0") == "stopped", 15, what="ttl unload")
    assert gw.state("forever#0") == "ready"  # no sticky: resident until evicted
    residents = gw.api("GET", "residency").json()["servers"][0]["residents"]
    assert [r["backend"] for r in residents] == ["forever#0"]
    assert residents[0]["ttl_expires_at"] is None and residents[0]["pinned"] is False
