"""A fetch's records of the join table's changelog, applied in one call: the rebuild of a
partition (a takeover, a worker that lost its disk) and the standby replicas.

Faust hands a changelog record to its recovery one at a time: a ``ConsumerMessage``, the
topic's callback, an ``Event``, a put on the changelog queue, and on the other side of the queue
an ``asyncio.wait_for`` (a task) per get and a scan of every active partition's remaining count
to see whether recovery is over. Profiled (py-spy) on a worker rebuilding four partitions from an
empty disk, that was 4,300-6,000 records/s; the store's own work
(:meth:`joiner.faust_store.JoinStore.apply_changelog_batch`, which holds a batch's records back
until its commit marker) was a small part of it. One call per fetch: about 100k records/s
(joiner/README.md, "The rebuild a fetch at a time").

:meth:`Restorer.apply` does what Faust's ``Recovery._slurp_changelogs`` does for each record, once per
fetch: skip records at or below the partition's applied offset, hand the rest to the table's
store in one batch (after what Faust's own buffer still holds of that table: the order of a
partition's records is kept), advance the partition's offset, and end the recovery (or mark the
standbys ready) when no partition has records left, and logs the rebuild's records and rate. A partition recovery does not track goes
back to Faust's way (:func:`joiner.faust_fetch._deliver`), as does a table with an
``on_changelog_event`` hook (it is called per event; the joiner's table has none).

``driftline_joiner_changelog_rebuild_remaining`` says how many records a rebuild has left (the
status page lists a rebuild under "What is wrong now": its partitions join nothing meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from faust.types import TP

from joiner.metrics import CHANGELOG_RESTORED, REBUILD_REMAINING

__all__ = ["Restorer"]

log = logging.getLogger(__name__)


class Record(NamedTuple):
    """What a table's store reads of a changelog event: its ``message`` (here aiokafka's
    ``ConsumerRecord``: ``partition``, ``offset``, raw ``key`` and ``value``)."""

    message: Any


class Restorer:
    """Applies the changelog records of one Faust app's fetches (its ``app.tables.recovery``)."""

    def __init__(self, recovery: Any) -> None:
        self.recovery = recovery
        self._rebuild: tuple[float, int] | None = None  # (started, records) of the rebuild under way

    def apply(self, tp: TP, records: Sequence[Any]) -> bool:
        """Apply ``records`` (one fetch's, of changelog partition ``tp``, in offset order) as Faust's
        recovery would; False, with nothing done, when it should get them one at a time instead."""
        recovery = self.recovery
        table = recovery.tp_to_table.get(tp)
        if table is None or table._on_changelog_event is not None:
            return False
        if tp in recovery.active_tps:
            offsets, kind = recovery.active_offsets, "active"
        elif tp in recovery.standby_tps:
            offsets, kind = recovery.standby_offsets, "standby"
        else:
            return False
        seen = offsets.get(tp)
        fresh = records if seen is None else [r for r in records if r.offset > seen]
        if fresh:
            held = recovery.buffers.get(table)
            if held:  # (records Faust's way took before: first, in their order)
                table.apply_changelog_batch(held)
                held.clear()
            table.apply_changelog_batch([Record(r) for r in fresh])
            offsets[tp] = fresh[-1].offset
            recovery._last_flush_at = time.monotonic()
            CHANGELOG_RESTORED.labels(kind).inc(len(fresh))
            if kind == "active" and recovery.in_recovery:
                started, n = self._rebuild or (time.monotonic(), 0)
                self._rebuild = (started, n + len(fresh))
        self._maybe_done()
        return True

    def _maybe_done(self) -> None:
        """Faust's end-of-recovery checks, made after each of its records (``_slurp_changelogs``)."""
        recovery = self.recovery
        if recovery.in_recovery and not recovery.need_recovery():
            recovery.flush_buffers()
            recovery._set_recovery_ended()
            recovery.signal_recovery_end.set()
            if self._rebuild is not None:
                started, n = self._rebuild
                took = time.monotonic() - started
                log.info("rebuilt partitions from %d changelog records in %.2f s (%.0f records/s)",
                         n, took, n / max(took, 1e-9))
                self._rebuild = None
        REBUILD_REMAINING.set(max(recovery.active_remaining_total(), 0) if recovery.in_recovery else 0)
        tables = recovery.tables
        if not tables.standbys_ready and not recovery.standby_remaining_total():
            tables.on_standbys_ready()
