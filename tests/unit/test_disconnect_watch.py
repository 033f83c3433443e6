"""proxy/forward.py `DisconnectWatch` (SPEC §6 S7): through the connection's hook when the
server offers one (corrallm's own, connection.py), else through a task in `receive()`,
and in neither case leaving garbage only the cyclic collector could free (SPEC §13: the
watcher's task was nearly all of the hot path's cyclic garbage)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest

from corrallm.http.asgi import CONNECTION, Message
from corrallm.proxy.forward import DisconnectWatch


@pytest.fixture
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Connection:
    def __init__(self) -> None:
        self.watchers: list[Callable[[], None]] = []

    def watch(self, gone: Callable[[], None]) -> Callable[[], None]:
        self.watchers.append(gone)
        return lambda: self.watchers.remove(gone)


async def never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_S7_the_connection_hook_cancels_the_request_and_no_task_is_made() -> None:
    connection = Connection()
    tasks = len(asyncio.all_tasks())

    async def request() -> None:
        watch = DisconnectWatch(never, {CONNECTION: connection})
        assert len(asyncio.all_tasks()) == tasks + 1  # the request's own task only
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            assert watch.absorb() and watch.client_gone
            watch.close()
            raise

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    assert len(connection.watchers) == 1
    connection.watchers[0]()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert connection.watchers == []


async def test_S7_a_finishing_answer_is_not_cancelled_by_the_hook() -> None:
    connection = Connection()
    watch = DisconnectWatch(never, {CONNECTION: connection})
    watch.finishing = True
    connection.watchers[0]()
    assert not watch.client_gone
    watch.close()
    assert connection.watchers == []


@pytest.mark.usefixtures("no_cyclic_collector")
@pytest.mark.parametrize("hooked", [True, False])
async def test_a_closed_watch_is_freed_by_reference_counting_alone(hooked: bool) -> None:
    scope = {CONNECTION: Connection()} if hooked else {}
    watch = DisconnectWatch(never, scope)
    await asyncio.sleep(0)  # the fallback's watcher task is parked in receive()
    watch.close()
    for _ in range(3):  # the watcher's cancel is delivered and its task ends
        await asyncio.sleep(0)
    ref = weakref.ref(watch)
    del watch
    assert ref() is None
