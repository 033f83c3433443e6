"""SPEC §22 T5: names that callers choose never grow state. One real `corrallm serve` takes a
flood of requests, each with a model name nobody serves and an API key nobody configured,
all distinct (a few of the names megabytes long): after a warm-up that brings the
process to its steady state (the capture ring full, the allocator's heap grown to the
largest body), the flood leaves the number of /metrics series unchanged, the gateway's
RSS within ±10 MB and the store (SQLite file and WAL) within ±1 MB. `pytest -s` shows
the figures.

CORRALLM_FLOOD_REQUESTS sets the flood's size (default 10,000).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.observe import RawClient, rss_mb
from tests.support.processes import Gateway, fake_cmd, wait_for

FLOOD = int(os.environ.get("CORRALLM_FLOOD_REQUESTS", "10000"))
CONNECTIONS = 6  # keep-alive connections, one thread each
HUGE = 5 * 10**6  # the longest names: 5 MB (maxBodySize is 64 MB)
HUGE_EVERY = 2500  # one request in this many names its model with HUGE characters
CONFIG = f"""
keys:
  probe: {{secret: probe-secret}}
models:
  served: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
"""


def body(name: str) -> bytes:
    return orjson.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]})


def name_for(i: int, tag: str, huge_every: int) -> str:
    if i % huge_every == huge_every - 1:
        return f"{tag}-{i}-" + "h" * HUGE
    if i % 10 == 0:
        return f"{tag}-{i}-" + "l" * 4000  # long, under the head of a capture
    return f"{tag}-{i}"


def send_all(gw: Gateway, count: int, tag: str, huge_every: int = HUGE_EVERY) -> dict[int, int]:
    """`count` requests, each with its own unknown model and key, over CONNECTIONS
    keep-alive connections (one in `huge_every` names a HUGE model); answers by status."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    failures: list[BaseException] = []

    def run(worker: int) -> None:
        client = RawClient(gw.url, timeout=60)
        # A head and its body in two writes: without this, Nagle's algorithm and the
        # server's delayed ACK make each request wait 40 ms.
        client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        seen: dict[int, int] = {}
        try:
            for i in range(worker, count, CONNECTIONS):
                data = body(name_for(i, tag, huge_every))
                headers = {
                    "Authorization": f"Bearer {tag}-key-{i}",
                    "Content-Type": "application/json",
                }
                client.send_head("POST", "/v1/chat/completions", headers, len(data))
                client.send(data)
                status, _, _ = client.read_response()
                seen[status] = seen.get(status, 0) + 1
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)
        finally:
            client.close()
            with lock:
                for status, n in seen.items():
                    statuses[status] = statuses.get(status, 0) + n

    threads = [threading.Thread(target=run, args=(w,)) for w in range(CONNECTIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    return statuses


def series(gw: Gateway) -> int:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def store_bytes(home: Path) -> int:
    return sum(
        (home / name).stat().st_size
        for name in ("corrallm.db", "corrallm.db-wal")
        if (home / name).exists()
    )


def flushed(gw: Gateway, probes: int) -> None:
    """Everything recorded so far is in the store: a configured key's request (refused
    too, so recorded as `unknown`) sent last is, by the one batched writer, in order."""
    headers = {"Authorization": "Bearer probe-secret"}
    r = httpx.post(gw.v1 + "/chat/completions", content=body("probe"), headers=headers)
    assert r.status_code == 404

    def written() -> bool:
        rows = gw.api("GET", "activity?since=0&key=probe&limit=100").json()["rows"]
        return len(rows) == probes

    wait_for(written, 15, what=f"{probes} probe rows written")


@pytest.mark.serve_process
def test_T5_a_flood_of_made_up_names_and_keys_grows_no_state(gateway_factory):
    gw = gateway_factory(CONFIG)
    pid = gw.proc.pid
    # As many huge bodies as the flood has: the allocator's heap grows to its steady size.
    warm = send_all(gw, 3000, "warm", 3000 * HUGE_EVERY // FLOOD)
    flushed(gw, 1)
    before = (series(gw), rss_mb(pid), store_bytes(gw.home))
    began = time.monotonic()
    flood = send_all(gw, FLOOD, "flood")
    took = time.monotonic() - began
    flushed(gw, 2)
    after = (series(gw), rss_mb(pid), store_bytes(gw.home))
    print(
        f"\nT5 flood: {FLOOD} requests in {took:.1f}s ({FLOOD / took:.0f}/s), "
        f"{FLOOD // HUGE_EVERY} of them naming a {HUGE / 1e6:g} MB model; "
        f"metrics series {before[0]} -> {after[0]}; RSS {before[1]:.1f} -> {after[1]:.1f} MB "
        f"({after[1] - before[1]:+.1f}); store {before[2] / 1e6:.3f} -> {after[2] / 1e6:.3f} MB "
        f"({(after[2] - before[2]) / 1e6:+.3f})"
    )
    assert warm == {404: 3000} and flood == {404: FLOOD}
    assert after[0] == before[0]
    assert abs(after[1] - before[1]) <= 10
    assert abs(after[2] - before[2]) <= 1e6
    # The probe's two rows are all the store holds of it: `unknown`, no name kept.
    rows = gw.api("GET", "activity?since=0").json()["rows"]
    assert [(r["key"], r["model"]) for r in rows] == [("probe", "unknown")] * 2
