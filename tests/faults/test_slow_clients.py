"""SPEC §15/§20 against a real `corrallm serve`: slowloris clients and oversized heads.

Hostile clients here are raw loopback sockets: slow ones trickle one header byte a
second, large ones stream a never-ending header. What a real client sees is asserted:
its request is answered while they are connected, even past the process's descriptor
limit; the slow ones are closed after the header timeout; a large head gets 431 and the
connection closed, with corrallm's memory flat.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import (
    FakeBackend,
    Gateway,
    cleanup,
    free_port,
    wait_for,
    wait_healthy,
)

SERVE = [sys.executable, "-m", "corrallm", "serve"]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def proxy_config(backend: FakeBackend) -> str:
    return f"models: {{m: {{backends: [{{proxy: {backend.port}}}]}}}}\n"


def port_of(gw: Gateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


class SlowClients:
    """`count` connections trickling a request head, one byte every `period` seconds,
    from one thread; `open()` is how many the server has not closed yet."""

    def __init__(self, port: int, count: int, period: float = 1.0) -> None:
        self.socks: list[socket.socket] = []
        self.closed: set[socket.socket] = set()
        self.received: dict[socket.socket, bytes] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.setblocking(False)
            self.socks.append(sock)
            self._send(sock, f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow-{i}: ".encode())
        self.thread = threading.Thread(target=self._trickle, args=(period,), daemon=True)
        self.thread.start()

    def _send(self, sock: socket.socket, data: bytes) -> None:
        try:
            sock.send(data)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.closed.add(sock)

    def _trickle(self, period: float) -> None:
        deadline = time.monotonic() + 120  # bounded, whatever the test does
        while not self.stop.wait(period) and time.monotonic() < deadline:
            with self.lock:
                for sock in self.socks:
                    if sock not in self.closed:
                        self._send(sock, b"x")

    def open(self) -> int:
        """Connections still open: reads whatever the server sent, notes EOF and resets."""
        with self.lock:
            live = [s for s in self.socks if s not in self.closed]
            poller = select.poll()
            for sock in live:
                poller.register(sock, select.POLLIN)
            by_fd = {sock.fileno(): sock for sock in live}
            for fd, _ in poller.poll(0):
                sock = by_fd[fd]
                for _ in range(16):  # bounded: an answer is a few hundred bytes
                    try:
                        data = sock.recv(65536)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        data = b""
                    if not data:
                        self.closed.add(sock)
                        break
                    self.received[sock] = self.received.get(sock, b"") + data
            return len(self.socks) - len(self.closed)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


@contextlib.contextmanager
def slow_clients(port: int, count: int, period: float = 1.0) -> Iterator[SlowClients]:
    clients = SlowClients(port, count, period)
    try:
        yield clients
    finally:
        clients.close()


def read_response(conn: socket.socket) -> bytes:
    """One whole response with a content-length (bounded by the socket's timeout)."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length and (chunk := conn.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body


def timed_chat(gw: Gateway, timeout: float = 5.0) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=timeout)
    return r, time.monotonic() - start


def test_F_slowloris_100_connections_a_normal_request_is_answered_and_they_time_out(
    gateway_factory: Callable[..., Gateway], fake_backend: FakeBackend
) -> None:
    gw = gateway_factory(proxy_config(fake_backend), env={"CORRALLM_HEADER_TIMEOUT": "4"})
    with slow_clients(port_of(gw), 120) as slow:
        assert slow.open() == 120
        r, took = timed_chat(gw)
        assert r.status_code == 200 and took < 5, (r.status_code, took)
        assert slow.open() == 120  # the answer came while every slow client was connected
        # ...and the header timeout closes them (4 s after each connected), with a 408.
        wait_for(lambda: slow.open() == 0, 15, 0.1, what="slow connections closed")
        answers = list(slow.received.values())
        assert answers and all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[:1]
        assert b'"code": "request_timeout"' in answers[0]
    r, took = timed_chat(gw)
    assert r.status_code == 200


@pytest.mark.serve_process
def test_F_header_timeout_counts_per_head_not_idle_keepalive_nor_slow_answers(
    gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    from tests.support.processes import start_fake_backend

    backend = start_fake_backend(tmp_path, "--tokens", "30", "--token-delay", "0.1")
    try:
        gw = gateway_factory(proxy_config(backend), env={"CORRALLM_HEADER_TIMEOUT": "2"})
        port = port_of(gw)
        # A connection that never sends a byte is closed, without an answer.
        silent = socket.create_connection(("127.0.0.1", port), timeout=8)
        start = time.monotonic()
        assert silent.recv(100) == b""
        assert 1.5 < time.monotonic() - start < 6
        silent.close()

        # Keep-alive: a request answered, 1.5 s idle (within uvicorn's 5 s keep-alive),
        # then a second head trickled: closed about 2 s after its first byte, with 408.
        with socket.create_connection(("127.0.0.1", port), timeout=8) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(conn).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.5)  # the idle gap under test, not synchronisation
            conn.sendall(b"GET /health HTTP/1.1\r\n")
            start = time.monotonic()
            answer = b""
            conn.settimeout(0.4)
            while time.monotonic() - start < 8:
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    chunk = None
                except ConnectionResetError:
                    break  # closed with trickled bytes unread: the kernel answers RST
                if chunk == b"":
                    break
                if chunk:
                    answer += chunk
                if not answer:  # trickle until the answer starts, not into a closed socket
                    with contextlib.suppress(OSError):
                        conn.send(b"x")
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert 1.5 < time.monotonic() - start < 5

        # An answer that takes longer than the header timeout (30 tokens, 0.1 s apart)
        # is not cut: the head was complete.
        r = httpx.post(
            gw.v1 + "/chat/completions", json={**CHAT, "max_tokens": 30, "stream": True}, timeout=20
        )
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert r.elapsed.total_seconds() > 2
    finally:
        backend.proc.kill()
        backend.proc.wait(10)


def start_limited_gateway(config_text: str, tmp: Path, nofile: int) -> Gateway:
    """`start_gateway` with RLIMIT_NOFILE soft and hard at `nofile` for corrallm."""
    config = tmp / "corrallm-limited.yaml"
    config.write_text(config_text)
    port = free_port()
    log_path = tmp / f"corrallm-{port}.log"
    env = {**os.environ, "ADDR": f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*SERVE, "--config", str(config), "--home", str(tmp / "home")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=limit,  # only setrlimit, before exec
        )
    gw = Gateway(f"http://127.0.0.1:{port}", tmp / "home", log_path, proc=proc)
    try:
        wait_healthy(gw)
    except BaseException:
        cleanup(gw)
        raise
    return gw


def test_F_slow_clients_past_the_fd_limit_a_normal_request_still_gets_through(
    fake_backend: FakeBackend, tmp_path: Path
) -> None:
    gw = start_limited_gateway(proxy_config(fake_backend), tmp_path, nofile=128)
    # Under CORRALLM_WORKERS each relaying worker has the limit of its own (inherited), and
    # the kernel spreads the connections over them: as many slow clients for each.
    processes = int(os.environ.get("CORRALLM_WORKERS") or 1)
    try:
        assert psutil.Process(gw.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (128, 128)
        with slow_clients(port_of(gw), 140 * processes) as slow:
            for _ in range(3):
                r, took = timed_chat(gw)
                assert r.status_code == 200 and took < 5, (r.status_code, took)
            # Room was kept by closing the oldest slow connections (the cap is below the
            # limit), not by waiting for the header timeout (10 s).
            assert slow.open() < 100 * processes
            assert psutil.Process(gw.proc.pid).num_fds() < 128
        assert "closed for room" in gw.log()
    finally:
        cleanup(gw)


def stream_endless_header(port: int, limit: int, chunk: int, out: dict[str, object]) -> None:
    """Send a request whose one header never ends (up to `limit` bytes), reading between
    writes; record the answer, whether the server closed, and the bytes sent."""
    sent = 0
    answer = b""
    eof = False
    deadline = time.monotonic() + 30
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        sock.settimeout(2)
        piece = b"a" * chunk
        while not eof and time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                answer += data
                eof = not data
                continue
            if sent >= limit:
                readable, _, _ = select.select([sock], [], [], 5)
                if not readable:
                    break
                continue
            try:
                sock.sendall(piece)
            except OSError:
                break
            sent += len(piece)
        if not eof:  # the server may have reset us after its answer; read what is left
            with contextlib.suppress(OSError):
                while time.monotonic() < deadline and (data := sock.recv(65536)):
                    answer += data
                else:
                    eof = True
    out.update(answer=answer, eof=eof, sent=sent)


@pytest.mark.serve_process
def test_F_oversized_header_gets_431_and_memory_stays_flat(
    gateway_factory: Callable[..., Gateway], fake_backend: FakeBackend
) -> None:
    gw = gateway_factory(proxy_config(fake_backend))
    port = port_of(gw)
    proc = psutil.Process(gw.proc.pid)
    assert timed_chat(gw)[0].status_code == 200  # warm
    rss_before = proc.memory_info().rss
    results: list[dict[str, object]] = [{} for _ in range(20)]
    threads = [
        threading.Thread(target=stream_endless_header, args=(port, 4 << 20, 16384, out))
        for out in results
    ]
    peak = rss_before
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.05)  # sampling interval; the loop ends on the threads, bounded
    for t in threads:
        t.join(1)
    grown = (peak - rss_before) / 2**20
    assert grown < 8, f"corrallm grew {grown:.1f} MB under 20 endless headers"
    for out in results:
        answer = out.get("answer", b"")
        assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 431 "), out
        assert b"request_header_fields_too_large" in answer and out["eof"], out

    # A large but legal head (32 KiB of headers) is answered as usual...
    r = httpx.get(gw.v1 + "/models", headers={"X-Pad": "p" * 32768}, timeout=5)
    assert r.status_code == 200
    # ...and a 100 KiB head sent in one write is refused like a streamed one.
    r = httpx.get(gw.v1 + "/models", headers={"X-Pad": "p" * 100_000}, timeout=5)
    assert r.status_code == 431
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    assert timed_chat(gw)[0].status_code == 200


@pytest.mark.parametrize("variable", ["CORRALLM_HEADER_TIMEOUT", "CORRALLM_MAX_HEADER_BYTES"])
def test_F_a_bad_limit_in_the_environment_is_refused_by_name(variable: str, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("models: {m: {backends: [{proxy: 1}]}}\n")
    result = subprocess.run(
        [*SERVE, "--config", str(config), "--home", str(tmp_path / "home")],
        capture_output=True,
        text=True,
        env={**os.environ, "ADDR": f"127.0.0.1:{free_port()}", variable: "-3"},
        timeout=60,
    )
    assert result.returncode != 0 and variable in result.stderr, result.stderr
