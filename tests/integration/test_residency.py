"""SPEC §5 R1-R4 through a real gateway: pools, eviction order, busy residents, ttl."""

from __future__ import annotations

import math
import signal
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import cleanup, fake_cmd, process_gone, wait_for


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


# -- SPEC §17 M3: GPU placement ----------------------------------------------------------


def gpu_servers() -> str:
    return """
scheduler: {maxWait: 5s}
servers:
  box: {pools: {gpu0: 24GB, gpu1: 24GB, system: 64GB}, gpus: [gpu0, gpu1]}
"""


def any_gpu_backend(name: str, gpu: str) -> str:
    cmd = fake_cmd("--model-name", f"{name}-${{GPU}}")
    return f'{{cmd: "{cmd}", proxy: "${{PORT}}", server: box, ramUsage: {{gpu: {gpu}}}}}'


def residents(gw) -> dict[str, dict]:
    servers = gw.api("GET", "residency").json()["servers"]
    return {r["backend"]: r for s in servers for r in s["residents"]}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_M3_a_second_backend_lands_on_the_other_gpu_with_its_index(gateway_factory):
    gw = gateway_factory(
        gpu_servers()
        + f"""
models:
  a: {{backends: [{any_gpu_backend("a", "18GB")}]}}
  b: {{backends: [{any_gpu_backend("b", "18GB")}]}}
"""
    )
    assert chat(gw, "a").status_code == 200
    assert chat(gw, "b").status_code == 200  # 18 + 18 > 24: not beside a, on gpu1
    held = residents(gw)
    assert {b: held[b]["gpu"] for b in ("a#0", "b#0")} == {"a#0": "gpu0", "b#0": "gpu1"}
    assert gw.state("a#0") == "ready"  # nothing was evicted
    assert "evict backend=" not in gw.log()
    assert "place backend=b#0 server=box gpu=gpu1 index=1" in gw.log()
    for backend, index in (("a#0", "0"), ("b#0", "1")):
        pid = held[backend]["pid"]
        proc = psutil.Process(pid)
        assert environ(pid)["CUDA_VISIBLE_DEVICES"] == index
        assert f"{backend[0]}-{index}" in proc.cmdline()  # ${GPU} in its cmd
        assert held[backend]["declared"] == {"gpu": 18 * 10**9}
        pools = {p for p in held[backend]["ram_usage"] if p.startswith("gpu")}
        assert pools == {f"gpu{index}"}  # counted on the chosen pool, and only there
        assert held[backend]["ram_usage"][f"gpu{index}"] == 18 * 10**9
    pools = gw.api("GET", "overview").json()["servers"][0]["pools"]
    assert (pools["gpu0"]["used"], pools["gpu1"]["used"]) == (18 * 10**9, 18 * 10**9)
    models = httpx.get(gw.v1 + "/models", timeout=10).json()["data"]
    assert {"a", "b"} <= {m["id"] for m in models}


# -- SPEC §17 M2: learned footprints --------------------------------------------------------

MB = 10**6


def holding_backend(mb: int, declared: str) -> str:
    cmd = fake_cmd("--hold-mb", str(mb))
    return f'{{cmd: "{cmd}", proxy: "${{PORT}}", server: box, ramUsage: {{system: {declared}}}}}'


# By the declarations, big (50MB) and small (200MB) fit together in 500MB; big really holds
# 300MiB and more (its Python too), so once that is learned they no longer do.
LEARNING = f"""
scheduler: {{maxWait: 1s}}
servers:
  box: {{pools: {{system: 500MB}}}}
models:
  big: {{backends: [{holding_backend(300, "50MB")}]}}
  small: {{backends: [{holding_backend(0, "200MB")}]}}
"""


def group_rss(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def planned(gw, backend: str) -> float | None:
    """The `planned` system bytes of `backend` in /metrics (None when absent)."""
    prefix = f'corrallm_backend_memory_bytes{{backend="{backend}",kind="planned",pool="system"}}'
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    return None


@pytest.mark.serve_process
def test_M2_planning_learns_what_a_backend_holds_and_a_restart_remembers_it(
    gateway_factory, tmp_path
):
    home = tmp_path / "shared-home"
    gw = gateway_factory(LEARNING, home=home)
    assert planned(gw, "big#0") == 50 * MB  # nothing learned yet: the declaration
    assert chat(gw, "big").status_code == 200
    held = wait_for(
        lambda: (r := residents(gw).get("big#0")) and r["measured"] and r, 20, what="measured"
    )
    rss = group_rss(held["pid"])
    measured = held["measured"]["system"]
    assert measured > 300 * 2**20 and abs(measured - rss) < 0.1 * rss  # measured ~ its RSS
    assert (held["declared"], held["estimated"]) == ({"system": 50 * MB}, None)
    assert held["ram_usage"] == {"system": math.ceil(measured * 1.05)}
    assert "ramUsage mismatch backend=big#0 pool=system declared=50MB" in gw.log()
    assert planned(gw, "big#0") == math.ceil(measured * 1.05)
    # small would fit beside big by the declarations; by what big really holds it does not.
    assert chat(gw, "small").status_code == 200
    assert gw.state("big#0") == "stopped" and process_gone(held["pid"])
    assert "evict backend=big#0 for=small#0 server=box" in gw.log()
    gw.signal(signal.SIGTERM)
    gw.wait_exit()
    cleanup(gw)
    # A restart (same home, so the same store) plans with the learned footprint at once.
    again = gateway_factory(LEARNING, home=home)
    assert planned(again, "big#0") == math.ceil(measured * 1.05)
    assert chat(again, "small").status_code == 200
    assert chat(again, "big").status_code == 200  # its first load of this run
    assert again.state("small#0") == "stopped"
    assert "evict backend=small#0 for=big#0 server=box" in again.log()
