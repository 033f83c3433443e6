"""The hop between a relaying worker and the owner of state: frames on a Unix socket.

A frame is a 9-byte head (`<IBI`: the payload's length, the message kind, the worker's
number for the request it is about) and a payload: nothing, an orjson array (the
per-request messages: a few strings and numbers, cheaper to write and read than any
struct of variable fields in Python), or a pickle (the config and a capture record,
which only ever cross between processes of this one program, on a socket in a folder
only its user may open).

Writes are corked: every frame a loop iteration sends goes out in one `write` at its end,
so that the messages of many requests share a system call (`release` and `done` are never
waited for). Both ends are `Link`s; each reads whole frames and hands them to `frame()`.
"""

from __future__ import annotations

import asyncio
import enum
import struct
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, cast

import orjson

HEAD = struct.Struct("<IBI")


class Kind(enum.IntEnum):
    # worker -> owner
    JOIN = 1  # [index, pid]: a worker says who it is, once
    ACQUIRE = 3  # [its live entry the first time, model, max tokens, session, hop]:
    # the pause, limits, spend, a slot and a ready backend for it
    RELEASE = 4  # [tokens, dollars]: its slot is given back (when no DONE follows at once)
    REQUEUE = 5  # preempted before it sent anything: queued again
    WITHDRAW = 6  # it stopped waiting (its client left, or it was cancelled)
    DONE = 7  # [its live entry if never sent, status, prompt and completion tokens, cost,
    # energy, its RELEASE or null, whether it has a row]: settled by the worker (its price,
    # activity row and metrics), only charged here (spend windows, usage event)
    CAPTURE = 8  # pickle: a capture record for the owner's ring (O2)
    PROGRESS = 9  # [[request, events relayed], ...]: tokens so far of its answers (O1)
    COUNTED = 10  # metrics.Counts.take() (or nothing): its visits' metrics since it last
    # sent them; request number 0 every PROGRESS_SECONDS, else the owner's TALLY's
    APPLIED = 11  # the owner's CONFIG or KEYS of this number is in force here
    # owner -> worker
    HELLO = 20  # pickle: the worker's brief (config, address, admin token)
    CONFIG = 21  # pickle: the config now in force (a reload); numbered, as KEYS: APPLIED
    KEYS = 27  # pickle: the runtime keys and refused secrets now (T2: made, rotated, revoked)
    COUNTS = 28  # [[subjects], [[header, value], ...]]: a key's x-ratelimit-* counts now
    QUEUED = 22  # [ticket, backend, position, waiting, eta]
    ADMITTED = 24  # [route id, base url, ticket, preemptible, rate-limit headers, load ms,
    # admitted (monotonic), spilled]
    REFUSED = 25  # the ApiError's fields: the surface renders it
    INTERRUPT = 26  # [reason, detail]: preempted, cancelled, its peer down
    TALLY = 29  # /metrics is read: what it counted, now (COUNTED, this request number)


def frame(kind: Kind, rid: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(len(payload), kind, rid) + payload


encode: Callable[[Any], bytes] = orjson.dumps
decode = orjson.loads


class Link(asyncio.Protocol):
    """One end of a hop connection: frames in (`frame()`), frames out (`send()`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        if self._buffer:  # the rest of a frame that came in parts
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        at, size = 0, len(data)
        while size - at >= 9:
            length, kind, rid = HEAD.unpack_from(data, at)
            end = at + 9 + length
            if end > size:
                break
            self.frame(kind, rid, data[at + 9 : end])
            at = end
        if at < size:  # most reads end on a frame's end: nothing is copied to the buffer
            self._buffer += memoryview(data)[at:]

    def frame(self, kind: int, rid: int, payload: bytes) -> None:
        raise NotImplementedError

    def send(self, kind: Kind, rid: int, payload: bytes = b"") -> None:
        if not self._out:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._out.append(HEAD.pack(len(payload), kind, rid) + payload)  # (a frame)

    def flush_now(self) -> None:
        if self._out:
            self._flush()

    def _flush(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(b"".join(out))


def eager(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run `coro` now, in the caller's frame, up to its first real wait; a task carries it
    on from there (None if it never waited). Most admissions wait for nothing (a free
    slot on a ready backend): they cost no task, no scheduling and no extra loop turn
    (what Python 3.12's eager task factory does, for the owner's hot messages only)."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_carry_on(coro, waiting))


async def _carry_on(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    await _resume(coro, waiting)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, None], waiting: Any) -> Generator[Any, Any, None]:
    """`await coro` for a coroutine already started: its awaited future handed to the
    task, what the task sends or throws handed back to it (as `yield from` would)."""
    while True:
        try:
            sent = yield waiting
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # a cancel: the coroutine handles it
            try:
                waiting = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                waiting = coro.send(sent)
            except StopIteration:
                return
