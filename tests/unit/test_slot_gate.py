"""The interim FIFO gate: never more than maxConcurrent, FIFO order, cancellation safe."""

import asyncio

from corrallm.scheduler.fifo import SlotGate


async def test_excess_requests_wait_fifo_and_capacity_is_never_exceeded():
    gate = SlotGate(2)
    order: list[int] = []
    running = 0
    peak = 0
    release = asyncio.Event()

    async def request(i: int) -> None:
        nonlocal running, peak
        await gate.acquire()
        order.append(i)
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1
        gate.release()

    tasks = []
    for i in range(6):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert order == [0, 1] and gate.waiting == 4
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4, 5]
    assert peak == 2 and gate.in_use == 0 and gate.waiting == 0


async def test_cancelled_waiter_leaves_queue_without_losing_a_slot():
    gate = SlotGate(1)
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    assert gate.waiting == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert gate.waiting == 0
    gate.release()
    assert gate.in_use == 0


async def test_slot_granted_to_a_waiter_cancelled_in_the_same_instant_is_passed_on():
    gate = SlotGate(1)
    await gate.acquire()
    first = asyncio.create_task(gate.acquire())
    second = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # grants `first`...
    first.cancel()  # ...which is cancelled before it runs
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)
    assert gate.in_use == 1 and gate.waiting == 0
