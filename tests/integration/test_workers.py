"""`corrallm serve --workers 2` (SPEC §13, issue 31) as a real process: two relaying
workers on one port behind one owner of state. Requests spread over both; a slot, a
queue, a preemption and an operator's cancel behave as in one process; /metrics counts
once; a worker killed mid-stream frees what it held and comes back; the owner killed
takes its workers with it and leaves its backend to be re-adopted; SIGHUP and SIGTERM
reach every worker."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from typing import Any

import httpx
import psutil
import pytest

from tests.support.calls import CHAT, Call
from tests.support.processes import Gateway, fake_cmd, process_gone, wait_for

pytestmark = pytest.mark.serve_process

TWO = {"CORRALLM_WORKERS": "2"}

GROUPS = """
priorityGroups:
  interactive:
    weight: 10
    onSaturated: {default: {preempt: true, queue: true}}
  batch:
    weight: 1
    interruptible: true
    onSaturated: {default: {queue: true}}
keys: {ikey: interactive, bkey: batch}
"""


def config(*flags: str, name: str = "slow") -> str:
    return f"""
models:
  {name}:
    backends: [{{cmd: "{fake_cmd(*flags)}", proxy: "${{PORT}}", maxConcurrent: 1}}]
"""


def workers(gw: Gateway) -> list[psutil.Process]:
    """The owner's live worker processes."""
    try:
        children = psutil.Process(gw.proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            worker = "corrallm.workers.worker" in " ".join(child.cmdline())
            if worker and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def two_workers(gw: Gateway) -> list[psutil.Process]:
    def both() -> list[psutil.Process] | None:
        found = workers(gw)
        return found if len(found) == 2 else None

    return wait_for(both, 20, what="2 workers")


def held(gw: Gateway) -> list[dict[str, Any]]:
    r = gw.api("GET", "requests")
    assert r.status_code == 200, r.text
    return r.json()["requests"]


def chat(gw: Gateway, model: str = "slow", key: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": model, **CHAT, **body},
        headers=headers,
        timeout=60,
    )


def requests_counted(gw: Gateway) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("corrallm_requests_total{")
    )


class RawStream:
    """A streamed chat request on a socket of its own: the test knows its local port
    (to find the worker holding it) and sees the connection end."""

    def __init__(self, gw: Gateway, model: str = "slow", head: bytes = b"") -> None:
        host, port = gw.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        body = json.dumps({"model": model, "stream": True, **CHAT}).encode()
        self.sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: corrallm\r\n"
            + head
            + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            + body
        )
        self.received = b""

    def read_until(self, marker: bytes) -> None:
        while marker not in self.received:
            chunk = self.sock.recv(65536)
            assert chunk, f"the connection ended before {marker!r}: {self.received!r}"
            self.received += chunk

    def read_to_end(self, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
        except ConnectionResetError:
            pass
        return self.received

    def holder(self, gw: Gateway) -> psutil.Process:
        port = self.sock.getsockname()[1]
        for worker in workers(gw):
            for conn in worker.net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == port:
                    return worker
        raise AssertionError("no worker holds the stream's connection")


def test_workers_spread_requests_over_both_and_metrics_count_each_once(gateway_factory):
    gw = gateway_factory(config(), env=TWO)
    two_workers(gw)
    answers = [chat(gw) for _ in range(24)]  # a new connection each: the kernel spreads them
    assert [r.status_code for r in answers] == [200] * 24
    # Each worker names its requests with its own prefix (observe/context.py).
    prefixes = {r.headers["x-corrallm-request-id"][:8] for r in answers}
    assert len(prefixes) == 2
    # Counted by the workers that served them, each asked for its counts as /metrics is
    # read: exact at once, no wait (C6).
    assert requests_counted(gw) == 24
    assert gw.api("GET", "overview").status_code == 200  # relayed to the owner


def test_C3_each_worker_writes_the_activity_rows_of_the_requests_it_served(gateway_factory):
    gw = gateway_factory(config(), env=TWO)
    two_workers(gw)
    answers = [chat(gw) for _ in range(12)]
    ids = {r.headers["x-corrallm-request-id"] for r in answers}
    assert len({i[:8] for i in ids}) == 2  # both workers served some

    def written() -> list[dict[str, Any]] | None:
        rows = gw.api("GET", "activity?limit=100").json()["rows"]
        ours = [r for r in rows if r["request_id"] in ids]
        return ours if len(ours) == 12 else None

    rows = wait_for(written, 10, what="12 activity rows")
    assert {(r["model"], r["backend"], r["status"], r["spilled"]) for r in rows} == {
        ("slow", "slow#0", 200, False)
    }
    assert all(r["completion_tokens"] > 0 and r["dwell_ms"] >= 0 for r in rows)


def test_S4_O1_a_stream_holds_the_one_slot_a_second_request_queues_at_the_owner(
    gateway_factory, calls
):
    gw = gateway_factory(config("--tokens", "100", "--token-delay", "0.02"), env=TWO)
    two_workers(gw)
    calls.append(running := Call(gw, "slow", stream=True))
    wait_for(lambda: any(r["state"] == "running" for r in held(gw)), 30, what="running")
    calls.append(queued := Call(gw, "slow", stream=False))
    wait_for(
        lambda: sorted(r["state"] for r in held(gw)) == ["queued", "running"], 30, what="queued"
    )
    wait_for(running.finished, 30, what="the stream")
    wait_for(queued.finished, 30, what="the queued request")
    assert (running.status, running.events[-1], queued.status) == (200, "[DONE]", 200)
    wait_for(lambda: held(gw) == [], 10, what="nothing held")


def test_S4_a_stream_a_worker_holds_is_preempted_by_a_request_on_either_worker(
    gateway_factory,
):
    gw = gateway_factory(GROUPS + config("--tokens", "200", "--token-delay", "0.03"), env=TWO)
    two_workers(gw)
    events: list[bytes] = []
    first = threading.Event()

    def consume() -> None:
        body = {"model": "slow", "stream": True, **CHAT}
        headers = {"Authorization": "Bearer bkey"}
        with httpx.stream(
            "POST", gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60
        ) as r:
            raw = b""
            for chunk in r.iter_raw():
                raw += chunk
                first.set()
            events.extend(e for e in raw.split(b"\n\n") if e)

    victim = threading.Thread(target=consume, daemon=True)
    victim.start()
    assert first.wait(30)
    assert chat(gw, key="ikey", max_tokens=2).status_code == 200
    victim.join(30)
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "preempted"


def test_O1_an_operator_cancels_a_stream_a_worker_holds(gateway_factory, calls):
    gw = gateway_factory(config("--tokens", "400", "--token-delay", "0.02"), env=TWO)
    two_workers(gw)
    calls.append(running := Call(gw, "slow", stream=True))
    wait_for(lambda: any(r["state"] == "running" for r in held(gw)), 30, what="running")
    wait_for(lambda: len(running.events) >= 3, 30, what="tokens")
    (entry,) = held(gw)
    assert entry["id"] == running.headers["x-corrallm-request-id"]
    cancel = gw.api("POST", f"requests/{entry['id']}/cancel")
    assert cancel.status_code == 200 and cancel.json()["cancelled"] is True
    wait_for(running.finished, 30, what="the stream ended")
    assert running.events[-1] == "[DONE]"
    assert json.loads(running.events[-2])["error"]["code"] == "cancelled"
    wait_for(lambda: held(gw) == [], 10, what="nothing held")


@pytest.mark.parametrize("forwarded", [False, True], ids=["direct", "forwarded"])
def test_S7_X4_a_client_that_leaves_mid_stream_frees_its_slot_at_once(gateway_factory, forwarded):
    """A request another gateway forwarded (a lane header) is relayed up to the owner
    (workers/upward.py): its client leaving must reach the owner as well."""
    gw = gateway_factory(config("--tokens", "400", "--token-delay", "0.05"), env=TWO)
    two_workers(gw)
    stream = RawStream(gw, head=b"x-corrallm-lane: default\r\n" if forwarded else b"")
    stream.read_until(b"data:")
    assert len(held(gw)) == 1
    stream.sock.close()
    wait_for(lambda: held(gw) == [], 5, what="the stream's slot freed")
    assert chat(gw, max_tokens=2).status_code == 200  # the one slot is free


def test_workers_a_worker_killed_mid_stream_frees_its_slot_and_is_respawned(gateway_factory):
    gw = gateway_factory(config("--tokens", "400", "--token-delay", "0.02"), env=TWO)
    before = {w.pid for w in two_workers(gw)}
    stream = RawStream(gw)
    stream.read_until(b"data: ")
    victim = stream.holder(gw)
    assert [r["state"] for r in held(gw)] == ["running"]
    killed = time.monotonic()
    victim.kill()
    stream.read_to_end(10)  # its client sees the connection end, the answer cut short
    stream.sock.close()
    assert b"[DONE]" not in stream.received
    wait_for(lambda: held(gw) == [], 5, interval=0.05, what="its request let go")
    assert time.monotonic() - killed < 1.0 + 0.5  # (the API's own round trip on top)
    # The one slot is free: a new request is served at once (not after a timeout).
    assert chat(gw).status_code == 200
    after = {w.pid for w in two_workers(gw)}
    assert victim.pid not in after and len(after & before) == 1
    assert "left holding 1 requests" in gw.log()


def test_L5_the_owner_killed_takes_its_workers_and_its_backend_is_readopted(gateway_factory):
    cfg = config()
    first = gateway_factory(cfg, env=TWO)
    pids = [w.pid for w in two_workers(first)]
    assert chat(first).status_code == 200
    backend = first.pid_of("slow#0")
    first.signal(signal.SIGKILL)
    first.wait_exit()
    wait_for(lambda: all(process_gone(p) for p in pids), 10, what="the workers gone")
    assert psutil.pid_exists(backend)  # as after a single process's crash (L5)

    second = gateway_factory(cfg, env=TWO, home=first.home)
    two_workers(second)
    assert chat(second).status_code == 200
    assert second.pid_of("slow#0") == backend  # re-adopted, not spawned again


def test_P6_a_model_a_sighup_reload_adds_is_served_by_every_worker(gateway_factory):
    gw = gateway_factory(config(), env=TWO)
    two_workers(gw)
    assert chat(gw, "added").status_code == 404
    assert gw.config_path is not None
    gw.config_path.write_text(config() + config(name="added").split("models:\n", 1)[1])
    gw.signal(signal.SIGHUP)
    wait_for(lambda: chat(gw, "added").status_code == 200, 30, what="the model added")
    answers = [chat(gw, "added") for _ in range(12)]
    assert [r.status_code for r in answers] == [200] * 12
    assert len({r.headers["x-corrallm-request-id"][:8] for r in answers}) == 2
    assert all(w.is_running() for w in workers(gw))  # SIGHUP is the owner's, not theirs


def test_P6_a_reload_is_in_force_on_every_worker_when_its_answer_comes(gateway_factory):
    gw = gateway_factory(config(), env=TWO)
    two_workers(gw)
    assert gw.config_path is not None
    gw.config_path.write_text(config() + config(name="added").split("models:\n", 1)[1])
    assert gw.api("POST", "config/reload").status_code == 200
    # No wait: each worker answered APPLIED before the reload did (workers/owner.py).
    answers = [chat(gw, "added") for _ in range(12)]
    assert [r.status_code for r in answers] == [200] * 12
    assert len({r.headers["x-corrallm-request-id"][:8] for r in answers}) == 2


def test_T2_a_key_made_or_revoked_is_in_force_on_every_worker_when_its_answer_comes(
    gateway_factory,
):
    gw = gateway_factory("scheduler: {requireKeys: true}\n" + GROUPS + config(), env=TWO)
    two_workers(gw)
    made = gw.api("POST", "keys", {"name": "carol", "group": "batch"})
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    answers = [chat(gw, key=secret) for _ in range(12)]
    assert [r.status_code for r in answers] == [200] * 12
    assert len({r.headers["x-corrallm-request-id"][:8] for r in answers}) == 2
    assert gw.api("DELETE", "keys/carol").status_code == 200
    assert [chat(gw, key=secret).status_code for _ in range(12)] == [401] * 12


def test_L5_sigterm_drains_every_worker_then_stops_the_backend(gateway_factory, calls):
    gw = gateway_factory(config("--tokens", "100", "--token-delay", "0.02"), env=TWO)
    pids = [w.pid for w in two_workers(gw)]
    calls.append(running := Call(gw, "slow", stream=True))
    wait_for(lambda: len(running.events) >= 3, 30, what="a stream under way")
    backend = gw.pid_of("slow#0")
    gw.signal(signal.SIGTERM)
    wait_for(running.finished, 30, what="the stream")
    assert running.status == 200 and running.events[-1] == "[DONE]"  # drained, not cut
    gw.wait_exit(30)
    assert all(process_gone(p) for p in pids)
    wait_for(lambda: process_gone(backend), 10, what="the backend stopped")


def test_workers_refuse_a_config_with_peers_at_start(gateway_factory):
    peered = config() + "peers: {other: {url: 'http://127.0.0.1:9', token: t}}\n"
    gw = gateway_factory(peered, env=TWO, wait=False)
    assert gw.wait_exit(20) == 1
    assert "--workers does not serve peers yet" in gw.log()
