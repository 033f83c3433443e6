"""SPEC §16 K4: a streamed request that waits is told why (SSE comments), the wait is on
every answer (`X-Corrallm-Queue-Ms`, `X-Corrallm-Load-Ms`), and a wait that fails after
the stream was opened ends it with an error event and `[DONE]`. Real processes; the
official openai SDK as the streaming client."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import orjson

from tests.support.processes import fake_cmd, wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def cold(*flags: str, feedback: str = "feedback: {after: 1s, every: 1s}") -> str:
    return f"""
{feedback}
models:
  m: {{backends: [{{cmd: "{fake_cmd("--tokens", "5", *flags)}", proxy: "${{PORT}}"}}]}}
"""


def stream_lines(gw, body: dict) -> tuple[httpx.Headers, list[tuple[float, str]]]:
    """The raw lines of a streamed answer, each with when it arrived."""
    began = time.monotonic()
    lines = []
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append((time.monotonic() - began, line))
        return r.headers, lines


def test_K4_a_cold_streamed_request_gets_comments_before_its_first_event(gateway_factory):
    gw = gateway_factory(cold("--load-seconds", "4"))
    headers, lines = stream_lines(gw, {**CHAT, "stream": True})
    comments = [(t, line) for t, line in lines if line.startswith(":")]
    data = [(t, line) for t, line in lines if line.startswith("data:")]
    loading = [line for _, line in comments if "corrallm loading m" in line]
    waited = [line for _, line in comments if line.startswith(": corrallm waited")]
    load_ms = int(waited[0].split("load=")[1].removesuffix("ms"))
    assert {
        "first comment after ~1s": 0.8 < comments[0][0] < 3.0,
        "comments before data": comments[-1][0] <= data[0][0],
        "loading comments": len(loading) >= 2,
        "says how long": "s of " in loading[0] and "expected" in loading[0],
        "total wait told": load_ms >= 3500,
        "content type": headers["content-type"],
        "last": data[-1][1],
    } == {
        "first comment after ~1s": True,
        "comments before data": True,
        "loading comments": True,
        "says how long": True,
        "total wait told": True,
        "content type": "text/event-stream",
        "last": "data: [DONE]",
    }


def test_K4_the_openai_sdk_yields_exactly_the_models_chunks_through_comments(gateway_factory):
    gw = gateway_factory(cold("--load-seconds", "3"))
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    with client:
        stream = client.chat.completions.create(**CHAT, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # The same backend, warm now: what it says without waiting.
    with openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0) as direct:
        warm = direct.chat.completions.create(**CHAT, stream=True)
        expected = "".join(c.choices[0].delta.content or "" for c in warm if c.choices)
    assert text == expected and text


def test_K4_load_and_queue_ms_are_on_every_answer(gateway_factory):
    gw = gateway_factory(cold("--load-seconds", "3", "--latency", "1.5"))
    first = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    second = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    # A third waits in the queue behind a fourth that holds the one slot. (The management
    # API is built on its first call, which can take longer than the slot is held.)
    gw.api("GET", "overview")
    holder = threading.Thread(
        target=httpx.post, args=(gw.v1 + "/chat/completions",), kwargs={"json": CHAT}
    )
    holder.start()
    wait_for(lambda: gw.overview_backend("m#0")["in_flight"] == 1, 10, what="slot held")
    queued = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=60)
    holder.join(30)
    missing = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "model": "x"})
    assert {
        "cold load": int(first.headers["x-corrallm-load-ms"]) >= 2500,
        "warm load": second.headers["x-corrallm-load-ms"],
        "warm queue": second.headers["x-corrallm-queue-ms"],
        "queued": (queued.status_code, int(queued.headers["x-corrallm-queue-ms"]) >= 500),
        "error too": (missing.status_code, missing.headers["x-corrallm-queue-ms"]),
    } == {
        "cold load": True,
        "warm load": "0",
        "warm queue": "0",
        "queued": (200, True),
        "error too": (404, "0"),
    }


def test_K4_a_start_that_fails_after_the_stream_opened_ends_with_an_error_and_done(
    gateway_factory,
):
    # The backend exits while "loading": the stream was already opened by the comments.
    gw = gateway_factory(cold("--load-seconds", "30", "--exit-after-seconds", "2.5"))
    headers, lines = stream_lines(gw, {**CHAT, "stream": True})
    data = [line for _, line in lines if line.startswith("data:")]
    error = orjson.loads(data[0].removeprefix("data: "))["error"]
    assert {
        "opened": headers["content-type"],
        "comments first": lines[0][1].startswith(": corrallm loading m"),
        "code": error["code"],
        "then": data[1:],
    } == {
        "opened": "text/event-stream",
        "comments first": True,
        "code": "backend_start_failed",
        "then": ["data: [DONE]"],
    }


def test_K4_feedback_off_for_a_lane_waits_silently(gateway_factory):
    gw = gateway_factory(
        cold(
            "--load-seconds",
            "2",
            feedback="""feedback: {after: 500ms, every: 500ms}
priorityGroups: {quiet: {feedback: {enabled: false}}}
keys: {qkey: quiet}""",
        )
    )
    began = time.monotonic()
    with httpx.stream(
        "POST",
        gw.v1 + "/chat/completions",
        json={**CHAT, "stream": True},
        headers={"Authorization": "Bearer qkey"},
        timeout=60,
    ) as r:
        answered = time.monotonic() - began
        lines = [line for line in r.iter_lines() if line]
    assert not any(line.startswith(":") for line in lines) and answered > 1.5
    assert int(r.headers["x-corrallm-load-ms"]) >= 1500


def test_K4_a_queued_streamed_request_is_told_its_place(gateway_factory):
    gw = gateway_factory(cold("--latency", "3", feedback="feedback: {after: 500ms, every: 500ms}"))
    gw.api("POST", "models/load", {"model": "m"})
    holder = threading.Thread(
        target=httpx.post,
        args=(gw.v1 + "/chat/completions",),
        kwargs={"json": CHAT, "timeout": 60},
    )
    holder.start()
    wait_for(lambda: gw.overview_backend("m#0")["in_flight"] == 1, 10, what="slot held")
    headers, lines = stream_lines(gw, {**CHAT, "stream": True})
    holder.join(30)
    queued = [line for _, line in lines if line.startswith(": corrallm queued")]
    first_data = next(i for i, (_, line) in enumerate(lines) if line.startswith("data:"))
    assert {
        "told": queued[0].startswith(": corrallm queued: position 1 of 1 for m#0, ~"),
        "before the answer": all(line.startswith(":") for _, line in lines[:first_data]),
        "waited": int(headers["x-corrallm-queue-ms"]) >= 400,
        "last": lines[-1][1],
    } == {"told": True, "before the answer": True, "waited": True, "last": "data: [DONE]"}
