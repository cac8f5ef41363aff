"""The join itself, with no Kafka in it: events in, Example bytes out, state in a TieredState.

Every decision is a pure function of (a) the impression's event time, (b) the action's event
time, and (c) the *prefix watermarks*: for a feature log, the max event time of the feature logs
before it on its partition (``wf_before``); for an action, the max event time of the actions
before it on its partition (``wa_before``). Both depend only on the order of records within one
partition of one topic, which Kafka fixes. So the examples do not depend on how the features and
actions partitions happen to be interleaved by the consumer, on batch boundaries, or on when a
restart happened: this is what makes a crash + replay produce the same examples.

An action ``a`` joins impression ``i`` (same request id and item id) iff all of::

    wf_before(i) <= a.time + G           # otherwise a was an orphan: its features came too late
    a.time - i.time <= W                  # otherwise the action is outside the window
    wa_before(a) <= i.time + W + L + R    # otherwise i was forgotten long ago (expired)
    wa_before(a) <= i.time + W + L        # otherwise the window had closed: a is late

The window of ``i`` closes when the action watermark passes ``i.time + W + L``; then ``i`` is
emitted as a negative (sampled) unless it was positive. Closing is driven by the action watermark
of the partition: event time, never the wall clock.
"""

from __future__ import annotations

import struct
import time
from collections import Counter

from joiner import sampling, wire
from joiner.tiered import TieredState
from joiner.types import JoinConfig
from proto import Action, FeatureLog

# Impression record: header + base Example bytes (see joiner.wire).
#   t_i, user_id, wf_before, sample_rate, state, label mask, corrected mask
HEADER = struct.Struct("<qqqfBHH")
WAITING, POSITIVE, CLOSED = 0, 1, 2
# Pending (not yet joined) action: a.time, wa_before, label index, broker timestamp.
PENDING = struct.Struct("<qqHq")
_P = struct.Struct(">H")
_TS = struct.Struct(">Q")
_I64 = struct.Struct("<q")

JOIN, ORPHAN, OUT_OF_WINDOW, EXPIRED, LATE = "join", "orphan", "out_of_window", "expired", "late"
NO_WATERMARK = -(1 << 62)


def _t(ms: int) -> bytes:
    return _TS.pack(min(max(ms, 0), (1 << 63) - 1))


def index_key(kind: bytes, partition: int, time_ms: int, tag: bytes, eid: bytes) -> bytes:
    return kind + _P.pack(partition) + _t(time_ms) + tag + eid


class JoinCore:
    """Join state machine for the partitions of one worker."""

    def __init__(self, state: TieredState, config: JoinConfig) -> None:
        self.state = state
        self.cfg = config
        self.labels = config.labels
        self.label_index = {t: self.labels.index(lbl) for t, lbl in config.label_map.items()}
        self.tails = wire.TailCache(self.labels)
        self.W, self.L = config.window_ms, config.lateness_ms
        self.G, self.R = config.orphan_grace_ms, config.retention_ms
        self.correction = config.late_policy == "correction"
        self.immediate = config.positive_emit == "immediate"
        self.wf: dict[int, int] = {}
        self.wa: dict[int, int] = {}
        self.waiting: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.out: list[tuple[bytes, bytes, int]] = []  # (key, value, latency reference ts ms or 0)
        self.counts: Counter[str] = Counter()

    # -- partition metadata -------------------------------------------------------------------
    def load(self, p: int) -> None:
        def meta(name: str, default: int) -> int:
            raw = self.state.peek(b"M" + name.encode() + _P.pack(p))
            return _I64.unpack(raw)[0] if raw else default

        self.wf[p] = meta("wf", NO_WATERMARK)
        self.wa[p] = meta("wa", NO_WATERMARK)
        self.waiting[p] = meta("waiting", 0)
        self.pending[p] = meta("pending", 0)

    def save(self, p: int) -> None:
        for name, d in (("wf", self.wf), ("wa", self.wa), ("waiting", self.waiting), ("pending", self.pending)):
            self.state.put(b"M" + name.encode() + _P.pack(p), _I64.pack(d[p]))

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

    def _emit(self, user_id: int, base: bytes, mask: int, rate: float, ref_ts: int, extra: bytes = b"") -> None:
        self.out.append((str(user_id).encode(), base + self.tails.tail(mask, rate) + extra, ref_ts))

    def _correction(self, eid: bytes, user_id: int, base: bytes, li: int, ref_ts: int) -> None:
        label = self.labels[li]
        cid = f"{eid.decode()}#late-{label}"
        self._emit(user_id, base, 1 << li, 1.0, ref_ts, wire.example_id_field(cid))
        self.counts["corrections"] += 1

    # -- events ---------------------------------------------------------------------------------
    def on_features(self, p: int, fl: FeatureLog, ts_ms: int = 0) -> None:
        state, cfg = self.state, self.cfg
        wf_before = self.wf[p]
        t_i = fl.event_time_ms
        rid = fl.request_id
        user_id = fl.user_id
        model_id = fl.model_version.model_id
        rate = float(cfg.slice_sample_rates.get(model_id, cfg.negative_sample_rate))
        ctx = wire.features_field(fl.context.SerializeToString())
        closes_at = t_i + self.W + self.L
        for c in fl.candidates:
            self.counts["impressions"] += 1
            eid_s = f"{rid}/{c.item_id}"
            eid = eid_s.encode()
            ikey = b"I" + eid
            if state.get(ikey) is not None:
                self.counts["duplicate_impressions"] += 1
                continue
            base = wire.base_example(eid_s, rid, c.item_id, user_id, t_i, model_id, ctx,
                                     c.features.SerializeToString())
            mask = corrected = 0
            st = WAITING
            akey = b"A" + eid
            pend = state.get(akey)
            if pend is not None:
                state.delete(akey)
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
                            self._correction(eid, user_id, base, li, ts_ms)
                if mask and self.immediate:
                    self._emit(user_id, base, mask, 1.0, ts_ms)
                    self.counts["positives"] += 1
                    st = POSITIVE
            record = HEADER.pack(t_i, user_id, wf_before, rate, st, mask, corrected) + base
            self.waiting[p] += 1
            if self.wa[p] > closes_at:
                # The action stream is already past this impression's window: close it now.
                self._close(p, eid, record, None)
            else:
                state.put(ikey, record, cache=True)
                state.put_index(index_key(b"T", p, closes_at, b"c", eid))
        if t_i > wf_before:
            self.wf[p] = t_i

    def on_action(self, p: int, a: Action, ts_ms: int = 0) -> None:
        state = self.state
        self.counts["actions"] += 1
        wa_before = self.wa[p]
        if a.event_time_ms > wa_before:
            self.wa[p] = a.event_time_ms
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
                self._correction(eid, user_id, record[HEADER.size:], li, ts_ms)
                state.put(ikey, HEADER.pack(t_i, user_id, wf_before_i, rate, st, mask, corrected)
                          + record[HEADER.size:])
            return
        if mask >> li & 1:
            self.counts["duplicate_actions"] += 1
            return
        self.counts["joins"] += 1
        mask |= 1 << li
        if self.immediate:
            if st == WAITING:
                st = POSITIVE
                self._emit(user_id, record[HEADER.size:], mask, 1.0, ts_ms)
                self.counts["positives"] += 1
            else:
                self.counts["extra_labels"] += 1  # a second action type after the positive went out
        state.put(ikey, HEADER.pack(t_i, user_id, wf_before_i, rate, st, mask, corrected)
                  + record[HEADER.size:], cache=True)

    def _add_pending(self, p: int, eid: bytes, a_time: int, wa_before: int, li: int, ts_ms: int) -> None:
        akey = b"A" + eid
        pend = self.state.get(akey) or b""
        for off in range(0, len(pend), PENDING.size):
            t, _, l, _ = PENDING.unpack_from(pend, off)
            if t == a_time and l == li:
                self.counts["duplicate_actions"] += 1
                return
        self.state.put(akey, pend + PENDING.pack(a_time, wa_before, li, ts_ms))
        self.state.put_index(index_key(b"O", p, a_time + self.G, b"", eid))
        self.pending[p] += 1
        self.counts["pending_actions"] += 1

    def _count_rejected(self, verdict: str) -> None:
        if verdict == ORPHAN:
            self.counts["orphan_actions"] += 1
        elif verdict in (LATE, EXPIRED, OUT_OF_WINDOW):
            self.counts["late_actions"] += 1
            self.counts[f"late_{verdict}"] += 1

    # -- watermark-driven work ------------------------------------------------------------------
    def _close(self, p: int, eid: bytes, record: bytes, index: bytes | None) -> None:
        t_i, user_id, wf_before_i, rate, st, mask, corrected = HEADER.unpack_from(record, 0)
        base = record[HEADER.size:]
        if st == WAITING:
            if mask:
                self._emit(user_id, base, mask, 1.0, 0)
                self.counts["positives"] += 1
            elif sampling.keep(eid, rate, self.cfg.seed):
                self._emit(user_id, base, 0, rate, 0)
                self.counts["negatives"] += 1
            else:
                self.counts["negatives_sampled_out"] += 1
        self.waiting[p] -= 1
        # Keep a tombstone (with the features only if corrections may need them) until expiry.
        keep_base = base if self.correction else b""
        self.state.put(b"I" + eid, HEADER.pack(t_i, user_id, wf_before_i, rate, CLOSED, mask, corrected) + keep_base)
        self.state.put_index(index_key(b"T", p, t_i + self.W + self.L + self.R, b"x", eid))
        if index is not None:
            self.state.delete_index(index)

    def advance(self, p: int, *, drain: bool = False) -> None:
        """Close the windows and forget the tombstones and orphans the watermarks have passed.

        With ``drain`` every waiting window is closed (end of input), without moving the watermark.
        """
        state = self.state
        pfx = b"T" + _P.pack(p)
        hi = pfx + (b"\xff" * 9 if drain else _t(self.wa[p]))
        for key in state.scan_keys(pfx, hi):
            tag = key[11:12]
            eid = key[12:]
            if tag == b"x":
                if drain:
                    continue
                state.delete(b"I" + eid)
                state.delete_index(key)
                continue
            record = state.get(b"I" + eid)
            if record is None or record[HEADER.size - 5] == CLOSED:
                state.delete_index(key)
                continue
            self._close(p, eid, record, key)
        # Orphans: actions whose features the features stream has passed without delivering.
        pfx = b"O" + _P.pack(p)
        wf = self.wf[p]
        for key in state.scan_keys(pfx, pfx + _t(wf)):
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

    def take(self) -> list[tuple[bytes, bytes, int]]:
        out, self.out = self.out, []
        return out
