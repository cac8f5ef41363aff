"""The online trainer's loader process: fetches ``examples`` from Kafka and ships whole batches of
raw record bytes to the trainer over a pipe (PERSIA's data loaders, one process).

Why a process: the trainer's training thread needs the GIL between its GIL-free torch/numba
kernels, and every bit of Python the trainer's event loop runs delays it - aiokafka builds a
``ConsumerRecord`` per record and the trainer used to wrap each again. Here that per-record Python
runs in another process (the other core); the trainer process only unpickles one message per batch
(a few ``memcpy``s) and decodes it with :mod:`trainer.wire` (GIL released).

Protocol (``multiprocessing`` spawn context, one duplex :func:`multiprocessing.Pipe`):

* trainer -> loader: ``("assign", generation, {partition: next offset or None})`` - fetch exactly
  these partitions of the topic from these offsets (None: the earliest; the trainer resolved
  snapshot and committed offsets), dropping whatever was fetched for an older generation;
  ``("stop",)``.
* loader -> trainer (``send_bytes`` of a pickle): ``("started", generation, {partition: offset})``
  once an assignment's positions are known, then :class:`Shipment`\\ s of that generation, each one
  batch (``batch_size`` records, or fewer once ``batch_timeout_s`` passed since its first record);
  ``("error", traceback)`` before the loader exits on an error.

The group membership, the rebalance listener and the offset commits stay in the trainer (a group
member whose partitions are paused: it never fetches). The trainer drops shipments of an older
generation, so a rebalance never applies records fetched for a superseded assignment.

The loader dies with the trainer, and only with it: it exits when its pipe to the trainer closes (the
kernel closes it when the trainer dies, kill -9 included: the read sees EOF, a blocked write a broken
pipe), when its parent process changes, or on ``("stop",)``. It ignores SIGINT and SIGTERM: a
supervisor stops a service by signalling its whole process group (and Ctrl-C reaches a terminal's
foreground group), and a loader dying first would end the trainer with :class:`LoaderDied` before
it drained, committed and wrote its final snapshot. It is spawned ignoring them already, so one
sent while it starts up is not fatal either. A loader that dies is an error in the trainer
(:class:`LoaderClient`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Shipment:
    """One batch of records of one generation, as the trainer decodes them. Record ``i``'s value is
    ``values[starts[i]:starts[i] + lengths[i]]`` (``lengths[i] == -1``: a null value); its key
    likewise in ``keys``/``key_lengths`` (-1: no key)."""

    generation: int
    polled_at_ms: int  # wall time of the poll that fetched the batch's first record
    values: bytes
    lengths: np.ndarray  # int64 [n]
    partitions: np.ndarray  # int64 [n]
    offsets: np.ndarray  # int64 [n]
    timestamps: np.ndarray  # int64 [n], -1 where none
    keys: bytes
    key_lengths: np.ndarray  # int64 [n]
    lag: dict[int, int]  # partition -> records behind its high watermark after this batch

    @property
    def size(self) -> int:
        return int(self.lengths.size)


class LoaderDied(RuntimeError):
    """The loader process exited or reported an error."""


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_VAL, _KEY, _PART, _OFF, _STAMP = (attrgetter(a) for a in ("value", "key", "partition", "offset", "timestamp"))


def _ship(generation: int, polled_at_ms: int, recs: list, highwater) -> Shipment:
    n = len(recs)
    vals = list(map(_VAL, recs))
    keys = list(map(_KEY, recs))
    lengths = np.fromiter((-1 if v is None else len(v) for v in vals), np.int64, n)
    key_lengths = np.fromiter((-1 if k is None else len(k) for k in keys), np.int64, n)
    parts = np.fromiter(map(_PART, recs), np.int64, n)
    offs = np.fromiter(map(_OFF, recs), np.int64, n)
    stamps = np.fromiter((-1 if t is None else t for t in map(_STAMP, recs)), np.int64, n)
    lag = {}
    for p in np.unique(parts).tolist():
        hw = highwater(p)
        if hw is not None:
            lag[p] = max(0, hw - int(offs[parts == p].max()) - 1)
    return Shipment(generation, polled_at_ms, b"".join(v for v in vals if v), lengths, parts, offs, stamps,
                    b"".join(k for k in keys if k), key_lengths, lag)


def main(conn, settings, topic: str, batch_size: int, batch_timeout_s: float, parent_pid: int) -> None:
    """The loader process' entry point (``multiprocessing`` spawn target)."""
    for sig in _STOP_SIGNALS:  # the trainer stops us (see the module docstring)
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s loader %(name)s: %(message)s")
    try:
        asyncio.run(_serve(conn, settings, topic, batch_size, batch_timeout_s, parent_pid))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the trainer is gone
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except OSError:
            pass
        raise


async def _serve(conn, settings, topic, batch_size, batch_timeout_s, parent_pid) -> None:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from services.kafka import start_client

    k = settings.kafka
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                request_timeout_ms=k.request_timeout_ms, max_poll_records=k.max_poll_records)
    await start_client(consumer, settings)
    loop = asyncio.get_running_loop()
    inbox: deque = deque()
    wake = asyncio.Event()

    def readable() -> None:
        try:
            while conn.poll():
                inbox.append(conn.recv())
        except (EOFError, OSError):
            inbox.append(("stop",))
            loop.remove_reader(conn.fileno())
        wake.set()

    loop.add_reader(conn.fileno(), readable)
    generation, tps = -1, []
    buf: list = []
    first_at, polled_at_ms = 0.0, 0
    try:
        while True:
            if os.getppid() != parent_pid:
                return  # the trainer died (and we were re-parented)
            while inbox:
                msg = inbox.popleft()
                if msg[0] == "stop":
                    return
                _, generation, starts = msg
                buf = []  # fetched for the superseded assignment
                tps = [TopicPartition(topic, p) for p in sorted(starts)]
                consumer.assign(tps)
                for tp in tps:
                    if starts[tp.partition] is None:
                        await consumer.seek_to_beginning(tp)
                    else:
                        consumer.seek(tp, starts[tp.partition])
                positions = {tp.partition: await consumer.position(tp) for tp in tps}
                conn.send_bytes(pickle.dumps(("started", generation, positions), protocol=5))
            if not tps:
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            now = time.monotonic()
            wait = 0.1 if not buf else max(0.0, first_at + batch_timeout_s - now)
            got = await consumer.getmany(timeout_ms=int(wait * 1000), max_records=batch_size - len(buf))
            if inbox:
                continue  # a new assignment: what this poll got belongs to the old one
            now = time.monotonic()
            for recs in got.values():
                if recs and not buf:
                    first_at, polled_at_ms = now, int(time.time() * 1000)
                buf.extend(recs)
            if buf and (len(buf) >= batch_size or now - first_at >= batch_timeout_s):
                ship = _ship(generation, polled_at_ms, buf,
                             lambda p: consumer.highwater(TopicPartition(topic, p)))
                buf = []
                # blocks while the pipe is full: the trainer's backpressure (it reads a few ahead)
                conn.send_bytes(pickle.dumps(ship, protocol=5))
    finally:
        loop.remove_reader(conn.fileno())
        await consumer.stop()


def _start_ignoring_stop_signals(process) -> None:
    """Start ``process`` with SIGINT and SIGTERM ignored from its first instruction: an ignored
    disposition survives fork and exec, and the spawned interpreter spends a second or two
    importing the trainer's modules before :func:`main` runs. The parent ignores them for the few
    milliseconds of the fork (a stop signal landing exactly then is lost: the supervisor's SIGKILL
    after its grace period then ends the trainer, which a restart recovers from its snapshot)."""
    import threading

    if threading.current_thread() is not threading.main_thread():  # signal.signal: main thread only
        process.start()
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        process.start()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


class LoaderClient:
    """The trainer's end: starts the loader process and receives its messages on the event loop
    (a reader callback; at most ``max_ahead`` undelivered batches are held, then reading pauses and
    the loader blocks on the full pipe)."""

    def __init__(self, settings, topic: str, batch_size: int, batch_timeout_s: float, max_ahead: int = 2):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=main, name="driftline-loader", daemon=True,
                                   args=(child, settings, topic, batch_size, batch_timeout_s, os.getpid()))
        _start_ignoring_stop_signals(self.process)
        child.close()
        self.max_ahead = max_ahead
        self._queue: deque = deque()
        self._error: LoaderDied | None = None
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._reading = False
        self._resume_reading()

    def _resume_reading(self) -> None:
        if not self._reading and self._error is None:
            self._loop.add_reader(self._conn.fileno(), self._readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._conn.fileno())
            self._reading = False

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                msg = pickle.loads(self._conn.recv_bytes())
                if isinstance(msg, tuple) and msg[0] == "error":
                    raise LoaderDied(f"the loader process failed:\n{msg[1]}")
                self._queue.append(msg)
                if len(self._queue) >= self.max_ahead:
                    self._pause_reading()
                    break
        except (EOFError, OSError):
            self.process.join(1)
            self._error = LoaderDied(f"the loader process exited (exit code {self.process.exitcode})")
            self._pause_reading()
        except LoaderDied as err:
            self._error = err
            self._pause_reading()
        self._wake.set()

    def assign(self, generation: int, starts: dict[int, int | None]) -> None:
        self._conn.send(("assign", generation, starts))

    async def get(self, timeout_s: float):
        """The next message (a :class:`Shipment` or a ``("started", ...)`` tuple), or None after
        ``timeout_s``; raises :class:`LoaderDied` once the loader is gone."""
        if not self._queue and self._error is None and timeout_s > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        if self._queue:
            msg = self._queue.popleft()
            self._resume_reading()
            return msg
        if self._error is not None:
            raise self._error
        if not self.process.is_alive():
            raise LoaderDied(f"the loader process exited (exit code {self.process.exitcode})")
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loader: ``("stop",)``, then our end of the pipe closes (a loader blocked writing
        a batch gets a broken pipe); SIGKILL if it is still there after ``timeout_s`` (it ignores
        SIGTERM)."""
        self._pause_reading()
        try:
            self._conn.send(("stop",))
        except OSError:
            pass
        self._conn.close()
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
