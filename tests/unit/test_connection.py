"""corrallm/http/connection.py's response writer (`LeanCycle`) against a recording transport:
what goes out, in how many writes, and uvicorn's checks kept."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl

from corrallm.http.asgi import CONNECTION
from corrallm.http.connection import LeanCycle


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


def cycle(method: str = "POST", keep_alive: bool = True) -> tuple[LeanCycle, Transport, list[int]]:
    transport = Transport()
    done: list[int] = []
    scope: Any = {"type": "http", "method": method, "headers": []}
    c = LeanCycle(
        scope=scope,
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test"),
        access_log=False,
        default_headers=[(b"server", b"corrallm")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: done.append(1),
    )
    return c, transport, done


def start(status: int = 200, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": list(headers)}


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def test_a_known_length_answer_is_one_write_of_head_and_body() -> None:
    c, transport, done = cycle()
    c.scope[CONNECTION] = c  # as the connection puts it there
    await c.send(start(200, (b"content-type", b"application/json"), (b"content-length", b"2")))
    await c.send(body(b"{}"))
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\nserver: corrallm\r\ncontent-type: application/json\r\n"
        b"content-length: 2\r\n\r\n{}"
    ]
    assert c.response_complete and done == [1]
    assert CONNECTION not in c.scope  # scope and cycle no longer hold each other
    await asyncio.sleep(0)  # the end-of-turn flush finds nothing left to send
    assert len(transport.writes) == 1


async def test_a_held_head_goes_alone_at_the_end_of_the_turn() -> None:
    c, transport, _ = cycle()
    await c.send(start(200, (b"content-length", b"5")))
    assert transport.writes == []
    await asyncio.sleep(0)
    assert transport.writes == [b"HTTP/1.1 200 OK\r\nserver: corrallm\r\ncontent-length: 5\r\n\r\n"]
    await c.send(body(b"hel", more=True))
    await c.send(body(b"lo"))
    assert transport.writes[1:] == [b"hel", b"lo"]


async def test_a_chunked_answer_sends_its_head_at_once_and_frames_each_piece() -> None:
    c, transport, done = cycle()
    await c.send(start(200, (b"content-type", b"text/event-stream")))
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\nserver: corrallm\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    ]
    await c.send(body(b"data: 1\n\n", more=True))
    await c.send(body(b""))
    assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]
    assert done == [1]


async def test_head_requests_get_no_body_and_close_is_kept() -> None:
    c, transport, _ = cycle("HEAD", keep_alive=False)
    await c.send(start(200, (b"content-length", b"5")))
    await c.send(body(b""))
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\nserver: corrallm\r\ncontent-length: 5\r\nconnection: close\r\n\r\n"
    ]
    assert transport.closed


@pytest.mark.parametrize(
    ("header", "error"),
    [
        ((b"bad name", b"v"), "Invalid HTTP header name."),
        ((b"x-ok", b"split\r\nx-injected: 1"), "Invalid HTTP header value."),
    ],
)
async def test_uvicorns_header_checks_still_hold(header: tuple[bytes, bytes], error: str) -> None:
    c, transport, _ = cycle()
    with pytest.raises(RuntimeError, match=error):
        await c.send(start(200, (b"x-fine", b"yes\tand tabs"), header))
    assert transport.writes == []


async def test_lengths_are_checked_both_ways() -> None:
    c, _, _ = cycle()
    await c.send(start(200, (b"content-length", b"2")))
    with pytest.raises(RuntimeError, match="longer"):
        await c.send(body(b"abc"))
    c, _, _ = cycle()
    await c.send(start(200, (b"content-length", b"2")))
    with pytest.raises(RuntimeError, match="shorter"):
        await c.send(body(b"a"))


async def test_nothing_is_written_once_the_client_is_gone() -> None:
    c, transport, _ = cycle()
    c.disconnected = True
    await c.send(start(200, (b"content-length", b"2")))
    await c.send(body(b"{}"))
    assert transport.writes == []


async def test_write_more_frames_a_chunk_without_a_message() -> None:
    c, transport, _ = cycle()
    await c.send(start(200, (b"content-type", b"text/event-stream")))
    assert c.writable()
    c.write_more(b"data: 1\n\n")
    assert transport.writes[-1] == b"9\r\ndata: 1\n\n\r\n"
    c.flow.pause_writing()
    assert not c.writable()  # the client is behind: `send`, which waits, takes over
    c.flow.resume_writing()
    await c.send(body(b""))
    assert not c.writable()  # over


async def test_S7_watching_a_client_already_gone_calls_back_at_once() -> None:
    c, _, _ = cycle()
    c._watchers = []
    gone: list[int] = []
    stop = c.watch(lambda: gone.append(1))
    assert gone == [] and len(c._watchers) == 1
    stop()
    assert c._watchers == []
    c.disconnected = True  # the connection was lost before the request watched it
    c.watch(lambda: gone.append(2))
    assert gone == [2] and c._watchers == []
