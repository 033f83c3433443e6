"""SPEC §21 O3 through a real gateway and a fake backend: /metrics carries histograms of
queue, load, first-byte and whole-request seconds and of tokens per second, per model and
lane, read back with Prometheus' own parser."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import Gateway, fake_cmd, wait_for

HISTOGRAMS = (
    "corrallm_queue_seconds",
    "corrallm_load_seconds",
    "corrallm_ttft_seconds",
    "corrallm_request_seconds",
    "corrallm_tokens_per_second",
)
TOKENS, TOKEN_DELAY = 10, 0.05  # asked for: a stream's tokens after its first take >= 0.45 s
LONG = 40  # what the backend generates unless asked for fewer: a 2 s answer
LOAD_SECONDS = 0.3

CONFIG = """
priorityGroups:
  coders: {{ weight: 4 }}
keys: {{ coder-key: coders }}
models:
  local:
    backends:
      - cmd: "{cmd}"
        proxy: ${{PORT}}
        maxConcurrent: 1
"""

Series = dict[str, float]  # "count", "sum", "le=<bound>" for each bucket


@pytest.fixture
def gw(gateway_factory) -> Gateway:
    cmd = fake_cmd(
        "--load-seconds",
        str(LOAD_SECONDS),
        "--tokens",
        str(LONG),
        "--token-delay",
        str(TOKEN_DELAY),
    )
    return gateway_factory(CONFIG.format(cmd=cmd))


def chat(
    gw: Gateway, key: str | None, stream: bool = False, model: str = "local", tokens: int = TOKENS
) -> int:
    body = {
        "model": model,
        "stream": stream,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream(
        "POST", gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        text = "".join(r.iter_text())
    if stream and r.status_code == 200:
        assert text.rstrip().endswith("data: [DONE]")
    return r.status_code


def scrape(gw: Gateway) -> tuple[dict[str, dict[tuple[str, str], Series]], str]:
    """Each histogram by (model, group), and the whole text."""
    r = httpx.get(gw.url + "/metrics", timeout=10)
    assert r.status_code == 200
    got: dict[str, dict[tuple[str, str], Series]] = {}
    for family in text_string_to_metric_families(r.text):
        if family.name not in HISTOGRAMS:
            continue
        assert family.type == "histogram", family
        series = got.setdefault(family.name, {})
        for sample in family.samples:
            labels = dict(sample.labels)
            le = labels.pop("le", None)
            assert set(labels) == {"model", "group"}, sample  # bounded: no key, no backend
            row = series.setdefault((labels["model"], labels["group"]), {})
            kind = sample.name.removeprefix(family.name + "_")
            row[f"le={le}" if kind == "bucket" else kind] = sample.value
    return got, r.text


def settled(gw: Gateway, requests: int) -> dict[str, dict[tuple[str, str], Series]]:
    """The histograms once `requests` requests are counted (settling follows the answer)."""

    def counted() -> dict[str, dict[tuple[str, str], Series]] | None:
        got, _ = scrape(gw)
        total = sum(s["count"] for s in got.get("corrallm_request_seconds", {}).values())
        return got if total == requests else None

    return wait_for(counted, 15, what=f"{requests} requests in corrallm_request_seconds")


def buckets(row: Series) -> list[float]:
    return [v for k, v in row.items() if k.startswith("le=")]


def test_O3_histograms_per_model_and_lane_for_cold_warm_and_streamed_requests(gw):
    assert chat(gw, "coder-key") == 200  # cold: waits for the backend's load
    assert chat(gw, "coder-key", stream=True) == 200
    assert chat(gw, None) == 200  # the default lane
    assert chat(gw, None, model="no-such-model") == 404  # refused at the gates: not observed
    got = settled(gw, 3)
    assert set(got) == set(HISTOGRAMS)
    coders, default = ("local", "coders"), ("local", "default")
    for name in ("corrallm_queue_seconds", "corrallm_ttft_seconds", "corrallm_request_seconds"):
        assert set(got[name]) == {coders, default}, name
        assert (got[name][coders]["count"], got[name][default]["count"]) == (2, 1), name
    for name, series in got.items():
        for key, row in series.items():
            counts = buckets(row)
            assert counts == sorted(counts), (name, key, row)  # cumulative
            assert row["le=+Inf"] == row["count"], (name, key, row)
            assert row["sum"] >= 0, (name, key, row)

    load = got["corrallm_load_seconds"]
    assert set(load) == {coders}  # only the cold request waited for a load
    assert load[coders]["count"] == 1 and load[coders]["sum"] >= LOAD_SECONDS
    assert load[coders]["le=0.25"] == 0  # LOAD_SECONDS is over that bound

    request, ttft = got["corrallm_request_seconds"], got["corrallm_ttft_seconds"]
    generating = (TOKENS - 1) * TOKEN_DELAY
    # Cold (>= load + whole body) and streamed (>= its tokens after the first).
    assert request[coders]["sum"] >= LOAD_SECONDS + TOKENS * TOKEN_DELAY + generating
    assert request[default]["sum"] >= TOKENS * TOKEN_DELAY
    assert request[coders]["sum"] >= load[coders]["sum"] + ttft[coders]["sum"]
    # One body's first byte comes once it is all generated; a stream's comes at once.
    assert ttft[default]["sum"] >= TOKENS * TOKEN_DELAY
    assert ttft[coders]["le=0.25"] == 1 and ttft[coders]["sum"] >= TOKENS * TOKEN_DELAY

    queue = got["corrallm_queue_seconds"]  # one at a time: nobody waited long for a slot
    assert queue[coders]["le=0.25"] == 2 and queue[default]["le=0.25"] == 1

    rate = got["corrallm_tokens_per_second"]
    assert (rate[coders]["count"], rate[default]["count"]) == (2, 1)
    fastest = TOKENS / generating  # no request generated faster than the backend's pace
    for row in rate.values():
        assert row["le=1.0"] == 0 and row["sum"] / row["count"] <= fastest * 1.05, row
        assert row["sum"] / row["count"] >= 1


def test_O3_queue_seconds_is_the_wait_for_a_busy_slot(gw):
    assert chat(gw, "coder-key") == 200  # warm: no load in what follows
    first_done: list[float] = []

    def first() -> None:
        assert chat(gw, "coder-key", stream=True, tokens=LONG) == 200
        first_done.append(time.monotonic())

    running = threading.Thread(target=first, daemon=True)
    running.start()
    wait_for(lambda: 'corrallm_in_flight{backend="local#0"} 1.0' in scrape(gw)[1], 30)
    waiter = threading.Thread(target=lambda: chat(gw, None), daemon=True)
    waiter.start()
    wait_for(lambda: 'corrallm_queue_depth{backend="local#0"} 1.0' in scrape(gw)[1], 30)
    queued_by = time.monotonic()  # the second request waits for the slot at least from now
    running.join(30)
    waiter.join(30)
    assert first_done and not waiter.is_alive()
    got = settled(gw, 3)
    queue = got["corrallm_queue_seconds"][("local", "default")]
    # It waited until the stream ended (seen here a moment after its slot was freed).
    assert queue["count"] == 1 and queue["sum"] >= first_done[0] - queued_by - 0.1
    assert queue["sum"] > 0.05 and queue["le=0.05"] == 0
    coders = got["corrallm_queue_seconds"][("local", "coders")]
    assert coders["count"] == 2 and coders["le=0.25"] == 2
    assert "corrallm_load_seconds" not in got or set(got["corrallm_load_seconds"]) == {
        ("local", "coders")
    }
