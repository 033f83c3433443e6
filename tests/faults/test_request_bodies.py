"""SPEC §22 T5 against a real `corrallm serve`: request bodies that stall, and the bound on
the body bytes all requests hold at once.

The hostile clients are raw loopback sockets that send a head and part of a body, then
nothing. What is asserted is what a client sees: 408 `body_timeout` on every surface that
reads a body, 503 `server_busy` with `Retry-After` while the bound is reached, and the
bytes given back once the requests that held them are over.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.processes import FakeBackend, Gateway, start_fake_backend, wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# Reservations are held by a key, judged from the head: the stalled body needs one.
RESERVER = "sk-reserver-key"


def config(backend: FakeBackend) -> str:
    return (
        f"models: {{m: {{backends: [{{proxy: {backend.port}}}]}}}}\n"
        f"keys: {{reserver: {{secret: {RESERVER}}}}}\n"
    )


def port_of(gw: Gateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def partial_body(
    gw: Gateway, path: str, declared: int, sent: bytes, content_type: str = "application/json"
) -> Iterator[socket.socket]:
    """A connection that sent a head declaring `declared` body bytes and then `sent` of
    them, and nothing more. `/upstream` is the operator's: it carries the admin token;
    a reservation is a key's: it carries one."""
    sock = socket.create_connection(("127.0.0.1", port_of(gw)), timeout=10)
    auth = ""
    if path.startswith("/upstream/"):
        auth = f"Authorization: Bearer {gw.token}\r\n"
    elif path == "/v1/reservations":
        auth = f"Authorization: Bearer {RESERVER}\r\n"
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"{auth}Content-Length: {declared}\r\n\r\n"
        ).encode()
        sock.sendall(head + sent)
        yield sock
    finally:
        sock.close()


def answer_of(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (bounded by `within`), and when the
    first bytes came (seconds from now)."""
    start = time.monotonic()
    first = None
    data = b""
    sock.settimeout(0.2)
    while time.monotonic() - start < within:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        first = first if first is not None else time.monotonic() - start
        data += chunk
    return data, (first if first is not None else float("inf"))


def error_of(answer: bytes) -> dict[str, object]:
    body = orjson.loads(answer.partition(b"\r\n\r\n")[2])
    error = body["error"]
    assert isinstance(error, dict)
    return error


def test_T5_a_body_that_stalls_gets_408_on_every_surface_that_reads_one(
    gateway_factory: Callable[..., Gateway], fake_backend: FakeBackend
) -> None:
    gw = gateway_factory(config(fake_backend), env={"CORRALLM_BODY_TIMEOUT": "1"})
    surfaces = [
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/v1/audio/transcriptions",
        "/v1/reservations",
        "/upstream/m/v1/chat/completions",
    ]
    for path in surfaces:
        with partial_body(gw, path, 100, b'{"model": "m", ') as sock:
            answer, after = answer_of(sock, 10)
        assert answer.startswith(b"HTTP/1.1 408 "), (path, answer)
        assert 0.8 < after < 5, (path, after)
        error = error_of(answer)  # in the surface's own shape: Anthropic's has no code
        assert error.get("code", "body_timeout") == "body_timeout", (path, error)
        assert "CORRALLM_BODY_TIMEOUT" in str(error["message"]), (path, error)
        assert b"connection: close" in answer.lower()
    # The dashboard's sign-in form reads its body through the same reader.
    with partial_body(gw, "/signin", 50, b"token=", "application/x-www-form-urlencoded") as sock:
        answer, _ = answer_of(sock, 10)
    assert answer.startswith(b"HTTP/1.1 408 "), answer

    # A body that keeps moving is never cut, however long it takes in all (3 s > 1 s).
    body = orjson.dumps(CHAT)
    with partial_body(gw, "/v1/chat/completions", len(body), b"") as sock:
        for i in range(0, len(body), len(body) // 6 + 1):
            sock.sendall(body[i : i + len(body) // 6 + 1])
            time.sleep(0.5)  # the pace under test, not synchronisation
        answer, _ = answer_of(sock, 10)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).status_code == 200


def big_chat(size: int) -> bytes:
    """A valid chat body of about `size` bytes."""
    return orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * size}]})


@pytest.mark.serve_process
def test_T5_body_bytes_held_at_once_are_bounded_and_given_back(
    gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    # 20 tokens 0.15 s apart: a streamed answer holds its request's body for about 3 s.
    backend = start_fake_backend(tmp_path, "--tokens", "20", "--token-delay", "0.15")
    try:
        gw = gateway_factory(
            config(backend),
            # One process under CORRALLM_WORKERS too: the bound is each process's own
            # (docs/operations.md), and the kernel may hand each of these connections to
            # another worker, each with its own 1 MiB.
            env={
                "CORRALLM_MAX_BODY_MEMORY": "1MiB",
                "CORRALLM_BODY_TIMEOUT": "60",
                "CORRALLM_WORKERS": "1",
            },
        )
        bound = 2**20

        def fits() -> bool:  # 400 kB more body bytes are taken in
            r = httpx.post(gw.v1 + "/chat/completions", content=big_chat(400_000), timeout=10)
            return r.status_code == 200

        small = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert small.status_code == 200

        # A client that sent 700 kB of a 2 MB body and stalls holds them...
        with partial_body(gw, "/v1/chat/completions", 2_000_000, b"x" * 700_000):
            # ...so a 400 kB body crosses the bound: 503 server_busy, Retry-After.
            def refused() -> httpx.Response | None:
                r = httpx.post(gw.v1 + "/chat/completions", content=big_chat(400_000), timeout=10)
                return r if r.status_code == 503 else None

            busy = wait_for(refused, 10, 0.1, what="a body over the bound refused")
            assert busy.json()["error"]["code"] == "server_busy"
            assert busy.headers["retry-after"] == "1"
            assert "CORRALLM_MAX_BODY_MEMORY" in busy.json()["error"]["message"]
            # A small one still fits beside the stalled 700 kB.
            assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).status_code == 200
        # The stalled client left: its bytes are given back, and the 400 kB body fits.
        wait_for(fits, 10, 0.1, what="the stalled body's bytes given back")

        # A body is held until its request is over, not just until it is read: while a
        # 700 kB streamed request is answered, 400 kB more do not fit; after it, they do.
        with httpx.stream(
            "POST",
            gw.v1 + "/chat/completions",
            content=orjson.dumps({**orjson.loads(big_chat(700_000)), "stream": True}),
            timeout=30,
        ) as streaming:
            assert streaming.status_code == 200
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            r = httpx.post(gw.v1 + "/chat/completions", content=big_chat(400_000), timeout=10)
            assert r.status_code == 503, r.text
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        wait_for(fits, 10, 0.1, what="the streamed request's body given back")
        # Past the bound from the start: a body larger than it never fits.
        r = httpx.post(gw.v1 + "/chat/completions", content=big_chat(bound + 10), timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).status_code == 200
    finally:
        backend.proc.kill()
        backend.proc.wait(10)
