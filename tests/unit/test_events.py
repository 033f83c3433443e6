"""P4: the event bus fans out, filters by kind, and never lets a slow consumer slow it;
T5: nor grow corrallm's memory past its bound in bytes."""

import asyncio

import orjson
import pytest

from corrallm.observe.events import EventBus, buffer_from_env


async def take(stream, n: int) -> list[bytes]:
    return [await anext(stream) for _ in range(n)]


async def test_P4_subscribers_get_events_as_sse_frames_in_order():
    bus = EventBus()
    stream = bus.stream()
    assert (await anext(stream)).startswith(b"retry:")
    bus.publish("lifecycle", {"backend": "m#0", "old": "starting", "new": "ready"})
    bus.publish("log", {"backend": "m#0", "line": "hello"})
    first, second = await take(stream, 2)
    assert b"event: lifecycle\n" in first and b"event: log\n" in second
    data = orjson.loads(first.split(b"data: ")[1])
    assert data["new"] == "ready" and data["t"] > 0
    await stream.aclose()
    assert bus.subscribers == 0


async def test_T5_a_subscriber_within_its_bound_loses_nothing():
    bus = EventBus(limit=10_000)
    stream = bus.stream()
    await anext(stream)
    for i in range(40):  # about 40 * 60 bytes: well within 10 kB
        bus.publish("usage", {"i": i})
    got = [orjson.loads((await anext(stream)).split(b"data: ")[1])["i"] for _ in range(40)]
    assert got == list(range(40))
    await stream.aclose()


async def test_T5_a_subscriber_past_its_bound_is_sent_overflow_and_its_stream_ends():
    bus = EventBus(limit=2_000)
    slow, reader = bus.stream(), bus.stream()
    await anext(slow)
    await anext(reader)
    line = {"backend": "m#0", "line": "x" * 300}
    for _ in range(5):  # about 5 * 400 bytes: at the bound, not past it
        bus.publish("log", line)
    assert bus.subscribers == 2
    for _ in range(5):
        assert b"event: log" in await anext(reader)  # the reader keeps up
    bus.publish("log", line)  # the slow one is now past 2,000 bytes queued
    # Its queue is freed and it gets no more events, at once: publishing never waits.
    assert bus.subscribers == 1
    last = await anext(slow)
    assert last.startswith(b"event: overflow\n")
    note = orjson.loads(last.split(b"data: ")[1])
    assert note["limit"] == 2_000 and note["queued_bytes"] > 2_000
    with pytest.raises(StopAsyncIteration):
        await anext(slow)
    # The one that kept up is not touched.
    assert b"event: log" in await anext(reader)
    await reader.aclose()
    assert bus.subscribers == 0


async def test_T5_only_the_kinds_a_subscriber_wants_count_against_its_bound():
    bus = EventBus(limit=1_000)
    stream = bus.stream(frozenset({"lifecycle"}))
    await anext(stream)
    for i in range(100):  # 100 * 400 bytes of a kind it did not ask for
        bus.publish("log", {"line": "x" * 350, "i": i})
    bus.publish("lifecycle", {"backend": "m#0", "new": "ready"})
    assert bus.subscribers == 1
    assert b"event: lifecycle" in await anext(stream)
    await stream.aclose()


def test_T5_the_bound_comes_from_CORRALLM_EVENT_BUFFER_MB_in_megabytes():
    assert buffer_from_env({}) == 8_000_000
    assert buffer_from_env({"CORRALLM_EVENT_BUFFER_MB": "0.5"}) == 500_000
    for bad in ("0", "-1", "lots", "inf"):
        with pytest.raises(ValueError, match="CORRALLM_EVENT_BUFFER_MB"):
            buffer_from_env({"CORRALLM_EVENT_BUFFER_MB": bad})


async def test_P4_kinds_filter_and_heartbeats():
    bus = EventBus()
    stream = bus.stream(frozenset({"log"}), heartbeat=0.05)
    await anext(stream)
    bus.publish("usage", {"x": 1})
    assert await asyncio.wait_for(anext(stream), 2) == b": heartbeat\n\n"
    bus.publish("log", {"line": "y"})
    assert b"event: log" in await asyncio.wait_for(anext(stream), 2)
    await stream.aclose()
