"""joiner.faust_restore: a fetch's changelog records applied in one call, with Faust's recovery
bookkeeping (applied offsets, the end of recovery, standbys ready, the records left: a metric);
records Faust's own buffer holds go first; an untracked partition or a table with a per-event
hook is left to Faust.
The rebuild on the real broker: test_store_damage.py, test_faust_joiner.py (a drain on an empty
disk; a takeover by the worker holding the partitions as standby)."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiokafka.structs import ConsumerRecord
from faust.types import TP
from prometheus_client import REGISTRY

from joiner.faust_restore import Restorer


class _Table:
    _on_changelog_event = None

    def __init__(self) -> None:
        self.applied: list[list[tuple[bytes, int]]] = []

    def apply_changelog_batch(self, batch) -> None:
        self.applied.append([(e.message.key, e.message.offset) for e in batch])


class _Tables:
    standbys_ready = False

    def on_standbys_ready(self) -> None:
        self.standbys_ready = True


class _Recovery:
    """The parts of faust.tables.recovery.Recovery that Faust's own per-record loop uses."""

    def __init__(self, table: _Table, active: set, standby: set, highwaters: dict) -> None:
        self.tp_to_table = {tp: table for tp in active | standby}
        self.active_tps, self.standby_tps = active, standby
        self.active_offsets: Counter = Counter({tp: -1 for tp in active})
        self.standby_offsets: Counter = Counter({tp: -1 for tp in standby})
        self.active_highwaters = {tp: highwaters[tp] for tp in active}
        self.standby_highwaters = {tp: highwaters[tp] for tp in standby}
        self.buffers: dict = {table: []}
        self.tables = _Tables()
        self.in_recovery, self.signal_recovery_end = True, asyncio.Event()
        self._last_flush_at = None
        self.ended = 0

    def need_recovery(self) -> bool:
        return self.active_remaining_total() > 0

    def active_remaining_total(self) -> int:
        return sum(h - self.active_offsets[tp] for tp, h in self.active_highwaters.items())

    def standby_remaining_total(self) -> int:
        return sum(max(h - self.standby_offsets[tp], 0) for tp, h in self.standby_highwaters.items())

    def flush_buffers(self) -> None:
        for table, buf in self.buffers.items():
            if buf:
                table.apply_changelog_batch(buf)
                buf.clear()

    def _set_recovery_ended(self) -> None:
        self.in_recovery = False
        self.ended += 1


def _recs(p: int, offsets) -> list:
    return [ConsumerRecord("log", p, o, 0, 0, f"k{o}".encode(), b"v", None, 2, 1, ()) for o in offsets]


def test_a_fetch_is_applied_once_in_order_and_the_recovery_ends_at_the_highwater(caplog) -> None:
    table = _Table()
    t0, t1 = TP("log", 0), TP("log", 1)
    rec = _Recovery(table, active={t0}, standby={t1}, highwaters={t0: 5, t1: 2})
    restore = Restorer(rec)
    held = type("Event", (), {"message": _recs(0, [0])[0]})()
    rec.buffers[table].append(held)  # (taken Faust's way before: applied first)
    rec.active_offsets[t0] = 0
    assert restore.apply(t0, _recs(0, range(0, 3)))  # offset 0 again (a re-fetch): skipped
    assert table.applied == [[(b"k0", 0)], [(b"k1", 1), (b"k2", 2)]] and rec.active_offsets[t0] == 2
    assert rec.in_recovery and not rec.signal_recovery_end.is_set()
    assert REGISTRY.get_sample_value("driftline_joiner_changelog_rebuild_remaining") == 3  # (the status page's line)
    with caplog.at_level("INFO", "joiner.faust_restore"):
        assert restore.apply(t0, _recs(0, range(3, 6)))
    assert "rebuilt partitions from 5 changelog records in" in caplog.text  # (2 + 3: not the re-fetched one)
    assert rec.active_offsets[t0] == 5 and not rec.in_recovery and rec.signal_recovery_end.is_set()
    assert REGISTRY.get_sample_value("driftline_joiner_changelog_rebuild_remaining") == 0
    assert not rec.tables.standbys_ready  # the standby still has records to read
    assert restore.apply(t1, _recs(1, range(0, 3)))
    assert rec.standby_offsets[t1] == 2 and rec.tables.standbys_ready and rec.ended == 1


def test_what_recovery_does_not_track_is_left_to_faust() -> None:
    table = _Table()
    rec = _Recovery(table, active={TP("log", 0)}, standby=set(), highwaters={TP("log", 0): 3})
    restore = Restorer(rec)
    assert not restore.apply(TP("log", 7), _recs(7, [0]))
    table._on_changelog_event = object()  # (Faust calls such a hook per event)
    assert not restore.apply(TP("log", 0), _recs(0, [0]))
    assert table.applied == [] and rec.active_offsets[TP("log", 0)] == -1
