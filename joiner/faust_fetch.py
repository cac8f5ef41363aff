"""Batch delivery of the joiner's input records out of Faust's consumer.

Faust hands a fetched record to its streams one at a time: a ``ConsumerMessage`` and an
``Event`` per record, and, in the fetch loop (``Consumer._drain_messages``), two tasks per record
(``wait_first(callback(message), suspend_flow.wait())``). Profiled on the joiner bench that
per-record delivery took about two thirds of the worker's time, more than the join itself.

:func:`install` replaces the fetch loop of one app's consumer by one that hands each fetch's
records of the ``inputs`` topics, as aiokafka ``ConsumerRecord`` lists, to one coroutine call
per fetch. The table's changelog records (recovery and standby replicas) are applied a fetch at a
time too (:mod:`joiner.faust_restore`), or, for a partition Faust's recovery does not track,
record by record through Faust's callback, run inline unless it has to wait (:func:`_deliver`). The records of an input partition keep
their order; the interleaving of partitions does not matter to the join (see
:mod:`joiner.core`).

The input topics are declared with ``acks=False``: Faust neither acks nor commits their offsets.
The caller commits them (:func:`commit`) from its own state, which says where each partition's
input resumes (:mod:`joiner.worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from types import MethodType
from typing import Any

from faust.types import TP

from joiner import faust_restore

log = logging.getLogger(__name__)
Handler = Callable[[list[Any]], Awaitable[None]]


def install(app: Any, inputs: Collection[str], handler: Handler) -> None:
    """Deliver the records of ``inputs`` to ``handler`` one fetch at a time (call before
    ``app.start()``)."""
    consumer = app.consumer
    consumer._drain_messages = MethodType(_fetch_loop_for(frozenset(inputs), handler), consumer)


def _fetch_loop_for(inputs: frozenset[str], handler: Handler) -> Callable[..., Awaitable[None]]:
    async def _drain_messages(self: Any, fetcher: Any) -> None:
        # Faust's loop (faust.transport.consumer.Consumer._drain_messages), less the
        # per-record work for the input topics; Fetcher runs it as a background task.
        callback, to_message = self.callback, self._to_message
        read_offset = self._read_offset
        restore = faust_restore.Restorer(self.app.tables.recovery)
        stopped, fetcher_stopped = self._stopped.is_set, fetcher._stopped.is_set
        try:
            while not (stopped() or fetcher_stopped()):
                records, active = await self._wait_next_records(1.0)
                await asyncio.sleep(0)  # (as Faust's: a fetch loop that never yields starves the rest)
                if not records or self.should_stop:
                    continue
                if not self.flow_active:  # a rebalance began during the fetch: read it again later
                    try:
                        await self.perform_seek()
                    except Exception as err:  # noqa: BLE001 - logged: the fetched records are put back unread either way
                        log.warning("seek after a suspended fetch failed: %r", err)
                    await _unread(self, {tp: recs for tp, recs in records.items() if tp.topic in inputs})
                    continue
                records = await _both_inputs(self, records, active, inputs)
                batch: list[Any] = []
                for tp, recs in records.items():
                    if not recs:
                        continue
                    if active is not None and tp not in active and tp not in self._buffered_partitions:
                        if tp.topic in inputs:  # (paused while the table recovers)
                            await _unread(self, {tp: recs})
                        continue
                    r_off = read_offset[tp]
                    if r_off is not None and recs[0].offset < r_off:
                        recs = [r for r in recs if r.offset >= r_off]  # (re-fetched after a seek)
                        if not recs:
                            continue
                    if tp.topic in inputs:
                        batch.extend(recs)
                    elif not restore.apply(tp, recs):
                        for r in recs:
                            await _deliver(self, callback(to_message(tp, r)))
                    read_offset[tp] = recs[-1].offset
                if batch:
                    # Not cancelled by a rebalance (unlike Faust's per-record callback): the
                    # handler commits a batch as a whole; a revocation waits for it.
                    await handler(batch)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                log.info("broker stopped the consumer, shutting down")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                return
            raise

    return _drain_messages


async def _both_inputs(consumer: Any, records: dict, active: Any, inputs: frozenset[str]) -> dict:
    """``records`` of a fetch, with what the fetch buffer already holds of the other input topic
    (no wait) when they hold records of one input only and the other has records on the broker
    past its read position (live, where most fetches are of one input and the other has nothing
    waiting, the loop asks nothing more of the consumer's thread). aiokafka hands out its buffered partitions
    in the order their fetch results came in, so during a backlog a fetch can serve one input's
    partitions for many batches before the other's: every impression then waits in the state
    across a batch and is written to the changelog whole, where in a batch with its actions it is
    joined and closed before the commit (about 210 bytes per impression against 29 on the joiner
    bench). The join's results do not depend on the batches (:mod:`joiner.core`)."""
    topics = {tp.topic for tp, recs in records.items() if recs and tp.topic in inputs}
    if len(topics) != 1 or active is None:
        return records
    others = {tp for tp in active if tp.topic in inputs and tp.topic not in topics and _behind(consumer, tp)}
    if not others:
        return records
    more = await consumer._getmany(active_partitions=others, timeout=0)
    return {**records, **{tp: recs for tp, recs in more.items() if recs}}


def _behind(consumer: Any, tp: TP) -> bool:
    """Whether the broker holds records of ``tp`` past the last one the loop read."""
    hw, last = consumer.highwater(tp), consumer._read_offset[tp]
    return hw is not None and (last is None or last + 1 < hw)


async def _unread(consumer: Any, dropped: Mapping[TP, list[Any]]) -> None:
    """Seek each partition back to the first of its fetched records that are dropped, so they
    are fetched again. Faust drops them the same way and counts on its seek to the committed
    offsets; but the inputs' offsets are committed from the join state, and a group with none
    (a new broker's data after a reset, a first start) leaves the position past the dropped
    records: they would be skipped (:meth:`joiner.worker.Worker.process` would then find the gap
    and seek back itself, one fetch later). Only a partition still assigned is sought; another
    owner starts at the committed offset or the beginning, and skips what its state has."""
    assigned = consumer.assignment()
    for tp, recs in dropped.items():
        if recs and tp in assigned:
            try:
                await consumer.seek(tp, recs[0].offset)
            except Exception as err:  # noqa: BLE001 - logged: a failed seek must not stop the fetch loop
                log.warning("seeking %s back to %d after a dropped fetch failed: %r", tp, recs[0].offset, err)


async def _deliver(consumer: Any, coro: Any) -> None:
    """Run Faust's per-record callback (a changelog record: recovery, standbys). It nearly
    always finishes without waiting (a put on a queue with room), so it is first run inline:
    Faust's way, ``wait_first(callback, suspend_flow.wait())``, costs two tasks per record, and
    the rebuild of a partition on takeover is a stream of such records. Only a callback that
    has to wait (a full queue) is finished Faust's way, so a rebalance can still cut it short."""
    try:
        yielded = coro.send(None)
    except StopIteration:
        return
    except BaseException:
        coro.close()
        raise
    await consumer.wait_first(_finish(coro, yielded), consumer.suspend_flow.wait())


async def _finish(coro: Any, yielded: Any) -> None:
    """Go on with a coroutine that was started by hand and is waiting on ``yielded`` (what it
    yielded to the event loop: a future, or None for a bare yield), as a task would."""
    try:
        while True:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                # (the coroutine's own await marked it; a second await of it requires the mark off)
                yielded._asyncio_future_blocking = False
                with contextlib.suppress(Exception):  # (its outcome is read by the coroutine)
                    await yielded
            yielded = coro.send(None)
    except StopIteration:
        return
    finally:
        coro.close()  # (cancelled by a rebalance: unwinds it as a task's cancellation would)


async def commit(app: Any, offsets: Mapping[TP, int]) -> None:
    """Commit the input offsets ``offsets`` (the next offset to read) for the group; offsets of
    partitions no longer assigned are left out (Faust's own rule)."""
    if offsets:
        await app.consumer._commit_offsets(dict(offsets))
