"""SPEC §15/§20 faults on the relay, injected against real processes (`corrallm serve` and
fake backends): CRLF-framed streams, a backend crashing mid-stream or mid-answer, a backend
that hangs before answering or goes silent mid-stream. What the client sees and what the
activity row says are both asserted; waiting is on conditions with deadlines."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.support.processes import Gateway, fake_cmd, wait_for

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello there"}]}


def config(*flags: str, backend: str = "", top: str = "") -> str:
    return f"""
priorityGroups:
  batch: {{ interruptible: true }}
keys: {{ batch-key: batch }}
{top}
models:
  chat:
    backends:
      - name: primary
        cmd: "{fake_cmd(*flags)}"
        proxy: ${{PORT}}
        maxConcurrent: 1
        {backend}
"""


def activity(gw: Gateway, count: int) -> list[dict[str, object]]:
    """The newest `count` request rows, oldest first, once they are all written."""

    def rows() -> list[dict[str, object]] | None:
        got = [
            r for r in gw.api("GET", "activity?limit=50").json()["rows"] if r["kind"] == "request"
        ]
        return got[:count][::-1] if len(got) >= count else None

    return wait_for(rows, 10, what=f"{count} activity rows")


def stats(gw: Gateway) -> dict[str, int]:
    return gw.upstream("GET", "chat/debug/stats", timeout=10).json()


def stream(gw: Gateway, key: str | None = None) -> tuple[bytes, list[tuple[float, bytes]]]:
    """The raw body of a streamed chat, and each data line with when it arrived."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    raw, arrivals, buffer = b"", [], b""
    with httpx.stream(
        "POST",
        gw.v1 + "/chat/completions",
        json={**CHAT, "stream": True},
        headers=headers,
        timeout=30,
    ) as r:
        assert r.status_code == 200
        for piece in r.iter_raw():
            now = time.monotonic()
            raw += piece
            buffer += piece
            *lines, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n")
            arrivals.extend((now, line[6:]) for line in lines if line.startswith(b"data: "))
    return raw, arrivals


@pytest.mark.parametrize("lane", [None, "batch-key"], ids=["ordinary", "interruptible"])
def test_S4_crlf_events_relayed_as_they_come(gateway_factory, lane: str | None) -> None:
    gw = gateway_factory(config("--sse-crlf", "--tokens", "8", "--token-delay", "0.4"))
    raw, arrivals = stream(gw, lane)
    assert b"\r\n\r\n" in raw and arrivals[-1][1] == b"[DONE]"
    tokens = [t for t, data in arrivals if b'"content":"' in data and b'"content":""' not in data]
    assert len(tokens) == 8
    # Spread out as the backend sent them (0.4 s apart), not all at the end: the first
    # token arrived before the backend had even sent the fifth one.
    assert tokens[-1] - tokens[0] > 4 * 0.4
    assert tokens[0] < tokens[4] - 1.2


def test_fault_stream_broken_by_crash_recorded_as_failure(gateway_factory) -> None:
    gw = gateway_factory(config("--crash-after-tokens", "3", "--crash-mid-event"))
    raw, arrivals = stream(gw)
    # Nothing after [DONE]; the torn event was dropped, never sent.
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    events = [data for _, data in arrivals]
    assert events[-1] == b"[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "backend_error" and "primary" in error["message"]
    for event in events[:-2]:
        orjson.loads(event)
    (row,) = activity(gw, 1)
    assert row["status"] == 502
    assert isinstance(row["error"], str) and "backend_error" in row["error"]


def test_fault_non_streamed_answer_cut_by_a_crash_is_a_clean_502(gateway_factory) -> None:
    gw = gateway_factory(config("--die-mid-body"))
    r = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "backend_error" and "primary" in error["message"]
    (row,) = activity(gw, 1)
    assert row["status"] == 502
    assert isinstance(row["error"], str) and "backend_error" in row["error"]
    log = gw.log()
    assert "Traceback" not in log
    warnings = [line for line in log.splitlines() if " WARNING " in line and "primary" in line]
    assert len(warnings) == 1, log


IDLE_1S = "timeouts: { upstreamIdle: 1s }"
TOP_300S = "timeouts: { upstreamIdle: 300s }"


def test_S20_a_hung_backend_gets_504_and_its_slot_is_freed(gateway_factory) -> None:
    # The backend's own 1 s overrides the top-level 300 s.
    gw = gateway_factory(config("--hang", "--faulty-requests", "1", backend=IDLE_1S, top=TOP_300S))
    hung = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30)
    assert hung.status_code == 504
    error = hung.json()["error"]
    assert (error["code"], error["type"]) == ("upstream_timeout", "api_error")
    assert "primary" in error["message"] and "timeouts.upstreamIdle" in error["message"]
    # The backend saw the cancel, and the only slot serves the next request.
    wait_for(lambda: stats(gw)["cancelled"] >= 1, 10, what="the backend to see the cancel")
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    timed_out, served = activity(gw, 2)
    assert (timed_out["status"], served["status"]) == (504, 200)
    assert isinstance(timed_out["error"], str) and "upstream_timeout" in timed_out["error"]


def test_S20_a_stream_gone_silent_ends_with_an_error_event_and_done(gateway_factory) -> None:
    gw = gateway_factory(config("--stall-after-tokens", "2", "--faulty-requests", "1", top=IDLE_1S))
    raw, arrivals = stream(gw)
    events = [data for _, data in arrivals]
    assert events[-1] == b"[DONE]" and raw.endswith(b"data: [DONE]\n\n")
    assert orjson.loads(events[-2])["error"]["code"] == "upstream_timeout"
    wait_for(lambda: stats(gw)["in_flight"] == 0, 10, what="the backend to see the cancel")
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    stalled, served = activity(gw, 2)
    assert (stalled["status"], served["status"]) == (504, 200)
    assert isinstance(stalled["error"], str) and "upstream_timeout" in stalled["error"]
