"""The join itself, with no Kafka in it: events in, emitted examples out, state in a TieredState.

Emitted examples are :data:`joiner.batches.Emitted` tuples (:meth:`JoinCore.take`); the app turns
each flush's into one columnar batch record per output partition (:func:`joiner.batches.build`).

Every decision is a pure function of (a) the impression's event time, (b) the action's event
time, and (c) the *prefix watermarks*: for a feature log, the features watermark of the feature
logs before it on its partition (``wf_before``); for an action, the actions watermark of the
actions before it on its partition (``wa_before``). A watermark is the (k+1)-th largest distinct
event time seen on the partition (:mod:`joiner.watermark`, k = ``watermark_outliers``), so up to
k far-off events cannot move it. Both depend only on the order of records within one partition
of one topic, which Kafka fixes. So the examples do not depend on how the features and actions
partitions happen to be interleaved by the consumer, on batch boundaries, or on when a restart
happened: this is what makes a crash + replay produce the same examples.

An action ``a`` joins impression ``i`` (same request id and item id) iff all of::

    wf_before(i) <= a.time + G           # otherwise a was an orphan: its features came too late
    a.time - i.time <= W                  # otherwise the action is outside the window
    wa_before(a) <= i.time + W + L + R    # otherwise i was forgotten long ago (expired)
    wa_before(a) <= i.time + W + L        # otherwise the window had closed: a is late

The window of ``i`` closes when the action watermark passes ``i.time + W + L``; then ``i`` is
emitted as a negative (sampled) unless it was positive. Closing is driven by the action watermark
of the partition: event time, never the wall clock. The closed impression stays as a tombstone
until *both* watermarks pass ``i.time + W + L + R``, and a feature log with
``wf_before > time + W + L + R`` is refused (``expired_impressions``): so an impression whose
tombstone is gone can never come back as a new one (a re-sent feature log, or one re-read after a
broker reset), and the joiner never emits a second, different example under an example id.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Sequence

from joiner import batches, sampling
from joiner.config import JoinConfig
from joiner.tiered import TieredState
from joiner.watermark import NO_WATERMARK, Watermark
from proto import Action, FeatureLog

# Impression record: header + payload (joiner.batches.payload: model id, context and candidate Features).
#   t_i, user_id, wf_before, sample_rate, state, label mask, corrected mask
HEADER = struct.Struct("<qqqfBHH")
WAITING, POSITIVE, CLOSED = 0, 1, 2
_STATE_AT = HEADER.size - 5
# Pending (not yet joined) action: a.time, wa_before, label index, broker timestamp.
PENDING = struct.Struct("<qqHq")
_P = struct.Struct(">H")
_TS = struct.Struct(">Q")
_I64 = struct.Struct("<q")
# Time-index keys: kind(1) partition(2) time(8) [tag(1)] id. T keys index one *group* of
# impressions (the new candidates of one FeatureLog, which share their event time): the id is
# ``request_id/first_item`` and the value the group's item ids (packed int64).
_TAG_AT, _ID_AT = 11, 12
_MAX_MS = (1 << 63) - 1

JOIN, ORPHAN, OUT_OF_WINDOW, EXPIRED, LATE = "join", "orphan", "out_of_window", "expired", "late"


def _t(ms: int) -> bytes:
    return _TS.pack(min(max(ms, 0), _MAX_MS))


def pack_items(items: list[int]) -> bytes:
    return struct.pack(f"<{len(items)}q", *items)


def unpack_items(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 8}q", raw)


class JoinCore:
    """Join state machine for the partitions of one worker."""

    def __init__(self, state: TieredState, config: JoinConfig) -> None:
        self.state = state
        self.cfg = config
        self.labels = config.labels
        self.label_index = {t: self.labels.index(lbl) for t, lbl in config.label_map.items()}
        self.W, self.L = config.window_ms, config.lateness_ms
        self.G, self.R = config.orphan_grace_ms, config.retention_ms
        self.correction = config.late_policy == "correction"
        self.immediate = config.positive_emit == "immediate"
        # the label bits whose join emits an impression at once (immediate): the learned label's, or all
        self.emit_mask = (-1 if config.immediate_label is None
                          else 1 << self.labels.index(config.immediate_label))
        self.k = config.watermark_outliers
        # The watermark values (read on every record) and the Watermarks that compute them.
        self.wf: dict[int, int] = {}
        self.wa: dict[int, int] = {}
        self.wmf: dict[int, Watermark] = {}
        self.wma: dict[int, Watermark] = {}
        self.waiting: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.out: list[batches.Emitted] = []
        # (kind, partition) -> event time below which the index has no keys: the last scan's end
        # (lowered when a key is put below it). In memory only: 0 after a restart. It keeps the
        # scans off the range of deleted keys, which RocksDB would otherwise step over each time.
        self.floor: dict[tuple[bytes, int], int] = {}
        self.counts: Counter[str] = Counter()

    # -- partition metadata -------------------------------------------------------------------
    def load(self, p: int) -> None:
        def meta(name: str, default: int) -> int:
            raw = self.state.peek(b"M" + name.encode() + _P.pack(p))
            return _I64.unpack(raw)[0] if raw else default

        # (a store written before the outlier-robust rule has only the values: "wf", "wa")
        wmf = self.wmf[p] = Watermark.decode(self.state.peek(b"Mwmf" + _P.pack(p)), self.k, meta("wf", NO_WATERMARK))
        wma = self.wma[p] = Watermark.decode(self.state.peek(b"Mwma" + _P.pack(p)), self.k, meta("wa", NO_WATERMARK))
        self.wf[p], self.wa[p] = wmf.value, wma.value
        self.waiting[p] = meta("waiting", 0)
        self.pending[p] = meta("pending", 0)

    def save(self, p: int) -> None:
        put, pp = self.state.put, _P.pack(p)
        put(b"Mwmf" + pp, self.wmf[p].encode())
        put(b"Mwma" + pp, self.wma[p].encode())
        put(b"Mwaiting" + pp, _I64.pack(self.waiting[p]))
        put(b"Mpending" + pp, _I64.pack(self.pending[p]))

    # -- decisions -----------------------------------------------------------------------------
    def judge(self, t_i: int, wf_before_i: int, a_time: int, wa_before: int) -> str:
        if wf_before_i > a_time + self.G:
            return ORPHAN
        if a_time - t_i > self.W:
            return OUT_OF_WINDOW
        if wa_before > t_i + self.W + self.L + self.R:
            return EXPIRED
        if wa_before > t_i + self.W + self.L:
            return LATE
        return JOIN

    def _emit(self, user_id: int, t_i: int, eid: bytes, base: bytes, mask: int, rate: float, ref_ts: int,
              suffix: str = "") -> None:
        self.out.append((user_id, t_i, eid, base, mask, rate, ref_ts, suffix))

    def _correction(self, eid: bytes, user_id: int, t_i: int, base: bytes, li: int, ref_ts: int) -> None:
        self._emit(user_id, t_i, eid, base, 1 << li, 1.0, ref_ts, f"#late-{self.labels[li]}")
        self.counts["corrections"] += 1

    # -- events ---------------------------------------------------------------------------------
    def on_features(self, p: int, fl: FeatureLog, ts_ms: int = 0) -> None:
        state, cfg, counts = self.state, self.cfg, self.counts
        get, put = state.get, state.put
        wf_before = self.wf[p]
        t_i = fl.event_time_ms
        wm = self.wmf[p]
        wm.observe(t_i)
        self.wf[p] = wm.value
        if wf_before > t_i + self.W + self.L + self.R:
            # Its tombstone may be gone already: it cannot be told apart from a new impression,
            # and emitting it could give a second, different example under its example id.
            counts["impressions"] += len(fl.candidates)
            counts["expired_impressions"] += len(fl.candidates)
            return
        rid = fl.request_id
        rid_b = rid.encode()
        user_id = fl.user_id
        model_id = fl.model_version.model_id
        rate = float(cfg.slice_sample_rates.get(model_id, cfg.negative_sample_rate))
        closes_at = t_i + self.W + self.L
        close_now = self.wa[p] > closes_at  # the action stream is already past this window
        head = None
        pending = self.pending[p] > 0
        new_items: list[int] = []
        records: list[bytes] = []
        n = 0
        for c in fl.candidates:
            n += 1
            item = c.item_id
            eid = rid_b + b"/" + str(item).encode()
            ikey = b"I" + eid
            seen = get(ikey)
            if seen is not None:
                # Another user's impression under this request id is a client reusing request
                # ids, not a re-sent feature log: said apart (dropped all the same).
                same = HEADER.unpack_from(seen, 0)[1] == user_id
                counts["duplicate_impressions" if same else "reused_request_ids"] += 1
                continue
            if head is None:
                head = batches.payload(model_id, fl.context.SerializeToString(), b"")
            base = head + c.features.SerializeToString()  # (the candidate's Features come last)
            mask = corrected = 0
            st = WAITING
            pend = get(b"A" + eid) if pending else None
            if pend is not None:
                mask, corrected = self._join_pending(p, eid, t_i, wf_before, user_id, base, pend, ts_ms)
                if mask & self.emit_mask and self.immediate:
                    self._emit(user_id, t_i, eid, base, mask, 1.0, ts_ms)
                    counts["positives"] += 1
                    st = POSITIVE
            record = HEADER.pack(t_i, user_id, wf_before, rate, st, mask, corrected) + base
            put(ikey, record, cache=not close_now)  # (also makes a repeated item a duplicate)
            if close_now:
                records.append(record)
            new_items.append(item)
        counts["impressions"] += n
        if new_items:
            self.waiting[p] += len(new_items)
            gid = rid_b + b"/" + str(new_items[0]).encode()
            if close_now:
                self._close_group(p, rid_b, gid, closes_at, new_items, records, None)
            else:
                self._put_index(b"T", p, closes_at, b"c" + gid, pack_items(new_items))

    def _join_pending(self, p: int, eid: bytes, t_i: int, wf_before: int, user_id: int, base: bytes,
                      pend: bytes, ts_ms: int) -> tuple[int, int]:
        """Join the actions that came before their features; return (label mask, corrected)."""
        self.state.delete(b"A" + eid)
        mask = corrected = 0
        for off in range(0, len(pend), PENDING.size):
            a_time, wa_before, li, a_ts = PENDING.unpack_from(pend, off)
            self.pending[p] -= 1
            verdict = self.judge(t_i, wf_before, a_time, wa_before)
            if verdict == JOIN:
                if mask >> li & 1:
                    self.counts["duplicate_actions"] += 1
                mask |= 1 << li
                self.counts["joins"] += 1
            else:
                self._count_rejected(verdict)
                if verdict == LATE and self.correction and not (corrected >> li & 1):
                    corrected |= 1 << li
                    self._correction(eid, user_id, t_i, base, li, ts_ms)
        return mask, corrected

    def on_action(self, p: int, a: Action, ts_ms: int = 0) -> None:
        state = self.state
        self.counts["actions"] += 1
        wa_before = self.wa[p]
        wm = self.wma[p]
        wm.observe(a.event_time_ms)
        self.wa[p] = wm.value
        li = self.label_index.get(a.action_type)
        if li is None:
            self.counts["unmapped_actions"] += 1
            return
        eid = f"{a.request_id}/{a.item_id}".encode()
        ikey = b"I" + eid
        record = state.get(ikey)
        if record is None:
            self._add_pending(p, eid, a.event_time_ms, wa_before, li, ts_ms)
            return
        t_i, user_id, wf_before_i, rate, st, mask, corrected = HEADER.unpack_from(record, 0)
        verdict = self.judge(t_i, wf_before_i, a.event_time_ms, wa_before)
        if verdict == JOIN and st == CLOSED:
            verdict = LATE  # only after a drain (end of input) closed windows early
        if verdict != JOIN:
            self._count_rejected(verdict)
            if verdict == LATE and self.correction and not ((corrected | mask) >> li & 1) \
                    and len(record) > HEADER.size:
                corrected |= 1 << li
                self._correction(eid, user_id, t_i, record[HEADER.size:], li, ts_ms)
                state.put(ikey, HEADER.pack(t_i, user_id, wf_before_i, rate, st, mask, corrected)
                          + record[HEADER.size:])
            return
        if mask >> li & 1:
            self.counts["duplicate_actions"] += 1
            return
        self.counts["joins"] += 1
        mask |= 1 << li
        if self.immediate:
            if st == POSITIVE:
                self.counts["extra_labels"] += 1  # a second action type after the positive went out
            elif mask & self.emit_mask:
                st = POSITIVE
                self._emit(user_id, t_i, eid, record[HEADER.size:], mask, 1.0, ts_ms)
                self.counts["positives"] += 1
            # (otherwise it waits, with this label, for the learned one or its window's close)
        state.put(ikey, HEADER.pack(t_i, user_id, wf_before_i, rate, st, mask, corrected)
                  + record[HEADER.size:], cache=True)

    def _add_pending(self, p: int, eid: bytes, a_time: int, wa_before: int, li: int, ts_ms: int) -> None:
        akey = b"A" + eid
        pend = self.state.get(akey) or b""
        for off in range(0, len(pend), PENDING.size):
            t, _, label_index, _ = PENDING.unpack_from(pend, off)
            if t == a_time and label_index == li:
                self.counts["duplicate_actions"] += 1
                return
        self.state.put(akey, pend + PENDING.pack(a_time, wa_before, li, ts_ms))
        self._put_index(b"O", p, a_time + self.G, eid, b"")
        self.pending[p] += 1
        self.counts["pending_actions"] += 1

    def _put_index(self, kind: bytes, p: int, time_ms: int, rest: bytes, value: bytes) -> None:
        self.state.put_index(kind + _P.pack(p) + _t(time_ms) + rest, value)
        floor = self.floor.get((kind, p))
        if floor is not None and time_ms < floor:
            self.floor[(kind, p)] = time_ms  # scans start at the floor: keep the new key visible

    def _count_rejected(self, verdict: str) -> None:
        if verdict == ORPHAN:
            self.counts["orphan_actions"] += 1
        elif verdict in (LATE, EXPIRED, OUT_OF_WINDOW):
            self.counts["late_actions"] += 1
            self.counts[f"late_{verdict}"] += 1

    # -- watermark-driven work ------------------------------------------------------------------
    def _close_group(self, p: int, rid_b: bytes, gid: bytes, closes_at: int, items: Sequence[int],
                     records: Sequence[bytes | None], index: bytes | None) -> None:
        """Close the windows of one group (emit positives / sampled negatives), leave tombstones
        until ``closes_at + R`` and move the group's index entry there."""
        counts, emit, put = self.counts, self._emit, self.state.put
        keep_base = self.correction
        seed = self.cfg.seed
        closed = []
        for item, record in zip(items, records):
            if record is None or record[_STATE_AT] == CLOSED:
                continue
            t_i, user_id, wf_before_i, rate, st, mask, corrected = HEADER.unpack_from(record, 0)
            eid = rid_b + b"/" + str(item).encode()
            if st == WAITING:
                if mask:
                    emit(user_id, t_i, eid, record[HEADER.size:], mask, 1.0, 0)
                    counts["positives"] += 1
                elif rate >= 1.0 or sampling.keep(eid, rate, seed):
                    emit(user_id, t_i, eid, record[HEADER.size:], 0, rate, 0)
                    counts["negatives"] += 1
                else:
                    counts["negatives_sampled_out"] += 1
            # A tombstone, with the features only if corrections may need them.
            put(b"I" + eid, HEADER.pack(t_i, user_id, wf_before_i, rate, CLOSED, mask, corrected)
                + (record[HEADER.size:] if keep_base else b""))
            closed.append(item)
        self.waiting[p] -= len(closed)
        if closed:
            self._put_index(b"T", p, closes_at + self.R, b"x" + gid, pack_items(closed))
        if index is not None:
            self.state.delete_index(index)

    def advance(self, p: int, *, drain: bool = False) -> None:
        """Close the windows and forget the tombstones and orphans the watermarks have passed.

        With ``drain`` every waiting window is closed (end of input), without moving the watermark.
        """
        state = self.state
        pfx = b"T" + _P.pack(p)
        hi_ms = _MAX_MS if drain else self.wa[p]
        # Tombstones expire only once the features watermark has passed them too (see the module
        # doc), so the next scan starts no higher than that.
        forget_below = self.wf[p]
        lo_ms = self.floor.get((b"T", p), 0)
        if hi_ms > lo_ms:
            if not drain:
                # (lowered again by keys put below it meanwhile)
                self.floor[(b"T", p)] = max(lo_ms, min(hi_ms, forget_below))
            hi_key = pfx + b"\xff" * 9 if drain else pfx + _t(hi_ms)  # (drain: the clamped times too)
            for key, value in state.scan_items(pfx + _t(lo_ms), hi_key):
                tag = key[_TAG_AT]
                if tag == 0x78:  # b"x": the tombstones expire
                    if drain or _TS.unpack_from(key, 3)[0] >= forget_below:
                        continue
                    gid = key[_ID_AT:]
                    rid_b = gid.rsplit(b"/", 1)[0]
                    items = unpack_items(value)
                    for item in items:
                        state.delete(b"I" + rid_b + b"/" + str(item).encode())
                    state.delete_index(key)
                    continue
                gid = key[_ID_AT:]
                rid_b = gid.rsplit(b"/", 1)[0]
                items = unpack_items(value)
                records = [state.get(b"I" + rid_b + b"/" + str(item).encode()) for item in items]
                closes_at = _TS.unpack_from(key, 3)[0]
                self._close_group(p, rid_b, gid, closes_at, items, records, key)
        # Orphans: actions whose features the features stream has passed without delivering.
        pfx = b"O" + _P.pack(p)
        wf = self.wf[p]
        lo_ms = self.floor.get((b"O", p), 0)
        if wf > lo_ms:
            self.floor[(b"O", p)] = wf
            for key, _ in state.scan_items(pfx + _t(lo_ms), pfx + _t(wf)):
                eid = key[11:]
                state.delete_index(key)
                akey = b"A" + eid
                pend = state.peek(akey)
                if pend is None:
                    continue
                keep = b""
                for off in range(0, len(pend), PENDING.size):
                    entry = pend[off:off + PENDING.size]
                    if PENDING.unpack(entry)[0] + self.G < wf:
                        self.counts["orphan_actions"] += 1
                        self.pending[p] -= 1
                    else:
                        keep += entry
                if keep:
                    state.put(akey, keep)
                else:
                    state.delete(akey)
        self.save(p)

    def idle_advance(self, p: int, margin_ms: int) -> bool:
        """Raise the action watermark of ``p`` to its features watermark minus ``margin_ms`` (the
        actions partition is idle: the caller decides when, by wall clock). True if it moved."""
        wf = self.wf[p]
        if wf == NO_WATERMARK or not self.wma[p].raise_to(wf - margin_ms):
            return False
        self.wa[p] = wf - margin_ms
        self.counts["idle_advances"] += 1
        self.save(p)
        return True

    def rollback(self, parts: Sequence[int], counts: Counter[str]) -> None:
        """Back to the last committed state (after ``state.rollback()``): what a record that
        failed half-way did is undone; ``counts`` are the counters as they were then."""
        self.out = []
        self.counts = counts
        self.floor.clear()
        for p in parts:
            self.load(p)

    def take(self) -> list[batches.Emitted]:
        """The examples emitted since the last take, in emission order."""
        out, self.out = self.out, []
        return out
