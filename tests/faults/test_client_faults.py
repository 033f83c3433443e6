"""SPEC §15/§20, the faults a client brings, injected against a real `corrallm serve` and
real fake backends, with what the user sees asserted:

- a client that hangs up while streaming or while queued: its slot or place is freed at
  once, the upstream request is cancelled promptly, the row says 499;
- a body over `maxBodySize`: 413 answered before the body is sent;
- malformed and hostile JSON on /v1/chat/completions and /v1/embeddings: a 4xx in the
  OpenAI error shape, never a 5xx, and the gateway serves on;
- the store's disk full while serving: requests still served, rows written once space
  returns.

Already covered elsewhere and not repeated here: the queued request that leaves never
reaching the backend (tests/integration/test_proxy.py::test_S7_...), a 413 for a whole
body over the limit, plain or chunked (test_proxy.py::test_body_over_max_body_size_is_413),
and three malformed bodies (test_proxy.py::test_malformed_json_and_missing_model_are_400).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.observe import RawClient, backend_load, load, request_rows
from tests.support.processes import Gateway, fake_cmd, free_port, wait_for

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
# SPEC §20 asks for the upstream to be cancelled within 100 ms; the suite runs on two
# busy cores, so it asserts a bound ten times that and prints what it measured.
PROMPT = 1.0


def config(*flags: str, slots: int = 1) -> str:
    return f"""
maxBodySize: 2kB
models:
  chat:
    backends: [{{cmd: "{fake_cmd(*flags)}", proxy: "${{PORT}}", maxConcurrent: {slots}}}]
  embed:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: embed}}]
"""


def upstream_stats(gw: Gateway, model: str = "chat") -> dict[str, int]:
    """The fake backend's own counters, through the untracked /upstream passthrough."""
    return gw.upstream("GET", f"{model}/debug/stats", timeout=10).json()


def post_raw(gw: Gateway, payload: dict[str, object]) -> RawClient:
    client = RawClient(gw.url)
    body = orjson.dumps(payload)
    client.send_head(
        "POST", "/v1/chat/completions", {"Content-Type": "application/json"}, len(body)
    )
    client.send(body)
    return client


def read_until(client: RawClient, marker: bytes, limit: float = 30) -> bytes:
    client.sock.settimeout(limit)
    data = b""
    while marker not in data:
        chunk = client.sock.recv(65536)
        assert chunk, f"closed before {marker!r}: {data[-500:]!r}"
        data += chunk
    return data


def assert_openai_error(r: httpx.Response | tuple[int, dict[str, str], bytes]) -> dict:
    body = r.content if isinstance(r, httpx.Response) else r[2]
    error = orjson.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert {"message", "type", "param", "code"} <= error.keys(), error
    return error


# --- S7: a client that hangs up ----------------------------------------------------------


def test_S7_hang_up_mid_stream_cancels_upstream_promptly_frees_the_slot_and_records_499(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gw = gateway_factory(config("--tokens", "200", "--token-delay", "0.02"))
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    cancelled = upstream_stats(gw)["cancelled"]

    client = post_raw(gw, {**CHAT, "stream": True})  # a 4 s stream
    read_until(client, b"data: {")
    assert backend_load(gw, "chat#0")[0] == 1
    client.close()
    gone = time.monotonic()
    wait_for(lambda: upstream_stats(gw)["in_flight"] == 0, 10, 0.005, "the upstream dropped")
    upstream_ended = time.monotonic() - gone
    assert upstream_stats(gw)["cancelled"] == cancelled + 1

    # The only slot is free at once: the next request is admitted without waiting.
    wait_for(lambda: load(gw).idle, 10, 0.01, "the slot given back")
    r = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200

    rows = wait_for(lambda: r if len(r := request_rows(gw)) == 3 else None, 10, 0.1, "3 rows")
    next_row, gone_row = rows[0], rows[1]
    assert (gone_row["status"], gone_row["error"]) == (499, "the client went away")
    assert next_row["status"] == 200 and next_row["dwell_ms"] < 500
    print(f"\nS7 mid-stream: upstream cancelled {upstream_ended * 1000:.0f} ms after the hang-up")
    assert upstream_ended < PROMPT


def test_S7_hang_up_while_queued_frees_the_place_at_once_and_records_499(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gw = gateway_factory(config("--latency", "3"))
    holder: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: holder.append(httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30))
    )
    thread.start()
    try:
        wait_for(lambda: backend_load(gw, "chat#0") == (1, 0), 20, 0.02, "the slot held")
        client = post_raw(gw, {**CHAT, "queued": True})
        wait_for(lambda: backend_load(gw, "chat#0") == (1, 1), 10, 0.01, "one queued")
        client.close()
        gone = time.monotonic()
        wait_for(lambda: backend_load(gw, "chat#0") == (1, 0), 10, 0.005, "the place freed")
        freed = time.monotonic() - gone
        lanes = {lane["name"]: lane for lane in gw.api("GET", "lanes").json()["lanes"]}
        assert lanes["default"]["waiting"] == 0 and lanes["default"]["in_flight"] == 1
    finally:
        thread.join(30)
    assert holder and holder[0].status_code == 200
    rows = wait_for(lambda: r if len(r := request_rows(gw)) == 2 else None, 10, 0.1, "2 rows")
    statuses = sorted((row["status"], row["backend"] or "") for row in rows)
    assert statuses == [(200, "chat#0"), (499, "")], rows
    assert upstream_stats(gw)["completed"] == 1  # only the holder reached the backend
    print(f"\nS7 queued: place freed {freed * 1000:.0f} ms after the hang-up")
    assert freed < PROMPT


class LingeringSSEBackend:
    """A pure-proxy backend that sends a whole chat stream, `data: [DONE]` included, and
    then waits `linger` seconds before ending its chunked body (a server flushing its
    buffers, a proxy in between: the end of the body comes a little after [DONE])."""

    EVENTS = [
        b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n',
        b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]

    def __init__(self, linger: float = 2.0) -> None:
        self.linger = linger
        self.port = free_port()
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.closing = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            )
            for event in self.EVENTS:
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            self.closing.wait(self.linger)
            conn.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.closing.set()
        self.sock.close()


def test_S7_a_stream_whose_done_reached_the_client_is_recorded_as_served(
    gateway_factory: Callable[..., Gateway],
) -> None:
    backend = LingeringSSEBackend()
    try:
        gw = gateway_factory(
            f'models:\n  chat: {{backends: [{{proxy: "http://127.0.0.1:{backend.port}"}}]}}\n'
        )
        client = post_raw(gw, {**CHAT, "stream": True})
        got = read_until(client, b"data: [DONE]")
        client.close()  # as the sync openai SDK does once it reads [DONE]
        assert b'"content":"hi"' in got
        rows = wait_for(lambda: request_rows(gw), 10, 0.1, "the row")
        assert (rows[0]["status"], rows[0]["error"]) == (200, None), rows[0]
    finally:
        backend.close()


# --- a body over maxBodySize -------------------------------------------------------------


def test_413_body_over_max_body_size_is_answered_before_the_body_is_sent(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gw = gateway_factory(config())
    # A declared length far over the limit, and only a few bytes of it sent.
    client = RawClient(gw.url, timeout=5)
    started = time.monotonic()
    client.send_head("POST", "/v1/chat/completions", {"Content-Type": "application/json"}, 10**9)
    client.send(b'{"model": "chat", "messages": [')
    answer = client.read_response()
    declared = time.monotonic() - started
    client.close()
    assert answer[0] == 413
    assert assert_openai_error(answer)["code"] == "body_too_large"

    # No length declared (chunked): refused once the limit is passed, without the end.
    client = RawClient(gw.url, timeout=5)
    started = time.monotonic()
    client.send_head(
        "POST",
        "/v1/chat/completions",
        {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        None,
    )
    piece = b'{"model": "chat", "pad": "' + b"x" * 3000
    client.send(b"%x\r\n%s\r\n" % (len(piece), piece))  # never the final 0-chunk
    answer = client.read_response()
    chunked = time.monotonic() - started
    client.close()
    assert answer[0] == 413 and assert_openai_error(answer)["code"] == "body_too_large"

    print(f"\n413: {declared * 1000:.0f} ms (declared length), {chunked * 1000:.0f} ms (chunked)")
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200


# --- malformed and hostile JSON ----------------------------------------------------------

MESSAGES = b'[{"role": "user", "content": "x"}]'
DEEP = 10_000
HOSTILE: dict[str, bytes] = {
    "empty": b"",
    "not json": b"model=chat&messages=hi",
    "truncated": b'{"model": "chat", "messages": [',
    "trailing garbage": b'{"model": "chat", "messages": ' + MESSAGES + b"} and more",
    "array": b'[{"model": "chat"}]',
    "string": b'"chat"',
    "null": b"null",
    "nested arrays 10k deep": b'{"model": "chat", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "nested objects 10k deep": b'{"model": "chat", "x": '
    + b'{"a":' * DEEP
    + b"1"
    + b"}" * DEEP
    + b"}",
    "NaN": b'{"model": "chat", "messages": ' + MESSAGES + b', "temperature": NaN}',
    "Infinity": b'{"model": "chat", "messages": ' + MESSAGES + b', "max_tokens": -Infinity}',
    "huge number as model": b'{"model": 1e99999, "messages": ' + MESSAGES + b"}",
    "huge integer as model": b'{"model": ' + b"9" * 5000 + b', "messages": ' + MESSAGES + b"}",
    "invalid UTF-8": b'{"model": "ch\xff\xfeat", "messages": ' + MESSAGES + b"}",
    "lone surrogate": b'{"model": "\\ud800", "messages": ' + MESSAGES + b"}",
    "model a number": b'{"model": 42, "messages": ' + MESSAGES + b"}",
    "model null": b'{"model": null, "messages": ' + MESSAGES + b"}",
    "model a list": b'{"model": ["chat"], "messages": ' + MESSAGES + b"}",
    "model an object": b'{"model": {"name": "chat"}, "messages": ' + MESSAGES + b"}",
    "model 100k long": b'{"model": "' + b"m" * 100_000 + b'", "messages": ' + MESSAGES + b"}",
}
# Wrong types behind a valid model name in fields only the backend reads: the gateway
# forwards them (it does not re-validate each backend's API), so the backend decides; the
# fault is a 5xx or a crash. The fake backend accepts some of them, as real ones do.
BACKEND_FIELDS: dict[str, dict[str, bytes]] = {
    "/v1/chat/completions": {
        "messages a string": b'{"model": "chat", "messages": "hello"}',
        "messages null": b'{"model": "chat", "messages": null}',
        "messages numbers": b'{"model": "chat", "messages": [1, 2]}',
    },
    "/v1/embeddings": {
        "input missing": b'{"model": "embed"}',
        "input a number": b'{"model": "embed", "input": 42}',
        "input null": b'{"model": "embed", "input": null}',
    },
}
# `stream` the gateway reads itself (it decides metering and asks for usage by it): a
# non-boolean one is refused, not forwarded for a backend to read its own way.
STREAM_TYPES = {
    "stream a string": b'{"model": "chat", "messages": ' + MESSAGES + b', "stream": "yes"}',
    "stream a number": b'{"model": "chat", "messages": ' + MESSAGES + b', "stream": 1}',
}


def hostile_cases() -> Iterator[object]:
    for endpoint, model in (("/v1/chat/completions", b"chat"), ("/v1/embeddings", b"embed")):
        short = endpoint.rsplit("/", 1)[1]
        for name, body in HOSTILE.items():
            body = body.replace(b'"chat"', b'"' + model + b'"')
            yield pytest.param(endpoint, body, True, id=f"{short}-{name}")
        for name, body in BACKEND_FIELDS[endpoint].items():
            yield pytest.param(endpoint, body, False, id=f"{short}-{name}")
    for name, body in STREAM_TYPES.items():
        yield pytest.param("/v1/chat/completions", body, True, id=f"completions-{name}")


@pytest.fixture(scope="module")
def hostile_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from tests.support.processes import running_gateway

    with running_gateway(config(slots=4), tmp_path_factory.mktemp("hostile")) as gw:
        yield gw
        assert gw.proc.poll() is None, "corrallm died"
        assert "Traceback" not in gw.log(), gw.log()[-5000:]


@pytest.mark.parametrize(("endpoint", "body", "refused"), list(hostile_cases()))
def test_hostile_json_is_a_4xx_in_the_openai_shape_never_a_5xx(
    hostile_gateway: Gateway, endpoint: str, body: bytes, refused: bool
) -> None:
    """`refused`: the gateway itself must answer 4xx; otherwise the backend may accept it,
    but an error is still a 4xx in the OpenAI shape."""
    gw = hostile_gateway
    r = httpx.post(
        gw.url + endpoint,
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if refused or r.status_code >= 400:
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
        assert_openai_error(r)
    # ...and the gateway serves on.
    good = {"model": "embed", "input": "x"} if endpoint.endswith("embeddings") else CHAT
    assert httpx.post(gw.url + endpoint, json=good, timeout=30).status_code == 200


# --- the store's disk full while serving -------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MB tmpfs for the store, unmounted at the end (the gateway is stopped first:
    request this fixture before gateway_factory)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(
            "SKIPPED LOUDLY: the disk-full fault needs a small filesystem and this machine "
            f"does not allow `mount -t tmpfs` ({done.stderr.strip() or done.returncode}); "
            "run the fault suite as root (CI does)."
        )
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(folder: Path) -> Path:
    """Write a file until the filesystem is full; return it (delete it to free the space)."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as f:
        for size in (65536, 512):  # then the last few bytes too
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    assert os.statvfs(folder).f_bavail == 0
    return filler


@pytest.mark.serve_process
def test_store_disk_full_while_serving_requests_are_served_and_rows_catch_up(
    small_disk: Path, gateway_factory: Callable[..., Gateway]
) -> None:
    db = small_disk / "corrallm.db"
    gw = gateway_factory(config(slots=4), env={"CORRALLM_DB": str(db)})
    for _ in range(3):
        assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    wait_for(lambda: len(request_rows(gw)) == 3, 10, 0.1, "the first rows")

    filler = fill(small_disk)
    statuses = []
    for i in range(30):
        if i % 3 == 0:
            with httpx.stream(
                "POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=30
            ) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                statuses.append(r.status_code if lines[-1] == "data: [DONE]" else -1)
        else:
            path, body = (
                ("/embeddings", {"model": "embed", "input": "x"})
                if i % 3 == 1
                else ("/chat/completions", CHAT)
            )
            statuses.append(httpx.post(gw.v1 + path, json=body, timeout=30).status_code)
    assert statuses == [200] * 30
    assert httpx.get(gw.url + "/health", timeout=5).status_code == 200
    wait_for(lambda: "activity flush failed" in gw.log(), 10, 0.1, "a failed flush")
    assert len(request_rows(gw)) == 3  # nothing written while the disk is full...

    filler.unlink()  # ...and every row once space returns
    wait_for(lambda: len(request_rows(gw)) == 33, 15, 0.2, "the rows kept in memory")
    assert gw.proc.poll() is None
