"""P4: the event bus fans out, filters by kind, and never lets a slow consumer slow it."""

import asyncio

import orjson

from corrallm.events import BUFFER, EventBus


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


async def test_P4_a_slow_consumer_loses_its_oldest_events_and_is_told_how_many():
    bus = EventBus()
    stream = bus.stream()
    await anext(stream)
    for i in range(BUFFER + 25):
        bus.publish("usage", {"i": i})  # never blocks, whatever the consumer does
    dropped = await anext(stream)
    assert dropped.startswith(b"event: dropped\n") and b'"dropped":25' in dropped
    oldest_kept = orjson.loads((await anext(stream)).split(b"data: ")[1])
    assert oldest_kept["i"] == 25
    await stream.aclose()


async def test_P4_kinds_filter_and_heartbeats():
    bus = EventBus()
    stream = bus.stream(frozenset({"log"}), heartbeat=0.05)
    await anext(stream)
    bus.publish("usage", {"x": 1})
    assert await asyncio.wait_for(anext(stream), 2) == b": heartbeat\n\n"
    bus.publish("log", {"line": "y"})
    assert b"event: log" in await asyncio.wait_for(anext(stream), 2)
    await stream.aclose()
