"""The changelog callback of joiner.faust_fetch: inline when it need not wait, Faust's way when it
must (a full queue), and still cut short when the flow is suspended (a rebalance)."""

from __future__ import annotations

import asyncio

import mode

from joiner.faust_fetch import _deliver


def _consumer() -> mode.Service:
    consumer = mode.Service()
    consumer.suspend_flow = asyncio.Event()  # type: ignore[attr-defined]  # (Faust's Consumer has one)
    return consumer


async def test_a_callback_that_need_not_wait_runs_inline_and_one_that_must_wait_finishes() -> None:
    consumer, q = _consumer(), asyncio.Queue(1)
    await _deliver(consumer, q.put(1))
    assert q.qsize() == 1
    task = asyncio.create_task(_deliver(consumer, q.put(2)))  # the queue is full: it waits
    await asyncio.sleep(0.05)
    assert not task.done()
    assert await q.get() == 1
    await asyncio.wait_for(task, 5)
    assert await q.get() == 2


async def test_a_waiting_callback_is_cut_short_by_a_suspended_flow() -> None:
    consumer, q = _consumer(), asyncio.Queue(1)
    await q.put(1)
    task = asyncio.create_task(_deliver(consumer, q.put(2)))
    await asyncio.sleep(0.05)
    consumer.suspend_flow.set()  # type: ignore[attr-defined]
    await asyncio.wait_for(task, 5)
    assert q.qsize() == 1 and await q.get() == 1
    await asyncio.sleep(0.05)
    assert q.empty(), "the cut-short put never lands"
