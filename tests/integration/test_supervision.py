"""SPEC §10 P2: command, docker and systemd supervision. `docker` and `systemctl` are
stand-ins on PATH (no engine or systemd here) that record their calls and start and stop a
fake backend, so the exact commands corrallm runs are checked."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import free_port, kill_group, process_gone, wait_for

STANDINS = Path(__file__).parent.parent / "support" / "standins"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def standin(tmp_path: Path):
    state = tmp_path / "standin"
    state.mkdir()
    port = free_port()
    env = {
        "PATH": f"{STANDINS}{os.pathsep}{os.environ['PATH']}",
        "STANDIN_DIR": str(state),
        "STANDIN_PORT": str(port),
        "CORRALLM_TEST_PYTHON": sys.executable,
    }
    yield state, port, env
    for pid_file in state.glob("*.pid"):
        pid = int(pid_file.read_text())
        if psutil.pid_exists(pid):
            kill_group(pid)


def calls(state: Path) -> list[str]:
    path = state / "calls"
    return path.read_text().splitlines() if path.exists() else []


def backend_pid(state: Path, name: str) -> int:
    pid_file = state / f"{name}.pid"
    wait_for(pid_file.exists, 10, what=f"{pid_file} written by the stand-in")
    return int(pid_file.read_text())


@pytest.mark.parametrize(
    ("kind", "key", "name", "start", "stop"),
    [
        (
            "docker",
            "dockerContainer",
            "llm-box",
            "docker start llm-box",
            "docker stop -t 3 llm-box",
        ),
        (
            "systemd",
            "systemdUnit",
            "llm.service",
            "systemctl start llm.service",
            "systemctl stop llm.service",
        ),
    ],
)
def test_P2_docker_and_systemd_backends_start_and_stop_by_their_commands(
    gateway_factory, standin, kind, key, name, start, stop
):
    state, port, env = standin
    config = f"""
models:
  m: {{backends: [{{supervision: {kind}, {key}: {name}, proxy: {port}, stopGrace: 3s}}]}}
"""
    gw = gateway_factory(config, env=env)
    assert calls(state) == []  # nothing started before a request needs it
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert calls(state) == [start]
    pid = backend_pid(state, name)
    assert gw.api("POST", "models/unload", {"model": "m"}).json()["state"] == "stopped"
    assert calls(state) == [start, stop]
    wait_for(lambda: process_gone(pid), 10)
    assert gw.records() == {}  # not a process corrallm owns: no PID record


def test_P2_a_busy_docker_backend_is_stopped_only_after_its_requests_finish(
    gateway_factory, standin
):
    state, port, env = standin
    config = f"""
models:
  m: {{backends: [{{supervision: docker, dockerContainer: box, proxy: {port}}}]}}
"""
    gw = gateway_factory(config, env=env)
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    order: list[str] = []
    streaming = threading.Event()

    def slow() -> None:
        body = {**CHAT, "stream": True, "max_tokens": 16}
        with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                streaming.set()
        order.append("stream done")

    reader = threading.Thread(target=slow)
    reader.start()
    assert streaming.wait(10)
    unload = gw.api("POST", "models/unload", {"model": "m"})
    order.append("unloaded")
    reader.join(30)
    assert unload.status_code == 200
    assert order == ["stream done", "unloaded"]
    assert calls(state)[-1] == "docker stop -t 10 box"


@pytest.mark.serve_process
def test_P2_command_supervision_runs_cmd_and_stops_with_stop(gateway_factory, standin, tmp_path):
    state, _, env = standin
    pid_file = tmp_path / "cmd.pid"
    serve = f"exec {sys.executable} -m corrallm fake-backend --port ${{PORT}}"
    cmd = f"sh -c 'echo $$ > {pid_file}; {serve}'"
    config = f"""
models:
  m:
    backends:
      - supervision: command
        cmd: "{cmd}"
        stop: "stopper {pid_file}"
        proxy: ${{PORT}}
"""
    gw = gateway_factory(config, env=env)
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    pid = int(pid_file.read_text())
    gw.signal(signal.SIGTERM)  # shutdown stops what it started, by its stop command
    gw.wait_exit(30)
    assert calls(state) == [f"stopper {pid_file}"]
    assert process_gone(pid)
