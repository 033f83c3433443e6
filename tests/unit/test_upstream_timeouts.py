"""SPEC §20: the upstream idle timeout (`timeouts.upstreamIdle`, a backend's own overriding
it) and what a silent or dying backend means for the client: 504 `upstream_timeout`
before anything was sent, an error event and `[DONE]` in a stream, the connection closed
so the backend sees the cancel; a non-streamed answer cut by a crash is a clean 502."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from corrallm.config import ConfigError, load_config_text
from corrallm.http.client import Client, UpstreamTimeout
from corrallm.http.errors import ApiError
from tests.unit.test_sse_framing import (
    EVENT,
    SSE_HEAD,
    Backend,
    Relayed,
    chunk,
    client,  # noqa: F401  (the fixture)
    data_events,
    relay,
)

TWO_BACKENDS = """
timeouts: {upstreamIdle: 2m}
models:
  m:
    backends:
      - proxy: 5800
        timeouts: {upstreamIdle: 1500ms}
      - proxy: 5801
"""


def test_S20_a_backends_upstream_idle_overrides_the_top_level_one() -> None:
    config = load_config_text(TWO_BACKENDS)
    own, inherits = config.models["m"].backends
    assert (config.upstream_idle(own), config.upstream_idle(inherits)) == (1.5, 120.0)
    default = load_config_text("models: {m: {backends: [{proxy: 5800}]}}")
    assert default.upstream_idle(default.models["m"].backends[0]) == 300.0


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("timeouts: {upstreamIdle: soon}", "timeouts.upstreamIdle: expected a duration"),
        ("timeouts: {upstreamIdel: 1s}", "did you mean 'upstreamIdle'?"),
        ("timeouts: {upstreamIdle: 0}", "timeouts.upstreamIdle: must be greater than 0"),
        (
            "models: {m: {backends: [{proxy: 5800, timeouts: {upstreamIdle: 1x}}]}}",
            "models.m.backends[0].timeouts.upstreamIdle: expected a duration",
        ),
    ],
)
def test_S20_bad_timeouts_are_reported_with_their_yaml_path(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text)
    assert problem in caught.value.report()


async def test_S20_a_backend_silent_before_its_headers_times_out_and_is_hung_up_on(
    client: Client,  # noqa: F811
) -> None:
    async def silent(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        await asyncio.Event().wait()  # accepts the request, never answers

    async with Backend(silent, Relayed()) as backend:
        with pytest.raises(UpstreamTimeout) as caught:
            await asyncio.wait_for(client.request("POST", backend.url, b"{}", [], 0.2), 5)
        assert caught.value.idle == 0.2 and not caught.value.headers_seen
        await asyncio.wait_for(backend.closed.wait(), 5)  # the backend sees the cancel


async def test_S20_bytes_that_keep_coming_are_not_silence(client: Client) -> None:  # noqa: F811
    async def slow(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(SSE_HEAD)
        for _ in range(6):  # 0.6 s in all, never 0.25 s silent
            writer.write(chunk(EVENT + b"\n\n"))
            await writer.drain()
            await asyncio.sleep(0.1)  # the backend's pace, not a synchronisation
        writer.write(chunk(b"data: [DONE]\n\n") + chunk(b""))

    status, relayed, meter = await relay(client, slow, idle_timeout=0.25)
    assert status == 200 and meter.error is None
    assert data_events(relayed.body) == [EVENT[6:]] * 6 + [b"[DONE]"]


async def test_S20_a_silent_backend_before_headers_is_504_upstream_timeout(
    client: Client,  # noqa: F811
) -> None:
    async def silent(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        await asyncio.Event().wait()

    with pytest.raises(ApiError) as caught:
        await relay(client, silent, idle_timeout=0.2)
    error = caught.value
    assert (error.status, error.code, error.type) == (504, "upstream_timeout", "api_error")
    assert "chat#0" in error.message and "timeouts.upstreamIdle" in error.message


async def test_S20_a_stream_gone_silent_ends_with_an_upstream_timeout_event_and_done(
    client: Client,  # noqa: F811
) -> None:
    async def stalls(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(SSE_HEAD + chunk(EVENT + b"\r\n\r\n"))
        await writer.drain()
        await asyncio.Event().wait()  # silent, the connection left open

    status, relayed, meter = await relay(client, stalls, idle_timeout=0.3)
    events = data_events(relayed.body)
    assert events[0] == EVENT[6:] and events[-1] == b"[DONE]" and len(events) == 3
    assert orjson.loads(events[1])["error"]["code"] == "upstream_timeout"
    assert status == 504 and meter.status == 504
    assert meter.error is not None and meter.error.startswith("upstream_timeout: ")


JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


async def test_fault_non_streamed_answer_cut_by_a_crash_is_a_clean_502(
    client: Client,  # noqa: F811
) -> None:
    async def dies(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(JSON_HEAD + b'{"choices": [')
        await writer.drain()
        writer.transport.abort()

    with pytest.raises(ApiError) as caught:
        await relay(client, dies)
    assert (caught.value.status, caught.value.code) == (502, "backend_error")
    assert "chat#0" in caught.value.message


async def test_fault_a_cut_audio_body_is_never_ended_as_if_whole(
    client: Client,  # noqa: F811
) -> None:
    async def dies(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: audio/wav\r\nContent-Length: 100\r\n\r\n"
        writer.write(head + b"RIFF")
        await writer.drain()
        await relayed.until(lambda: b"RIFF" in relayed.body)
        writer.transport.abort()

    status, relayed, meter = await relay(client, dies)
    # The headers went out: the status cannot change. No final (empty) body message, so
    # the server closes the connection and the client sees a cut body, not a whole one.
    assert status == 502 and meter.status == 502 and meter.error is not None
    assert relayed.messages[0]["status"] == 200
    assert all(m.get("more_body") for m in relayed.messages[1:])
