"""SSE framing on the relay (SPEC §6 S4, §9 C2): an event ends at any blank line, whatever
the line ends (LF, CRLF, lone CR, mixed). Pure functions first, then `forward` relaying
from a raw loopback backend, each event released only once the previous one reached the
client (a condition, never a sleep); then streams translated into a dialect (K1, K2),
through the same loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from corrallm.http.client import Client
from corrallm.proxy.dialects import anthropic, anthropic_translate, responses, responses_translate
from corrallm.proxy.dialects.anthropic_stream import AnthropicStream
from corrallm.proxy.dialects.responses_stream import ResponsesStream
from corrallm.proxy.dialects.stream import Translated
from corrallm.proxy.forward import Direct, DisconnectWatch
from corrallm.proxy.metering import Meter, count_events, split_events
from corrallm.proxy.relay import Codec, forward
from corrallm.proxy.relay import relay as relay_answer

EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}'


@pytest.mark.parametrize(
    ("data", "whole", "rest"),
    [
        (b"data: a\n\ndata: b\n\ndata: c", b"data: a\n\ndata: b\n\n", b"data: c"),
        (
            b"data: a\r\n\r\ndata: b\r\n\r\ndata: c\r\n",
            b"data: a\r\n\r\ndata: b\r\n\r\n",
            b"data: c\r\n",
        ),
        (b"data: a\r\rdata: b", b"data: a\r\r", b"data: b"),
        (b"data: a\r\n\ndata: b\n\r\ndata: c", b"data: a\r\n\ndata: b\n\r\n", b"data: c"),
        (b"data: a\n\rdata: b", b"data: a\n\r", b"data: b"),
        (b"data: a\r\n", b"", b"data: a\r\n"),  # one line end is not a blank line
        (b"data: a\r\ndata: b\r\n", b"", b"data: a\r\ndata: b\r\n"),
        (b"data: a", b"", b"data: a"),
        # A CR last: cut after it; the LF of its CRLF, if any, opens the next piece.
        (b"data: a\r\n\r", b"data: a\r\n\r", b""),
    ],
)
def test_S4_split_events_ends_an_event_at_any_blank_line(
    data: bytes, whole: bytes, rest: bytes
) -> None:
    assert split_events(data) == (whole, rest)


def test_S4_split_events_keeps_every_byte_across_any_chunking() -> None:
    stream = b"data: 1\r\n\r\ndata: 2\n\ndata: 3\r\rdata: 4\r\n\ndata: [DONE]\r\n\r\n"
    for size in range(1, 12):
        out, pending = [], b""
        for i in range(0, len(stream), size):
            whole, pending = split_events(pending + stream[i : i + size])
            out.append(whole)
        assert b"".join(out) + pending == stream
        # Cut after a CR that ends a read, the LF of its CRLF waits for the next piece.
        assert pending in (b"", b"\n")


@pytest.mark.parametrize(
    ("data", "events"),
    [
        (b"data: a\n\ndata: b\n\n", 2),
        (b"data: a\r\n\r\ndata: b\r\n\r\n", 2),
        (b"data: a\r\rdata: b\r\r", 2),
        (b"data: a\r\n\ndata: b\n\r\n", 2),
        (b"data: a\r\n", 0),
    ],
)
def test_C2_events_are_counted_whatever_the_line_ends(data: bytes, events: int) -> None:
    assert count_events(data) == events


def test_C2_usage_is_read_and_hidden_on_a_crlf_framed_stream() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunk = (
        b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\r\n\r\n'
        + b'data: {"choices":[],"usage":'
        + orjson.dumps(usage)
        + b"}\r\n\r\ndata: [DONE]\r\n\r\n"
    )
    meter = Meter(strip_usage=True)
    meter.start(200, sse=True)
    out = meter.chunk(chunk)
    assert meter.usage == usage and meter.events == 3
    assert out == b'data: {"choices":[{"delta":{"content":"hi"}}]}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert not meter.metered(10).estimated


# --- forward, from a raw loopback backend ----------------------------------------------------

Script = Callable[[asyncio.StreamWriter, "Relayed"], Awaitable[None]]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Relayed:
    """What `forward` sent to its client, with a way to wait for a condition on it."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.changed = asyncio.Condition()

    async def send(self, message: dict[str, Any]) -> None:
        async with self.changed:
            self.messages.append(message)
            self.changed.notify_all()

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    async def until(self, condition: Callable[[], bool], within: float = 5.0) -> None:
        async def wait() -> None:
            async with self.changed:
                await self.changed.wait_for(condition)

        await asyncio.wait_for(wait(), within)


class Backend:
    """Answers one request by its script; notes when the script ended or the proxy hung up
    (which cancels a script still running, as a backend stops on a client's cancel)."""

    def __init__(self, script: Script, relayed: Relayed) -> None:
        self.script, self.relayed = script, relayed
        self.closed = asyncio.Event()  # the proxy closed the connection
        self.over = asyncio.Event()  # the script ended, or the proxy hung up

    async def __aenter__(self) -> Backend:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            script = asyncio.ensure_future(self.script(writer, self.relayed))
            eof = asyncio.ensure_future(reader.read())
            try:
                await asyncio.wait((script, eof), return_when=asyncio.FIRST_COMPLETED)
                self.over.set()
                await asyncio.wait((eof,))
                self.closed.set()
            finally:
                script.cancel()
                eof.cancel()
                await asyncio.wait((script, eof))
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/chat/completions"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    c = Client()
    yield c
    await c.close()


class DirectClient:
    """A client connection written to directly (http/asgi.py `BodyWriter`), sharing
    `Relayed`'s record so that the order of both ways is one list; `ready` says whether
    the client keeps up (else the relay goes through `send`)."""

    def __init__(self, relayed: Relayed) -> None:
        self.relayed = relayed
        self.ready = True
        self.direct = 0  # pieces written this way
        self.tasks: set[asyncio.Future[None]] = set()

    def writable(self) -> bool:
        return self.ready

    def write_more(self, body: bytes) -> None:
        self.direct += 1
        message = {"type": "http.response.body", "body": body, "direct": True}
        # Called from a callback, not a coroutine: the record is told in a task.
        self.tasks.add(asyncio.ensure_future(self.relayed.send(message)))


async def relay(
    client: Client,
    script: Script,
    idle_timeout: float | None = None,
    direct: Callable[[Relayed], DirectClient] | None = None,
    codec: Codec | None = None,
) -> tuple[int, Relayed, Meter]:
    """The backend's answer relayed as it came (`forward`), or as `codec` says."""
    relayed = Relayed()
    meter = Meter() if codec is None else codec.meter
    never: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def receive() -> dict[str, Any]:
        return await never

    async with Backend(script, relayed) as backend:
        watch = DisconnectWatch(receive)
        try:
            scope = {"method": "POST", "headers": []}
            answer = (
                forward(
                    client,
                    scope,
                    relayed.send,
                    backend.url,
                    b"{}",
                    [],
                    [],
                    watch,
                    "chat#0",
                    None,
                    meter,
                    idle_timeout=idle_timeout,
                    direct=Direct(direct(relayed), None) if direct is not None else None,
                )
                if codec is None
                else relay_answer(
                    client, "POST", backend.url, b"{}", [], [], relayed.send, watch, "chat#0", codec
                )
            )
            status = await asyncio.wait_for(answer, 10)
        finally:
            watch.close()
        await asyncio.wait_for(backend.over.wait(), 5)
    return status, relayed, meter


def data_events(body: bytes) -> list[bytes]:
    return [line[6:] for line in body.replace(b"\r", b"\n").split(b"\n") if line]


@pytest.mark.parametrize("end", [b"\r\n", b"\n", b"\r"], ids=["crlf", "lf", "cr"])
async def test_S4_each_event_reaches_the_client_before_the_next_is_sent(
    client: Client, end: bytes
) -> None:
    async def script(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(SSE_HEAD)
        for i in range(1, 5):
            writer.write(chunk(EVENT + end + end))
            await writer.drain()
            # The next event is sent only once this one reached the client.
            await relayed.until(lambda i=i: relayed.body.count(EVENT) == i)
        writer.write(chunk(b"data: [DONE]" + end + end) + chunk(b""))
        await writer.drain()

    status, relayed, meter = await relay(client, script)
    assert status == 200 and meter.error is None
    assert data_events(relayed.body) == [EVENT[6:]] * 4 + [b"[DONE]"]
    assert meter.events == 5


async def test_fault_stream_broken_by_crash_drops_the_torn_event_and_ends_with_done(
    client: Client,
) -> None:
    async def script(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(SSE_HEAD + chunk(EVENT + b"\r\n\r\n" + EVENT[:20]))
        await writer.drain()
        await relayed.until(lambda: EVENT in relayed.body)
        writer.transport.abort()  # the backend dies mid-event

    status, relayed, meter = await relay(client, script)
    events = data_events(relayed.body)
    assert events[0] == EVENT[6:] and events[-1] == b"[DONE]" and len(events) == 3
    error = orjson.loads(events[1])["error"]
    assert (error["code"], error["type"]) == ("backend_error", "api_error")
    assert "chat#0" in error["message"]
    assert relayed.body.endswith(b"data: [DONE]\n\n")  # nothing after [DONE]
    assert relayed.messages[-1] == {"type": "http.response.body", "body": b""}
    assert status == 502 and meter.status == 502
    assert meter.error is not None and meter.error.startswith("backend_error: ")


async def test_S4_direct_relay_keeps_whole_events_in_order_when_the_client_falls_behind(
    client: Client,
) -> None:
    """Events go straight to the connection while it keeps up and through `send` while it
    does not (`writable()` False), one list in the upstream's order either way, torn
    events held back until whole."""
    made: list[DirectClient] = []

    def direct(relayed: Relayed) -> DirectClient:
        made.append(DirectClient(relayed))
        return made[0]

    def event(i: int) -> bytes:
        return b'data: {"n":%d}\n\n' % i

    async def script(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(SSE_HEAD)
        for i in range(30):
            if i == 10:
                made[0].ready = False  # the client falls behind
            elif i == 20:
                made[0].ready = True
            whole = event(i)
            # Each event in two pieces, the first torn mid-line.
            writer.write(chunk(whole[:7]))
            await writer.drain()
            writer.write(chunk(whole[7:]))
            await writer.drain()
            await relayed.until(lambda i=i: relayed.body.count(b'"n":') == i + 1)
        writer.write(chunk(b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    status, relayed, meter = await relay(client, script, direct=direct)
    assert status == 200 and meter.error is None
    assert data_events(relayed.body) == [b'{"n":%d}' % i for i in range(30)] + [b"[DONE]"]
    pieces = [m for m in relayed.messages[1:] if m.get("body")]
    # One piece per event (its torn first half sent nothing), in order.
    assert [p["body"] for p in pieces[:30]] == [event(i) for i in range(30)]
    assert all(p.get("direct") for p in pieces[1:10] + pieces[21:30])
    assert not any(p.get("direct") for p in pieces[10:20])  # the client was behind
    assert meter.events == 31


# --- streams translated into a dialect, through the same loop ------------------------------


def chat_event(content: str) -> bytes:
    return b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % (
        content.encode()
    )


def named_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A dialect's named SSE events: (name, object)."""
    out = []
    for block in body.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n", 1)
            out.append((name[7:].decode(), orjson.loads(data[6:])))
    return out


async def test_K1_a_translated_stream_is_relayed_in_whole_events_by_the_one_loop(
    client: Client,
) -> None:
    async def script(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(SSE_HEAD)
        for i, word in enumerate(["Hel", "lo"]):
            whole = chat_event(word)
            writer.write(chunk(whole[:9]))  # torn mid-line: nothing is translated yet
            await writer.drain()
            writer.write(chunk(whole[9:]))
            await writer.drain()
            await relayed.until(lambda i=i: relayed.body.count(b"text_delta") == i + 1)
        writer.write(chunk(b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    echo = anthropic_translate.MessageEcho("claude-x")
    codec = Translated(AnthropicStream(echo), anthropic_translate.from_chat, echo, anthropic.modes)
    status, relayed, meter = await relay(client, script, codec=codec)
    events = named_events(relayed.body)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta") == "Hello"
    assert relayed.messages[0]["headers"][0] == (b"content-type", b"text/event-stream")
    assert relayed.messages[-1] == {"type": "http.response.body", "body": b""}
    assert (status, meter.error, meter.events) == (200, None, 3)  # the upstream's events


async def test_K2_a_translated_stream_broken_off_ends_with_the_dialects_error_events(
    client: Client,
) -> None:
    async def script(writer: asyncio.StreamWriter, relayed: Relayed) -> None:
        writer.write(SSE_HEAD + chunk(chat_event("Hal") + chat_event("lo")[:20]))
        await writer.drain()
        await relayed.until(lambda: b"output_text.delta" in relayed.body)
        writer.transport.abort()  # the backend dies mid-event

    echo = responses_translate.Echo(model="m")
    codec = Translated(
        ResponsesStream(echo), responses_translate.from_chat, echo, responses.streamed
    )
    status, relayed, meter = await relay(client, script, codec=codec)
    events = named_events(relayed.body)
    assert [name for name, _ in events][-3:] == [
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    failed = events[-1][1]["response"]
    assert failed["output"][0]["content"][0]["text"] == "Hal"  # the torn event was dropped
    assert events[-2][1]["code"] == "backend_error" and "chat#0" in events[-2][1]["message"]
    assert relayed.messages[-1] == {"type": "http.response.body", "body": b""}
    assert status == 502 and meter.error is not None and meter.error.startswith("backend_error")
