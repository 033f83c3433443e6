"""SPEC §4: backends spawned on demand behind a real health check, through `corrallm serve`."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.support.processes import (
    fake_cmd,
    free_port,
    group_alive,
    kill_group,
    process_gone,
    wait_for,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def one_model(cmd: str, **backend: object) -> str:
    extra = "".join(f"\n        {k}: {json.dumps(v)}" for k, v in backend.items())
    return f"""
models:
  m:
    backends:
      - cmd: "{cmd}"
        proxy: ${{PORT}}{extra}
"""


def starts(gateway, backend: str = "m#0") -> int:
    log = gateway.home / "logs" / f"{backend.replace('#', '_')}.log"
    return log.read_text().count("starting: ") if log.exists() else 0


def test_L1_cold_request_waits_for_the_real_health_check(gateway_factory):
    # The fake backend answers 503 to inference while loading: a 200 proves gating on /health.
    gw = gateway_factory(one_model(fake_cmd("--load-seconds", "1.5")))
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert response.headers["x-corrallm-backend"] == "m#0"
    log = (gw.home / "logs" / "m_0.log").read_text()
    assert "server is listening" in log  # L1: its output is captured
    assert "ready in" in log


@pytest.mark.serve_process
def test_L1_a_backend_port_that_is_corrallms_own_fails_the_start_instead_of_looping(
    gateway_factory,
):
    """A fixed `proxy` port that corrallm itself listens on: its own /health answers for the
    backend, which cannot bind. The start fails naming corrallm, and no request is sent
    back into corrallm."""
    port = free_port()
    config = f"""
models:
  m:
    backends:
      - cmd: "corrallm fake-backend --port {port}"
        proxy: "{port}"
"""
    gw = gateway_factory(config, port=port)
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "backend_start_failed"
    assert f"port {port} is held by corrallm itself (pid {gw.proc.pid})" in error["message"]
    assert "give this backend another port in `proxy`" in error["message"]
    assert "transition=starting->ready" not in gw.log()  # never routed to as a backend


def test_L2_concurrent_cold_requests_coalesce_into_one_spawn(gateway_factory):
    gw = gateway_factory(one_model(fake_cmd("--load-seconds", "1"), maxConcurrent=8))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(
            pool.map(
                lambda _: httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30),
                range(8),
            )
        )
    assert [r.status_code for r in codes] == [200] * 8
    assert starts(gw) == 1


def test_L3_process_exiting_while_starting_fails_waiters_at_once_with_its_log_tail(
    gateway_factory,
):
    cmd = fake_cmd("--load-seconds", "60", "--exit-after-seconds", "0.5")
    gw = gateway_factory(one_model(cmd), health_timeout="120s")
    began = time.monotonic()
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    assert time.monotonic() - began < 30  # at once, not at the 120 s health timeout
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "backend_start_failed"
    assert "exited with code" in error["message"]
    assert "failed to load model" in error["message"]  # the backend's own last lines


@pytest.mark.serve_process  # the warning is what `corrallm serve` prints as it starts
def test_issue30_L3_a_program_not_found_is_named_at_serve_and_in_the_502(gateway_factory):
    """Issue 30: the 502 said `[Errno 2] No such file or directory` without naming the
    program (uvloop's spawn names nothing); serve did not warn either."""
    gw = gateway_factory(one_model("no-such-program-issue30 --port ${PORT}"))
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "program 'no-such-program-issue30' not found" in message, message
    warned = [line for line in gw.log().splitlines() if "no-such-program-issue30" in line]
    assert warned and "warning: models.m.backends[0].cmd: program" in warned[0], gw.log()


def test_L3_start_exceeding_health_timeout_is_killed_and_fails(gateway_factory):
    gw = gateway_factory(one_model(fake_cmd("--load-seconds", "600")), health_timeout="1s")
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    assert response.status_code == 502
    assert "--health-timeout" in response.json()["error"]["message"]
    log = (gw.home / "logs" / "m_0.log").read_text()
    pid = int(log.split("spawned pid ")[1].split()[0])
    assert not group_alive(pid)  # its own session: the group id is its pid
    assert gw.records() == {}


def test_L3_failed_starts_back_off_before_the_next_try(gateway_factory):
    cmd = fake_cmd("--exit-after-seconds", "0")
    gw = gateway_factory(one_model(cmd))
    first = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    second = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert first.status_code == second.status_code == 502
    assert "retries in" in second.json()["error"]["message"]
    assert starts(gw) == 1  # the second request did not spawn again during the back-off
    wait_for(
        lambda: (
            httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 502
            and starts(gw) == 2
        ),
        timeout=10,
        interval=0.2,
        what="a second try once the back-off has passed",
    )


@pytest.mark.serve_process
def test_L5_shutdown_stops_every_backend_it_started(gateway_factory):
    config = f"""
models:
  a:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
  b:
    backends: [{{cmd: "{fake_cmd("--ignore-sigterm")}", proxy: "${{PORT}}", stopGrace: 1s}}]
"""
    gw = gateway_factory(config)
    for model in ("a", "b"):
        r = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "model": model}, timeout=30)
        assert r.status_code == 200
    groups = {name: int(rec["pgid"]) for name, rec in gw.records().items()}
    assert set(groups) == {"a#0", "b#0"}
    gw.signal(signal.SIGTERM)
    assert gw.wait_exit(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert not any(group_alive(g) for g in groups.values())  # b needed SIGKILL after grace
    assert gw.records() == {}


@pytest.mark.serve_process
def test_L5_sigint_stops_backends_too(gateway_factory):
    gw = gateway_factory(one_model(fake_cmd()))
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    pgid = int(gw.records()["m#0"]["pgid"])
    gw.signal(signal.SIGINT)
    gw.wait_exit(30)
    assert not group_alive(pgid)


@pytest.mark.serve_process
def test_L5_restart_after_crash_readopts_a_healthy_recorded_backend(gateway_factory, tmp_path):
    config = one_model(fake_cmd())
    first = gateway_factory(config)
    assert httpx.post(first.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    pid = first.pid_of("m#0")
    first.signal(signal.SIGKILL)
    first.wait_exit()
    assert psutil.pid_exists(pid)  # a crash of corrallm leaves its backend running

    second = gateway_factory(config, home=first.home)
    response = httpx.post(second.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200
    assert second.pid_of("m#0") == pid  # served by the adopted process, not a new spawn
    assert "re-adopted pid" in (second.home / "logs" / "m_0.log").read_text()
    second.signal(signal.SIGTERM)
    second.wait_exit()
    assert process_gone(pid)


@pytest.mark.serve_process
def test_L5_restart_kills_a_recorded_backend_whose_health_does_not_answer(gateway_factory):
    config = one_model(fake_cmd())
    first = gateway_factory(config)
    assert httpx.post(first.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    record = first.records()["m#0"]
    first.signal(signal.SIGKILL)
    first.wait_exit()
    os.killpg(int(record["pgid"]), signal.SIGSTOP)  # alive, but its health never answers
    try:
        second = gateway_factory(config, home=first.home)
        wait_for(lambda: not group_alive(int(record["pgid"])), 30, what="the group killed")
        response = httpx.post(second.v1 + "/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 200
        assert second.pid_of("m#0") != record["pid"]
    finally:
        kill_group(int(record["pgid"]))


def test_L5_never_kills_a_process_it_did_not_start(gateway_factory, tmp_path):
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        home = tmp_path / "home"
        (home / "run").mkdir(parents=True)
        # A record that names the stranger's pid, but not its identity (create time).
        (home / "run" / "m_0.json").write_text(
            json.dumps(
                {
                    "backend": "m#0",
                    "pid": stranger.pid,
                    "pgid": stranger.pid,
                    "started": 1.0,
                    "port": free_port(),
                    "base_url": "http://127.0.0.1:1",
                    "health_url": "http://127.0.0.1:1/health",
                    "cmd": fake_cmd(),
                }
            )
        )
        gateway_factory(one_model(fake_cmd()), home=home)
        assert stranger.poll() is None
        assert not (home / "run" / "m_0.json").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_L7_backend_without_cmd_is_a_pure_proxy_never_spawned(gateway_factory, fake_backend):
    gw = gateway_factory(f"models: {{m: {{backends: [{{proxy: {fake_backend.port}}}]}}}}")
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200
    assert gw.records() == {}
    assert not (gw.home / "logs").exists()


def test_L8_an_extension_hosts_several_models_in_one_process(gateway_factory):
    config = f"""
extensions:
  shared:
    cmd: "{fake_cmd()}"
    proxy: ${{PORT}}
models:
  one: {{backends: [{{extension: shared, maxConcurrent: 2}}]}}
  two: {{backends: [{{extension: shared, type: embed}}]}}
"""
    gw = gateway_factory(config)
    chat = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "model": "one"}, timeout=30)
    embed = httpx.post(gw.v1 + "/embeddings", json={"model": "two", "input": "x"}, timeout=30)
    assert chat.status_code == embed.status_code == 200
    assert list(gw.records()) == ["extension:shared"]
    log = (gw.home / "logs" / "extension_shared.log").read_text()
    assert log.count("starting: ") == 1


@pytest.mark.serve_process
def test_M4_an_adopted_backend_is_probed_and_failed_when_it_stops_answering(gateway_factory):
    config = one_model(fake_cmd(), health={"interval": "0.5s", "failures": 2})
    first = gateway_factory(config)
    assert httpx.post(first.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    record = first.records()["m#0"]
    first.signal(signal.SIGKILL)
    first.wait_exit()
    second = gateway_factory(config, home=first.home)
    wait_for(lambda: second.state("m#0") == "ready", 10, what="re-adopted")
    pgid = int(record["pgid"])
    try:
        os.killpg(pgid, signal.SIGSTOP)  # alive, but it answers nothing from now on
        stopped_at = time.monotonic()
        wait_for(lambda: second.state("m#0") == "failed", 10, what="failed as unresponsive")
        detected = time.monotonic() - stopped_at
        wait_for(lambda: not group_alive(pgid), 10, what="the hung group killed")
        backend = second.overview_backend("m#0")
        assert str(backend["last_error"]).startswith("unresponsive: 2 health checks in a row")
        assert detected < 0.5 * 2 + 0.5 + 2.0  # interval x failures + a probe's bound, + slack
        # Not persistent: the next request starts a new process at once.
        response = httpx.post(second.v1 + "/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 200
        assert second.pid_of("m#0") != record["pid"]
    finally:
        kill_group(pgid)
