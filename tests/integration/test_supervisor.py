"""SPEC §4 L4/L6 on a real fake-backend process, driven through its Supervisor in-process."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from corrallm.config.schema import BackendConfig as Backend
from corrallm.lifecycle import starting as supervisor_module
from corrallm.lifecycle.addresses import free_port
from corrallm.lifecycle.errors import BackendFailed, LifecycleBusy
from corrallm.lifecycle.process import group_alive
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from tests.support.processes import fake_cmd, running_fake_backend


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def make(http: aiohttp.ClientSession, tmp_path: Path):
    made: list[Supervisor] = []

    async def probe(url: str) -> int | None:
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    def factory(*flags: str, **spec: object) -> Supervisor:
        backend = Backend(**{"cmd": fake_cmd(*flags), "proxy": "${PORT}", **spec})
        sup = Supervisor(f"b{len(made)}", backend, probe, tmp_path, health_timeout=20)
        made.append(sup)
        return sup

    yield factory
    for sup in made:
        await sup.stop()


async def wait_state(sup: Supervisor, state: State, within: float = 10) -> None:
    async with asyncio.timeout(within):
        while sup.state is not state:
            await sup._next_change()


async def test_L4_explicit_load_is_refused_while_the_process_is_loading(make):
    sup = make("--load-seconds", "1")
    starting = asyncio.create_task(sup.ensure_ready())
    await wait_state(sup, State.STARTING)
    with pytest.raises(LifecycleBusy):
        await sup.load()
    with pytest.raises(LifecycleBusy):
        await sup.unload()
    await starting
    assert sup.state is State.READY
    await sup.load()  # a settled, ready process: load is a no-op


async def test_L4_unload_drains_in_flight_requests_before_stopping(make, http):
    sup = make("--tokens", "10", "--token-delay", "0.1")
    await sup.ensure_ready()
    assert sup.enter()
    url = sup.base_url + "/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}

    async def stream() -> bytes:
        async with http.post(url, json=body) as r:
            return await r.read()

    streaming = asyncio.create_task(stream())
    unloading = asyncio.create_task(sup.unload())
    await wait_state(sup, State.DRAINING)
    assert not sup.enter()  # new requests are not admitted to a draining process
    with pytest.raises(LifecycleBusy):
        await sup.load()
    data = await streaming  # the stream finishes intact while draining
    assert data.rstrip().endswith(b"data: [DONE]")
    sup.leave()
    await unloading
    assert sup.state is State.STOPPED and sup.pid is None


async def test_L4_sigterm_then_sigkill_after_stop_grace(make):
    sup = make("--ignore-sigterm", stopGrace="0.5s")
    await sup.ensure_ready()
    pgid = sup.proc.pgid
    await sup.unload()
    assert sup.state is State.STOPPED
    assert not group_alive(pgid)
    assert "stopped (killed)" in "\n".join(sup.logs.lines)


async def test_L4_requests_wait_out_a_teardown_then_get_a_fresh_process(make):
    sup = make(stopGrace="5s")
    await sup.ensure_ready()
    old_pid = sup.pid
    unloading = asyncio.create_task(sup.unload())
    await wait_state(sup, State.STOPPING)
    await sup.ensure_ready()  # waits for STOPPED, then starts a replacement
    await unloading
    assert sup.state is State.READY and sup.pid != old_pid
    assert not group_alive(old_pid)


async def test_L6_n_ctx_and_n_slots_parsed_from_the_backend_log(make):
    sup = make("--n-ctx", "2048", "--n-slots", "3")
    await sup.ensure_ready()
    assert (sup.logs.n_ctx, sup.logs.n_slots) == (2048, 3)
    assert (sup.home / "logs" / "b0.log").read_text().count("n_slots") >= 1


async def test_L6_a_backends_output_goes_to_its_log_file_never_to_a_pipe(make):
    # A pipe's reader is this process: after a crash of corrallm the backend would be
    # writing into a pipe nobody reads, and die of SIGPIPE (tests/faults/test_restart.py).
    sup = make()
    await sup.ensure_ready()
    log = sup.home / "logs" / "b0.log"
    targets = {os.readlink(f"/proc/{sup.pid}/fd/{fd}") for fd in (1, 2)}
    assert targets == {str(log)}
    assert any("server is listening" in line for line in sup.logs.tail(50))  # followed


async def test_L1_a_fixed_port_another_program_answers_on_fails_the_start_naming_it(make, tmp_path):
    """Another server holds the backend's port and answers its health check: the start
    fails as port_taken, with that server's pid, and no request is routed to it."""
    with running_fake_backend(tmp_path) as stranger:
        port = str(stranger.port)
        sup = make(cmd=f"corrallm fake-backend --port {port}", proxy=port)
        with pytest.raises(BackendFailed) as failed:
            await sup.ensure_ready()
    assert (sup.state, sup.failure_reason) == (State.FAILED, "port_taken")
    assert f"port {port} is held by pid {stranger.proc.pid} (" in str(failed.value)
    assert sup.pid is None  # its own process (which could not bind) was reaped


async def test_L1_a_picked_port_another_program_bound_first_is_picked_again(
    make, http, tmp_path, monkeypatch
):
    """The race itself: corrallm picks a free port, another program binds it before the
    backend does (here: the port a running server holds is what gets picked)."""
    with running_fake_backend(tmp_path) as stranger:
        picks = iter([stranger.port])

        def pick() -> int:
            return next(picks, None) or free_port()

        monkeypatch.setattr(supervisor_module, "free_port", pick)
        sup = make()
        await sup.ensure_ready()
        log = (sup.home / "logs" / "b0.log").read_text()
        assert (sup.state, sup.port != stranger.port) == (State.READY, True), log
        assert f"port {stranger.port} is held by pid {stranger.proc.pid}" in log
        assert "starting again on another port" in log
        async with http.get(f"http://127.0.0.1:{sup.port}/health") as r:  # the backend's
            assert r.status == 200
        assert stranger.proc.poll() is None
