"""SPEC §19 X5 against real processes: `corrallm serve` gateways sharing one PostgreSQL
store (a throwaway cluster, tests/support/postgres.py) through `--db postgresql://…`
(here CORRALLM_DB), with fake backends.

Measured, and printed (`pytest -s`): how long a pause made through one gateway takes to
be enforced by the other (at most 1 s: LISTEN/NOTIFY), how far a spend limit hammered
through both at once is overshot (at most one request's estimate: an atomic reservation
in the database), and how much activity a gateway killed with -9 loses (at most the last
second: the batched writer flushes every second)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.postgres import POSTGRES_TIER
from tests.support.processes import (
    FakeBackend,
    Gateway,
    fake_cmd,
    running_fake_backend,
    wait_for,
)

pytestmark = POSTGRES_TIER

ESTIMATE = 0.04  # 40 completion tokens at $1000 per million (prompt tokens are free)
LIMIT_REQUESTS = 5
CONFIG = f"""
commandCosts: {{chat: {{}}, paid-api: {{paid: true}}}}
priorityGroups:
  thrifty: {{weight: 1, spendLimit: {{usd: {LIMIT_REQUESTS * ESTIMATE}, window: 1h}}}}
keys: {{cheap-key: thrifty}}
models:
  m: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
  paid:
    backends:
      - proxy: PAID_PORT
        type: paid-api
        maxConcurrent: 64
        pricing: {{inputPerMillion: 0, outputPerMillion: 1000}}
"""


@pytest.fixture
def paid(tmp_path: Path) -> Iterator[FakeBackend]:
    """The paid upstream: 40 completion tokens a request, so a request with max_tokens 40
    costs exactly its estimate (the limit is then N requests' worth, no more, no less)."""
    with running_fake_backend(tmp_path, "--tokens", "40") as backend:
        yield backend


@pytest.fixture
def start(gateway_factory, paid: FakeBackend, postgres_url: str, tmp_path: Path):
    """`start(name)`: a gateway with a home of its own, on the shared store."""

    def start(name: str) -> Gateway:
        return gateway_factory(
            CONFIG.replace("PAID_PORT", str(paid.port)),
            home=tmp_path / f"home-{name}",
            env={"CORRALLM_DB": postgres_url},
        )

    return start


def chat(gw: Gateway, model: str = "paid", key: str | None = None) -> httpx.Response:
    body = {"model": model, "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60)


def paused(gw: Gateway, name: str = "m") -> bool:
    model = next(m for m in gw.api("GET", "overview").json()["models"] if m["name"] == name)
    return bool(model["paused"])


def spent(gw: Gateway) -> float:
    lanes = {x["name"]: x for x in gw.api("GET", "lanes").json()["lanes"]}
    return float(lanes["thrifty"]["spend_usd_window"])


def stored_request_ids(url: str) -> set[str]:
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT request_id FROM activity WHERE kind = 'request'").fetchall()
    return {r[0] for r in rows}


def next_flush(url: str, rows: int) -> int:
    """Wait for the activity table to hold more than `rows` request rows; how many."""
    return wait_for(lambda: (n := len(stored_request_ids(url))) > rows and n, 20, 0.01)


def propagation(by: Gateway, to: Gateway, action: str, expect: bool) -> float:
    """Seconds from `by` answering the pause or unpause to `to` enforcing it."""
    done = by.api("POST", f"models/{action}", {"model": "m"})
    assert done.status_code == 200, done.text
    answered = time.monotonic()
    wait_for(lambda: paused(to) is expect, 5, interval=0.005, what=f"{action} on the other")
    return time.monotonic() - answered


def test_X5_two_gateways_on_one_postgresql_share_pauses_spend_limits_and_activity(
    start, postgres_url
):
    a, b = start("a"), start("b")

    # P1 across gateways: a pause made through A is enforced by B within a second, and
    # an unpause made through B by A.
    assert not paused(a) and not paused(b)
    to_b = propagation(a, b, "pause", True)
    refused = chat(b, "m")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "paused"
    to_a = propagation(b, a, "unpause", False)
    print(f"\npause A->B enforced in {to_b * 1000:.0f} ms, unpause B->A in {to_a * 1000:.0f} ms")
    assert to_b < 1.0 and to_a < 1.0
    assert chat(a, "m").status_code == 200 and chat(b, "m").status_code == 200

    # S6 across gateways: a limit of N requests' worth, hammered through both at once.
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda gw: chat(gw, key="cheap-key"), [a, b] * 16))
    codes = [r.status_code for r in answers]
    admitted = codes.count(200)
    over = (admitted - LIMIT_REQUESTS) * ESTIMATE
    print(
        f"spend limit of {LIMIT_REQUESTS} requests' worth (${LIMIT_REQUESTS * ESTIMATE:.2f}), "
        f"32 at once through 2 gateways: {admitted} admitted, overshoot ${max(over, 0):.2f} "
        f"({max(admitted - LIMIT_REQUESTS, 0)} requests)"
    )
    assert set(codes) == {200, 429}
    assert all(r.json()["error"]["code"] == "spend_limit" for r in answers if r.status_code == 429)
    assert LIMIT_REQUESTS <= admitted <= LIMIT_REQUESTS + 1
    for gw in (a, b):  # every gateway sees the lane's whole spending
        wait_for(lambda gw=gw: spent(gw) == pytest.approx(admitted * ESTIMATE), 10, 0.1)

    # C3 across gateways: both write their activity to the one table.
    ids = {r.headers["x-corrallm-request-id"] for r in answers}
    ids |= {chat(gw).headers["x-corrallm-request-id"] for gw in (a, b, a, b)}
    wait_for(lambda: ids <= stored_request_ids(postgres_url), 5, what="rows of both gateways")


@pytest.mark.serve_process
def test_X5_C3_a_gateway_killed_9_loses_at_most_a_second_of_activity(start, postgres_url):
    a = start("a")
    served: list[tuple[float, str]] = []  # (answered at, request id)
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                try:
                    r = client.post(
                        a.v1 + "/chat/completions",
                        json={"model": "paid", "messages": [{"role": "user", "content": "x"}]},
                    )
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    served.append((time.time(), r.headers["x-corrallm-request-id"]))

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        # Two flushes seen, then about 60 % of a flush cycle's worth of load more: the kill
        # lands well inside the writer's one-second cycle, not just after a flush.
        first = next_flush(postgres_url, 0)
        before = len(served)
        next_flush(postgres_url, first)
        cycle = len(served) - before
        target = len(served) + int(0.6 * cycle)
        wait_for(lambda: len(served) >= target, 20, what="more load")
        killed = time.time()
        a.signal(signal.SIGKILL)
        a.wait_exit()
    finally:
        stop.set()
        for w in workers:
            w.join(10)
    answered = [(t, rid) for t, rid in served if t <= killed]

    again = start("a")  # restarted on the same home and store: serves and writes on
    assert chat(again).status_code == 200
    kept = stored_request_ids(postgres_url)
    lost = [t for t, rid in answered if rid not in kept]
    window = killed - min(lost) if lost else 0.0
    print(
        f"\nkilled -9 after {len(answered)} answered requests: {len(lost)} rows lost, "
        f"the oldest answered {window * 1000:.0f} ms before the kill"
    )
    assert len(lost) < len(answered)  # (some were flushed before the kill)
    assert window <= 1.1  # the flush period (1 s) and the flush itself
    wait_for(lambda: len(stored_request_ids(postgres_url)) >= len(kept) + 1, 5, what="new rows")
