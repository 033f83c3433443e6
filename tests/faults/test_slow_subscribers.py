"""SPEC §22 T5 against a real `corrallm serve`: an events subscriber that stops reading.

The subscriber is a raw socket with a tiny receive buffer that subscribes to
`/api/v1/events` and then reads nothing, while a backend prints megabytes of long log
lines (each one a `log` event). What is asserted: corrallm's memory does not follow the
events it cannot deliver, the subscriber's stream ends with `event: overflow`, and a
subscriber that reads is not cut.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import Gateway

LINE_BYTES = 32_000
LINES = 1_000  # 32 MB of log events, about 4 MB/s (corrallm follows a log 1 MB a look)

SPAMMER = f"""
import os, sys, time
for i in range({LINES}):
    print(str(i).rjust(8, "0") + "x" * {LINE_BYTES}, flush=True)
    if i % 20 == 19:
        time.sleep(0.15)
print("spam done", flush=True)
os.execv(sys.executable, [sys.executable, "-m", "corrallm", "fake-backend", "--port", sys.argv[1]])
"""


def subscribe_without_reading(gw: Gateway) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
    sock.sendall(
        b"GET /api/v1/events?kinds=log HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {gw.token}\r\n\r\n".encode()
    )
    sock.settimeout(10)
    got = b""
    while b": connected" not in got:  # subscribed; from now on it reads nothing
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    return sock


def read_to_end(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection (within `within` s);
    only the first and last 64 kB are kept."""
    head, tail, closed = b"", b"", False
    sock.settimeout(1)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not chunk:
            closed = True
            break
        if len(head) < 1 << 16:
            head += chunk
        tail = (tail + chunk)[-(1 << 16) :]
    return head + b"..." + tail, closed


@pytest.mark.serve_process
def test_T5_a_subscriber_that_stops_reading_is_cut_with_overflow_and_memory_stays_bounded(
    gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    spammer = tmp_path / "spammer.py"
    spammer.write_text(SPAMMER)
    gw = gateway_factory(
        f'models: {{m: {{backends: [{{cmd: "{sys.executable} {spammer} ${{PORT}}", '
        'proxy: "${PORT}"}]}}\n',
        env={"CORRALLM_EVENT_BUFFER_MB": "2"},
        health_timeout="60s",
    )
    proc = psutil.Process(gw.proc.pid)
    stalled = subscribe_without_reading(gw)
    # A subscriber that reads everything, for comparison: it must not be cut.
    seen: dict[str, object] = {"lines": 0, "overflow": False}
    subscribed = threading.Event()

    def follow() -> None:
        with httpx.stream(
            "GET",
            gw.url + "/api/v1/events?kinds=log",
            headers={"Authorization": f"Bearer {gw.token}"},
            timeout=httpx.Timeout(60, read=60),
        ) as events:
            subscribed.set()
            for line in events.iter_lines():
                if line.startswith("event: overflow"):
                    seen["overflow"] = True
                elif "spam done" in line:
                    return
                elif line.startswith("event: log"):
                    seen["lines"] = int(str(seen["lines"])) + 1

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert subscribed.wait(10)
    rss_before = proc.memory_info().rss
    peak = rss_before
    starting = threading.Thread(
        target=lambda: httpx.post(
            gw.v1 + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=90,
        ),
        daemon=True,
    )
    starting.start()  # starts the backend, whose start prints the lines
    deadline = time.monotonic() + 90
    while starting.is_alive() and time.monotonic() < deadline:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.05)  # the sampling interval; the loop ends with the request
    starting.join(1)
    reader.join(30)

    # The reader saw the spam through, uncut.
    assert not reader.is_alive() and seen["overflow"] is False, seen
    assert int(str(seen["lines"])) > 200, seen
    # The stalled subscriber: its stream ended with `overflow` (after whatever the
    # kernel's and the transport's buffers held), and the server closed it.
    answer, closed = read_to_end(stalled, 30)
    stalled.close()
    assert closed and b"event: overflow\n" in answer[-4096:], answer[-600:]
    # corrallm's memory: the backend's log ring (its last 2,000 lines: all 32 MB here)
    # grows, the stalled subscriber's queue by no more than its 2 MB. Bounded only in
    # events (1,000), it would hold 32 MB more.
    grown = (peak - rss_before) / 2**20
    assert grown < 48, f"corrallm grew {grown:.0f} MiB"
