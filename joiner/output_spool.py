"""The ``examples`` records a joiner worker produced, kept on its local disk for
``joiner.output_retention_s`` to be produced again into a broker whose data was reset.

With tansu's memory storage a broker restart loses every topic (``docs/broker-reset.md``). The
joiner keeps its join state, so the inputs it re-reads from the new topics are duplicates and
join to nothing new: without a copy, the examples it had produced and the dumper or the trainer
had not read yet would be gone. So :class:`BatchedSender` hands every acknowledged record to
:meth:`OutputSpool.keep` (a :class:`services.spool.Spool`, RocksDB, beside the worker's state
store), and a worker that finds the broker on another epoch than the one its kept records went
to (while running or at its start) produces them all again, in order, each to its partition
(:meth:`OutputSpool.resend`) before it reads an input. The dumper (``dumper.dedup_min_wall_s``)
and the trainer (``trainer.dedup_window``) drop the copies they have by example id.

The copy is written after Kafka acknowledged the records and before the join state commits: a
crash in between replays the batch, which produces and keeps the same examples again (a second
copy, dropped downstream like any replay's).

>>> import asyncio, tempfile
>>> from services.settings import Settings
>>> class Sender:  # the one method of BatchedSender a resend uses
...     sent = []
...     async def send_raw(self, records): self.sent += records
>>> settings = Settings(var_dir=Path(tempfile.mkdtemp()))
>>> out = OutputSpool(settings, None)
>>> asyncio.run(out.resend(Sender(), "epoch-1"))       # a new spool: nothing was produced before
0
>>> out.keep([(0, b"batch-a"), (1, b"batch-b")])
>>> asyncio.run(out.resend(Sender(), "epoch-1")), Sender.sent  # the same broker: nothing to do
(0, [])
>>> asyncio.run(out.resend(Sender(), "epoch-2")), Sender.sent  # its data was reset
(2, [(0, b'batch-a'), (1, b'batch-b')])
>>> asyncio.run(out.resend(Sender(), "epoch-2"))
0
>>> class Refused(Sender):  # a broker that refuses the first try (a topic it has just created)
...     tries = 0
...     async def send_raw(self, records):
...         Refused.tries += 1
...         if Refused.tries == 1:
...             raise KafkaError("UnknownError")
>>> asyncio.run(out.resend(Refused(), "epoch-3")), Refused.tries
(2, 2)
>>> out.close()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from aiokafka.errors import KafkaError

from joiner import metrics as jm
from services.settings import Settings
from services.spool import Entry, Spool

log = logging.getLogger(__name__)

_READ_ENTRIES, _READ_BYTES = 256, 32 << 20  # one resend round: records, bytes


class RawSender(Protocol):
    async def send_raw(self, records: Sequence[tuple[int, bytes]]) -> None: ...


def spool_dir(settings: Settings, store_dir: Path | None) -> Path:
    """Beside the worker's state store (``<store dir>-examples-spool``): one per worker, like
    its store; ``<var>/joiner/examples-spool`` for a store that is not on disk."""
    if store_dir is None:
        return settings.var_dir / "joiner" / "examples-spool"
    return store_dir.with_name(store_dir.name + "-examples-spool")


class OutputSpool:
    """A worker's produced records (``(partition, record value)``) for the last
    ``joiner.output_retention_s``, at most ``joiner.output_spool_max_bytes``."""

    def __init__(self, settings: Settings, store_dir: Path | None) -> None:
        js = settings.joiner
        self.retry_s = settings.kafka.connect_timeout_s
        self.spool = Spool(spool_dir(settings, store_dir), js.output_spool_max_bytes, sync=False,
                           retention_s=js.output_retention_s, name="examples spool", knobs="joiner.output_spool")
        # kept before a crash that came before they were marked: they were acknowledged (keep()
        # runs after the acks), so they count as produced
        while self.spool.pending:
            self.spool.mark_shipped(self.spool.read(self.spool.shipped, _READ_ENTRIES, _READ_BYTES))
        self._gauge()

    def keep(self, records: Sequence[tuple[int, bytes]]) -> None:
        """Keep records Kafka acknowledged (``(partition, value)``, in the order produced)."""
        s = self.spool
        s.trim_expired()
        entries = []
        for p, raw in records:
            key = p.to_bytes(4, "big")
            entries.append(Entry(s.append(key, raw), key, raw))
        s.mark_shipped(entries)
        self._gauge()

    async def resend(self, sender: RawSender, epoch: str) -> int:
        """If the kept records went to a broker whose data began with another epoch than
        ``epoch``, produce them all again through ``sender`` (in order, each to its partition,
        waiting for the acks); returns how many. Then (and for a new spool) ``epoch`` is theirs."""
        s = self.spool
        if s.epoch == epoch:
            return 0
        n, position, was = 0, s.low, s.epoch
        while was is not None and (entries := s.read(position, _READ_ENTRIES, _READ_BYTES)):
            await self._send(sender, [(int.from_bytes(e.key, "big"), e.value) for e in entries])
            n, position = n + len(entries), entries[-1].end
        s.set_epoch(epoch)
        if n:
            jm.OUTPUT_RESENT.inc(n)
            log.warning("broker reset (epoch %s, was %s): produced the %d example records of the last %.0f s "
                        "again (the dumper and the trainer drop the ones they had)", epoch, was, n, s.retention_s)
        return n

    async def _send(self, sender: RawSender, records: list[tuple[int, bytes]]) -> None:
        """Send one round, again while the broker refuses it for up to ``kafka.connect_timeout_s``:
        just after a reset tansu can answer a produce to a topic it has just created with an
        error (``UnknownError`` seen in ``make chaos``); a copy sent twice is dropped downstream."""
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                return await sender.send_raw(records)
            except KafkaError as err:
                if time.monotonic() > deadline:
                    raise
                log.warning("re-sending kept examples after a broker reset failed (%r); trying again", err)
                await asyncio.sleep(0.5)

    def _gauge(self) -> None:
        jm.OUTPUT_SPOOL_BYTES.set(self.spool.bytes)

    def close(self) -> None:
        self.spool.close()
