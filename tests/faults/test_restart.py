"""SPEC §20 / §4 L5: corrallm killed with -9 and restarted, against real processes.

A backend corrallm spawned must outlive corrallm's crash intact: its output goes to its log
file, never to a pipe whose reader (the dead corrallm) is gone. The backend here honours
SIGPIPE like a C server such as llama-server does (Python ignores it by default), so a
pipe left without a reader kills it on its first line of output after the crash.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import group_alive, process_gone, wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

SIGPIPE_BACKEND = """\
import signal
import sys

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a write to a pipe without reader kills it
from corrallm.fake_backend import main

main(sys.argv[1:])
"""


def sigpipe_backend(tmp_path: Path) -> str:
    script = tmp_path / "sigpipe_backend.py"
    script.write_text(SIGPIPE_BACKEND)
    return f"{sys.executable} {script} --port ${{PORT}}"


def config(cmd: str) -> str:
    return f"""
models:
  m:
    backends:
      - cmd: "{cmd}"
        proxy: ${{PORT}}
"""


def backends_running(script: Path) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if str(script) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.info["pid"])
    return found


def chat(gateway) -> httpx.Response:
    return httpx.post(gateway.v1 + "/chat/completions", json=CHAT, timeout=30)


@pytest.mark.serve_process
def test_fault_readopted_backend_survives_its_first_log_line(gateway_factory, tmp_path):
    cmd = sigpipe_backend(tmp_path)
    first = gateway_factory(config(cmd))
    assert chat(first).status_code == 200
    pid = first.pid_of("m#0")
    first.signal(signal.SIGKILL)
    first.wait_exit()

    second = gateway_factory(config(cmd), home=first.home)
    response = chat(second)  # the backend logs a line for it: its first since the crash
    assert response.status_code == 200, response.text
    assert response.headers["x-corrallm-backend"] == "m#0"
    assert [chat(second).status_code for _ in range(5)] == [200] * 5
    assert second.pid_of("m#0") == pid  # the re-adopted process served them all
    assert backends_running(tmp_path / "sigpipe_backend.py") == [pid]  # no duplicate

    # Its output is followed again, from where the file ended at the restart.
    def request_lines() -> list[str]:
        lines = second.api("GET", "models/logs?model=m&lines=200").json()["lines"]
        return [line for line in lines if "log_server_r: request: POST" in line]

    wait_for(lambda: len(request_lines()) >= 6, 10, what="the request log lines followed")
    log = (second.home / "logs" / "m_0.log").read_text()
    assert log.count("log_server_r: request: POST /v1/chat/completions 200") == 7

    second.signal(signal.SIGTERM)
    second.wait_exit(30)
    assert process_gone(pid)
    assert not group_alive(pid)  # its own session: the group id is its pid
    assert backends_running(tmp_path / "sigpipe_backend.py") == []
