"""The online trainer's ingest: from polled ``examples`` records to a training batch (:class:`Ingest`).

Records: one record on ``examples`` is one example batch (:mod:`services.example_batch`: an Arrow
IPC record batch of many examples, ~1000 from the producers' chunks, with an ``id_hash`` column).
A training batch is whole records (a record's offset is committed once all of it is applied):
those polled until they hold ``batch_size`` examples (with records of 1000 and ``batch_size`` 1024:
two records, 2000 examples), or ``batch_timeout_s`` passed.

Each record is decoded (``example_batch.decode``: schema and values validated) -> the trainer's
checks per example, vectorized (:func:`refusals`) -> dedup by the shipped ``id_hash``
(:mod:`trainer.dedup`, bounded window) -> the batch assembled
(``example_batch.to_sparse_batch_arrays``: the model's slots, label and dense features only).
Decoding builds no protobuf objects and no per-example Python: pyarrow hands numpy views of the
record's buffers.

Bad records never stop the trainer: a record ``example_batch.decode`` refuses is dead-lettered
whole with its original bytes and reason (``undecodable``/``invalid``); a record whose decoding
*raises* something else (a bug) whole as ``failed``. An example that decodes can still be one the
trainer must not learn; :func:`refusals` finds those, per example, and each is dropped and
dead-lettered as a batch of the refused examples of its record and kind (:func:`take`), while the
rest of its record is learned (an example the training step fails on is dead-lettered by the
trainer, see :mod:`trainer.isolate`). Each is counted (``driftline_dead_letters_total`` per letter,
``driftline_trainer_bad_examples_total`` per example) and its record's offset is committed past
like any other, so a restart never meets it again. The refusals:

* ``unknown_slot``: a non-empty bag in a ``sparse.<slot>`` column the model does not know;
* ``bad_label``: the model's label missing (no column, or NaN) or outside [0, 1] (not a log-loss
  target: 1e38 made the loss -1e35);
* ``wrong_dim``: one of the model's dense features missing (NaN), or a value for a dense feature
  the model does not have;
* ``event_time``: further ahead of the wall clock than ``event_time.max_future_s`` (it would move
  the trainer's event-time clock for good: snapshots are due by event time, TTL tables expire
  rows against it).

>>> import numpy as np
>>> from services.example_batch import ExampleColumns
>>> c = ExampleColumns(["a", "b", "c"], ["r"] * 3, np.arange(3), np.zeros(3), np.array([1, 2, 10**15]),
...                    np.ones(3, np.float32), ["m"] * 3, labels={"click": np.array([1, np.nan, 0], np.float32)},
...                    sparse={"odd": (np.array([5]), np.array([0, 0, 0, 1]))})
>>> codes = refusals(c, {"genre"}, "click", [], now_ms=1000, max_future_ms=0)
>>> [KINDS[k] if k else None for k in codes]
[None, 'bad_label', 'unknown_slot']
>>> take(c, np.array([2])).example_ids, take(c, np.array([2])).sparse["odd"][1].tolist()
(['c'], [0, 1])
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from types import SimpleNamespace

import numpy as np
from aiokafka import TopicPartition

from services import example_batch
from services.codecs import MalformedMessage, event_time_error, processing_failed
from services.example_batch import BadExampleBatch, ExampleColumns, take

from . import metrics as M
from .batch import SparseBatch
from .config import ModelConfig
from .dedup import DedupWindow, duplicates
from .isolate import out_of_memory

__all__ = ["KINDS", "Decoded", "Ingest", "Prepared", "detail", "positions", "refusals", "take"]

#: refusal codes (0: learnable), in the order they are checked (an example gets the first that applies)
KINDS = (None, "unknown_slot", "bad_label", "wrong_dim", "event_time")


def refusals(c: ExampleColumns, known_slots: set[str], label: str, dense_features: list[str], *,
             now_ms: int, max_future_ms: int) -> np.ndarray:
    """int8 ``[n]``: 0 for a learnable example, else its index in :data:`KINDS`."""
    n = c.size
    bad = [np.zeros(n, np.bool_) for _ in KINDS]
    for s, (_, offs) in c.sparse.items():
        if s not in known_slots:
            bad[1] |= np.diff(offs) > 0
    lab = c.labels.get(label)
    bad[2] = np.ones(n, np.bool_) if lab is None else ~((lab >= 0) & (lab <= 1))  # NaN fails too
    for d, v in c.dense.items():
        if d not in dense_features:
            bad[3] |= ~np.isnan(v)
    for d in dense_features:
        v = c.dense.get(d)
        bad[3] |= True if v is None else np.isnan(v)
    bad[4] = c.event_time_ms > now_ms + max_future_ms
    codes = np.zeros(n, np.int8)
    for k in range(len(KINDS) - 1, 0, -1):  # the first kind that applies wins
        codes[bad[k]] = k
    return codes


def detail(c: ExampleColumns, row: int, kind: str, known_slots: set[str], label: str, dense_features: list[str], *,
           now_ms: int, max_future_ms: int) -> str:
    """Why example ``row`` got refusal ``kind`` (for the dead letter)."""
    if kind == "unknown_slot":
        return str(sorted(s for s, (_, o) in c.sparse.items() if s not in known_slots and o[row + 1] > o[row]))
    if kind == "bad_label":
        v = c.labels.get(label)
        return f"{label!r} missing" if v is None or np.isnan(v[row]) else f"{label!r} = {float(v[row])!r} is outside [0, 1]"
    if kind == "wrong_dim":
        present = sorted(d for d, v in c.dense.items() if not np.isnan(v[row]))
        return f"dense features {present} != {list(dense_features)}"
    return event_time_error(int(c.event_time_ms[row]), now_ms, float("inf"), max_future_ms / 1000) or kind


# ---------------------------------------------------------------------------- records -> batches
NO_HASHES = np.zeros((0, 2), np.uint64)
_RAW, _PART, _OFF, _STAMP = (attrgetter(a) for a in ("raw", "partition", "offset", "timestamp_ms"))


def positions(recs) -> tuple[dict[int, int], np.ndarray]:
    """``({partition: next offset}, int64 Kafka timestamps with -1 where none)`` of a poll's records.

    The event loop fetches and decodes the next batch while the current one trains, and whatever
    Python it runs per record delays both (GIL, the other core): C-level ``map``s instead of a
    Python loop over the ~1000 records."""
    n = len(recs)
    parts = np.fromiter(map(_PART, recs), np.int64, n)
    offs = np.fromiter(map(_OFF, recs), np.int64, n)
    try:
        stamps = np.fromiter(map(_STAMP, recs), np.int64, n)
    except TypeError:  # a record without a timestamp (None)
        stamps = np.array([-1 if t is None else t for t in map(_STAMP, recs)], np.int64)
    if n and (parts == parts[0]).all():
        return {int(parts[0]): int(offs.max()) + 1}, stamps
    return {int(p): int(offs[parts == p].max()) + 1 for p in np.unique(parts)}, stamps


@dataclass
class Decoded:
    """Records decoded so far for the next batch: their non-empty example batches with the record
    each came from, and the dead letters of the records refused (sent, awaited before a commit)."""

    parts: list = field(default_factory=list)
    records: list = field(default_factory=list)
    letters: list = field(default_factory=list)
    examples: int = 0


@dataclass
class Prepared:
    """One polled batch after validation and dedup: what to train on and what to commit."""

    batch: SparseBatch | None
    offsets: dict[int, int]  # partition -> next offset (records of this poll)
    hashes: np.ndarray  # uint64 [n, 2] example id hashes, entered into the dedup window once applied
    arrival_ms: np.ndarray | None = None  # int64 [batch.size]: when each example reached the topic
    #: batch row -> (its record, the bytes of a batch of that one example): a dead letter's
    letter_of: Callable[[int], tuple[object, bytes]] | None = None


class Ingest:
    """Turns one model's polled ``topic`` records into training batches: decode, check, dead-letter
    (through :attr:`consumer`'s dead-letter path, set once the trainer started it), dedup against
    ``window`` (the applied examples' ids: the trainer adds a batch's once it is applied) and
    assemble. ``stage(name, seconds)`` accounts the time."""

    def __init__(self, cfg: ModelConfig, topic: str, window: DedupWindow, *, max_future_ms: int,
                 stage: Callable[[str, float], None]):
        self.cfg, self.topic, self.window, self._stage = cfg, topic, window, stage
        self.known_slots = set(cfg.all_slots)
        #: examples further ahead of the wall clock are refused (one would move the trainer's
        #: event-time clock: snapshots due by event time, the PS's TTL watermark)
        self.max_future_ms = max_future_ms
        self.consumer = None
        #: record bytes -> :class:`services.example_batch.ExampleColumns` (raises BadExampleBatch)
        self.decode = example_batch.decode
        self.bad = 0  # examples dead-lettered
        self.duplicates = 0
        self.highwater: dict[int, int] = {}  # partition -> last known high watermark

    async def dead_letter(self, rec, raw: bytes, err: MalformedMessage, examples: int = 1):
        """Dead-letter ``raw`` (a record's bytes, or a batch of some of its examples) as if it were
        record ``rec``'s value; ``examples``: how many examples it refuses (counted)."""
        self.bad += examples
        M.BAD_EXAMPLES.labels(self.cfg.model_id, err.kind).inc(examples)
        original = SimpleNamespace(topic=rec.topic, partition=rec.partition, offset=rec.offset, key=rec.key,
                                   value=raw)
        return await self.consumer.dead_letter(original, err)

    async def decode_records(self, recs, out: Decoded) -> None:
        """Decode records into ``out``; a record that does not decode is dead-lettered whole with its
        reason (``undecodable``/``invalid``, or ``failed`` when decoding raised something else: a
        bug must not stop the trainer). Out of memory is the record's only when others decoded
        (:func:`trainer.isolate.out_of_memory`, the step's rule): when every record of the poll
        ran out of memory, the process is starved and the error is raised (nothing committed: the
        restart reads them again)."""
        starved: list[tuple[object, bytes, BaseException]] = []
        for rec, raw in zip(recs, map(_RAW, recs)):
            try:
                c = self.decode(raw)
            except BadExampleBatch as err:
                out.letters.append(await self.dead_letter(rec, raw, MalformedMessage(err.kind, err.detail)))
                continue
            except Exception as err:  # noqa: BLE001 - a record this path fails on must not stop the trainer
                if out_of_memory(err):
                    starved.append((rec, raw, err))
                else:
                    out.letters.append(await self.dead_letter(rec, raw, processing_failed(err)))
                continue
            if c.size:
                out.parts.append(c)
                out.records.append(rec)
                out.examples += c.size
        if starved and len(starved) == len(recs):
            raise starved[0][2]
        for rec, raw, err in starved:
            out.letters.append(await self.dead_letter(rec, raw, processing_failed(err)))

    async def prepare(self, recs, polled_at_ms: int | None = None, decoded: Decoded | None = None,
                      inflight: Sequence[np.ndarray] = ()) -> Prepared:
        """One batch of ``recs``: decoded (unless ``decoded`` holds their decoded batches already),
        checked (:meth:`_check`), deduplicated against the window, ``inflight`` (the id hashes of
        the batches in flight) and itself, and assembled (:meth:`_assemble`). An example *arrives*
        at its record's Kafka timestamp (when the joiner produced it), or at ``polled_at_ms`` (the
        trainer's poll) when the record has none; never later than the poll. Its dead letters are
        durable when it returns (before its offsets can be committed)."""
        t0 = time.perf_counter()
        if decoded is None:
            decoded = Decoded()
            await self.decode_records(recs, decoded)
        offsets, stamps = positions(recs)
        for part in offsets:
            hw = self.consumer.consumer.highwater(TopicPartition(self.topic, part))
            if hw is not None:
                self.highwater[part] = hw
        inflight = np.concatenate(inflight) if len(inflight) > 1 else inflight[0] if inflight else NO_HASHES
        now_ms = int(time.time() * 1000)
        keep = await self._check(decoded, now_ms)
        polled = now_ms if polled_at_ms is None else polled_at_ms
        batch, hashes, arrival, letter_of = self._assemble(decoded, keep, inflight, polled)
        self._stage("prepare", time.perf_counter() - t0)
        if decoded.letters:  # dead letters durable before their offsets can be committed
            await asyncio.gather(*decoded.letters)
        return Prepared(batch, offsets, hashes, arrival, letter_of)

    async def _check(self, decoded: Decoded, now_ms: int) -> list[np.ndarray]:
        """Per decoded batch, which examples to learn (:func:`refusals`); a refused example is
        dead-lettered as a batch of the refused examples of its record and kind, and counted; the
        rest of its record is learned."""
        cfg, keep = self.cfg, []
        for c, rec in zip(decoded.parts, decoded.records):
            codes = refusals(c, self.known_slots, cfg.label, cfg.dense_features, now_ms=now_ms,
                             max_future_ms=self.max_future_ms)
            keep.append(codes == 0)
            if keep[-1].all():
                continue
            for k in np.unique(codes[codes > 0]).tolist():
                rows = np.flatnonzero(codes == k)
                kind = KINDS[k]
                why = detail(c, int(rows[0]), kind, self.known_slots, cfg.label, cfg.dense_features,
                             now_ms=now_ms, max_future_ms=self.max_future_ms)
                if rows.size > 1:
                    why = f"{rows.size} of {c.size} examples, the first: {why}"
                decoded.letters.append(await self.dead_letter(rec, example_batch.encode(take(c, rows)),
                                                              MalformedMessage(kind, why), int(rows.size)))
        return keep

    def _assemble(self, decoded: Decoded, keep: list[np.ndarray], inflight: np.ndarray, polled_ms: int):
        """``(SparseBatch or None, its id hashes, its arrival times, letter_of)`` of the kept examples
        that are no duplicates (:func:`services.example_batch.to_sparse_batch_arrays`)."""
        parts, cfg = decoded.parts, self.cfg
        batch, hashes, rows = None, NO_HASHES, np.zeros(0, np.int64)
        if parts:
            arrays = example_batch.to_sparse_batch_arrays(parts, cfg.all_slots, cfg.label, cfg.dense_features)
            hashes = arrays.pop("meta")["id_hash"]
            rows = np.flatnonzero(np.concatenate(keep))
            dup = duplicates(self.window, inflight, hashes[rows])
            if dup.any():
                self.duplicates += int(dup.sum())
                M.DUPLICATES.labels(cfg.model_id).inc(int(dup.sum()))
                rows = rows[~dup]
            batch = SparseBatch(**arrays)
            if rows.size < batch.size:
                batch = batch.select(rows) if rows.size else None
            hashes = hashes[rows]
        if batch is None:
            return None, hashes, None, None
        sizes = np.array([c.size for c in parts], np.int64)
        part_of = np.repeat(np.arange(len(parts)), sizes)[rows]
        stamps = np.array([-1 if t is None else t for t in map(_STAMP, decoded.records)], np.int64)
        arrival = stamps[part_of]
        arrival = np.where((arrival > 0) & (arrival < polled_ms), arrival, polled_ms)
        starts = np.concatenate([[0], np.cumsum(sizes)])

        def letter_of(j: int) -> tuple[object, bytes]:  # batch row -> (its record, its example's batch bytes)
            q = int(part_of[j])
            return decoded.records[q], example_batch.encode(take(parts[q], rows[j:j + 1] - starts[q]))

        return batch, hashes, arrival, letter_of
