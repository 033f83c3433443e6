"""The in-process harness (tests/support/inprocess.py) keeps tests apart: a gateway served
in a thread of the test process leaves no thread, file descriptor or backend process
behind once stopped, and its log holds its own records, redacted."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx

from tests.support.inprocess import start_in_process
from tests.support.processes import fake_cmd, group_alive, wait_for

CONFIG = f"""
models:
  m:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
"""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _serve_once(tmp: Path) -> int:
    """One gateway: a request, the management API, GraphQL; stopped. Its backend's pgid."""
    tmp.mkdir()
    gw = start_in_process(CONFIG, tmp)
    try:
        assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert gw.api("GET", "overview").status_code == 200
        graphql = httpx.post(
            gw.url + "/api/graphql",
            json={"query": "{ lanes { name } }"},
            headers={"Authorization": f"Bearer {gw.token}"},
            timeout=30,
        )
        assert graphql.status_code == 200, graphql.text
        pgid = int(gw.records()["m#0"]["pgid"])  # type: ignore[call-overload]
    finally:
        gw.stop()
    log = gw.log()
    assert "transition=starting->ready" in log and gw.token not in log
    return pgid


def test_a_stopped_in_process_gateway_leaves_no_thread_fd_or_process(tmp_path: Path) -> None:
    threads = set(threading.enumerate())
    _serve_once(tmp_path / "warm")  # what is opened once per process (modules, the loop's)
    fds = _fds()
    pgid = _serve_once(tmp_path / "second")
    assert set(threading.enumerate()) == threads
    assert _fds() == fds
    wait_for(lambda: not group_alive(pgid), 10, what="the backend's group gone")
