"""The changelog callback of joiner.faust_fetch: inline when it need not wait, Faust's way when it
must (a full queue), and still cut short when the flow is suspended (a rebalance); dropped input
records read again; a one-sided fetch joined by what the buffer holds of the other input."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

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


class _Fetching:
    """What the fetch loop reads of Faust's Consumer, around scripted fetches; records the seeks."""

    consumer_stopped_errors = ()

    def __init__(self, fetches: list, assigned: set) -> None:
        self.fetches, self.assigned, self.seeks = fetches, assigned, []
        self.buffered: dict = {}  # (aiokafka's fetch buffer: what _getmany hands out without waiting)
        self.asked: list = []
        self.highwaters: dict = {}
        self._read_offset: dict = defaultdict(lambda: None)  # (as Faust's)
        self._buffered_partitions: set = set()
        self._stopped, self.flow_active, self.should_stop = asyncio.Event(), True, False
        self.callback = self._to_message = None
        self.app = SimpleNamespace(tables=SimpleNamespace(recovery=None))  # (no changelog record reaches it)

    async def _wait_next_records(self, timeout: float):
        if not self.fetches:
            self._stopped.set()
            return {}, None
        records, active, self.flow_active = self.fetches.pop(0)
        return records, active

    def highwater(self, tp) -> int | None:
        return self.highwaters.get(tp)

    async def _getmany(self, active_partitions: set, timeout: float) -> dict:
        self.asked.append((active_partitions, timeout))
        return {tp: self.buffered.pop(tp) for tp in list(self.buffered) if tp in active_partitions}

    async def perform_seek(self) -> None:  # (a group with no committed offsets: nothing moves)
        pass

    def assignment(self) -> set:
        return self.assigned

    async def seek(self, tp, offset: int) -> None:
        self.seeks.append((tp, offset))
        self._read_offset[tp] = offset


def _records(topic: str, p: int, offsets: range) -> list:
    from aiokafka.structs import ConsumerRecord
    return [ConsumerRecord(topic, p, o, 0, 0, None, b"v", None, 1, 1, ()) for o in offsets]


async def test_input_records_the_loop_drops_are_fetched_again() -> None:
    """Records of a partition paused while the table recovers, or of a fetch that a rebalance
    suspended, are dropped as Faust drops them: the loop seeks their partitions back to the
    first of them, since a group with no committed offsets (after a broker reset) would
    otherwise go on past them."""
    from faust.types import TP

    from joiner.faust_fetch import _fetch_loop_for

    f0, a0, a1, other = TP("features", 0), TP("actions", 0), TP("actions", 1), TP("changelog", 0)
    paused = {f0: _records("features", 0, range(5, 8)), a0: _records("actions", 0, range(0, 4))}
    suspended = {a1: _records("actions", 1, range(10, 12)), other: _records("changelog", 0, range(3, 4))}
    got: list = []

    async def handler(batch: list) -> None:
        got.extend((r.topic, r.partition, r.offset) for r in batch)

    consumer = _Fetching([(paused, {f0}, True), (suspended, None, False)], {f0, a0, a1, other})
    stopped = mode.Service()  # (the fetcher: never stopped here)
    await _fetch_loop_for(frozenset({"features", "actions"}), handler)(consumer, stopped)
    assert got == [("features", 0, 5), ("features", 0, 6), ("features", 0, 7)]
    assert consumer.seeks == [(a0, 0), (a1, 10)], "the dropped inputs are read again; the changelog is Faust's"


async def test_a_fetch_of_one_input_gets_what_the_buffer_holds_of_the_other() -> None:
    """A fetch that served only features partitions takes the actions the fetch buffer already
    holds (no wait), so the batch can join them: read apart, every impression waits across a batch
    (the joiner bench's changelog bytes per impression); a fetch with both, or of changelog
    records, is left as it is, and so is one whose other input has nothing on the broker past
    what was read (live: nothing more is asked of the consumer)."""
    from faust.types import TP

    from joiner.faust_fetch import _fetch_loop_for

    f0, a0, a1, log0 = TP("features", 0), TP("actions", 0), TP("actions", 1), TP("changelog", 0)
    got: list = []

    async def handler(batch: list) -> None:
        got.append([(r.topic, r.partition, r.offset) for r in batch])

    fetches = [({f0: _records("features", 0, range(0, 2))}, {f0, a0, a1}, True),
               ({f0: _records("features", 0, range(2, 3)), a1: _records("actions", 1, range(0, 1))}, {f0, a0, a1}, True),
               ({f0: _records("features", 0, range(3, 4))}, {f0, a0, a1}, True)]  # a0 read to its end, a1 too
    consumer = _Fetching(fetches, {f0, a0, a1, log0})
    consumer.highwaters = {a0: 2, a1: 1}
    consumer.buffered = {a0: _records("actions", 0, range(0, 2)), log0: _records("changelog", 0, range(0, 1))}
    await _fetch_loop_for(frozenset({"features", "actions"}), handler)(consumer, mode.Service())
    assert got == [[("features", 0, 0), ("features", 0, 1), ("actions", 0, 0), ("actions", 0, 1)],
                   [("features", 0, 2), ("actions", 1, 0)], [("features", 0, 3)]]
    assert consumer.asked == [({a0, a1}, 0)], "asked once, for the other input, without waiting"
