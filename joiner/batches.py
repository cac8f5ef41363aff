"""What the joiner stores per waiting impression, and the columnar batches it emits from it.

Stored payload (after :data:`joiner.core.HEADER`): a ``struct`` frame of two lengths, then the
model id (UTF-8), the request's context ``Features`` and the candidate's ``Features``, both as
serialized by the protobuf library. Nothing is encoded by hand: at emission both are parsed by
the library into one ``Features`` (``MergeFromString`` twice: the candidate's slots and dense
values override the context's of the same name, protobuf's merge rule).

An emitted example is an :data:`Emitted` tuple ``(user_id, event_time_ms, example_id bytes,
payload, label mask, sample_rate, latency reference ts ms or 0, correction suffix or "")``.
:func:`build` turns a list of them into :class:`services.example_batch.ExampleColumns` in one
pass (one ``Features`` parse per example; ids, times, labels and rates as numpy arrays), and
:func:`valid_rows` checks, vectorized, what :func:`services.example_batch.decode` would reject, so a bad example is filtered (counted) instead of failing its whole batch.

>>> import numpy as np
>>> from proto import Features, SparseSlot
>>> ctx = Features(sparse={"u": SparseSlot(ids=[1])}, dense={"a": 1.0, "b": 2.0}).SerializeToString()
>>> cand = Features(sparse={"i": SparseSlot(ids=[7, 8])}, dense={"b": 3.0}).SerializeToString()
>>> p = payload("m", ctx, cand)
>>> c, nan_input = build([(9, 1000, b"r/7", p, 1, 1.0, 0, ""), (9, 1000, b"r/7", p, 1, 1.0, 0, "#late-click")],
...           ["click", "like"])
>>> list(c.example_ids), list(c.request_ids), c.item_id.tolist(), c.labels["like"].tolist()
(['r/7', 'r/7#late-click'], ['r', 'r'], [7, 7], [0.0, 0.0])
>>> c.sparse["i"][0].tolist(), c.sparse["i"][1].tolist(), c.dense["b"].tolist()
([7, 8, 7, 8], [0, 2, 4], [3.0, 3.0])
>>> c.dense["b"][1] = np.inf; valid_rows(c, nan_input)
(array([ True, False]), Counter({'non_finite': 1}))
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Sequence
from itertools import chain

import numpy as np

from proto import Features
from services import example_batch
from services.example_batch import ExampleColumns

# (user_id, event_time_ms, example id, payload, label mask, sample_rate, latency ref ts, id suffix)
Emitted = tuple[int, int, bytes, bytes, int, float, int, str]

_LENS = struct.Struct("<HI")  # len(model_id), len(context Features bytes)


def payload(model_id: str, context: bytes, candidate: bytes) -> bytes:
    """The stored part of an impression: model id, context and candidate ``Features`` bytes."""
    m = model_id.encode()
    return _LENS.pack(len(m), len(context)) + m + context + candidate


class ParsedFeatures:
    """Parsed ``Features`` by their serialized bytes (a bounded memo: contexts repeat across a
    request's candidates, candidate features across requests). A value is ``(sparse, dense,
    names, has_nan)``: ``{slot: ids}`` of the non-empty slots, ``{name: value}``, both kinds'
    names (to spot a candidate that overrides a context name) and whether a dense value is NaN;
    a payload's head (model id + context) has the model id as a fifth item. ``sparse_in[1]`` and
    ``dense_in[1]`` hold the names seen in contexts, ``[2]`` in candidates, and ``nan_seen``
    whether a NaN was: :func:`build` reads only where a name can be."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self.memo: dict[bytes, tuple] = {}
        self.heads: dict[bytes, tuple] = {}
        self.trim(force=True)

    def trim(self, force: bool = False) -> None:
        """Forget everything once a memo is full (between builds only: a build needs the names
        of what it parsed)."""
        if force or len(self.memo) >= self.max_entries or len(self.heads) >= self.max_entries:
            self.memo.clear()
            self.heads.clear()
            self.sparse_in: tuple[set[str], set[str], set[str]] = (set(), set(), set())
            self.dense_in: tuple[set[str], set[str], set[str]] = (set(), set(), set())
            self.nan_seen = False

    def features(self, raw: bytes) -> tuple:
        v = self.memo[raw] = self.parse(2, raw)
        return v

    def head(self, raw: bytes) -> tuple:
        """``raw``: a payload's head (lengths, model id and context bytes)."""
        a = _LENS.size + _LENS.unpack_from(raw)[0]
        v = self.heads[raw] = self.parse(1, raw[a:]) + (raw[_LENS.size:a].decode(),)
        return v

    def parse(self, where: int, *parts: bytes) -> tuple:
        """Parse by the protobuf library; several parts merge in order (later names win)."""
        f = Features()
        for raw in parts:
            f.MergeFromString(raw)
        sp = f.sparse
        keys = list(sp)  # (keys then [name]: faster than items() on upb maps)
        sparse = {name: ids[:] for name in keys if (ids := sp[name].ids)}  # (lists of int)
        dn = f.dense
        dense = {name: dn[name] for name in dn}
        for names, seen in ((sparse, self.sparse_in), (dense, self.dense_in)):
            if not seen[where].issuperset(names):
                seen[where].update(names)
        total = sum(dense.values())  # NaN iff a value is NaN (or both infinities: invalid too)
        if total != total:
            self.nan_seen = True
        return sparse, dense, frozenset(keys).union(dense), total != total


def _where(seen: tuple[set[str], set[str], set[str]]) -> list[tuple[str, int]]:
    """``(name, 1 | 2 | 3)``: seen in contexts, candidates or both; by name."""
    return [(name, (name in seen[1]) | (name in seen[2]) << 1) for name in sorted(seen[1] | seen[2])]


_NONE: tuple = ({}, {}, frozenset(), False)


def build(emitted: Sequence[Emitted], labels: Sequence[str],
          parsed: ParsedFeatures | None = None) -> tuple[ExampleColumns, np.ndarray]:
    """The columns of ``emitted`` (in order), and which rows had a NaN dense input value (NaN
    reads as "absent" in a batch, so those rows are invalid: see :func:`valid_rows`). Labels:
    1.0/0.0 per bit of the mask, every label present; a slot with an empty bag is left out (the
    batch format's "absent"). ``parsed``: a memo kept across calls (a fresh one by default)."""
    n = len(emitted)
    parsed = parsed or ParsedFeatures()
    parsed.trim()
    memo, heads, features, head = parsed.memo, parsed.heads, parsed.features, parsed.head
    rows = []
    unpack = _LENS.unpack_from
    for _, _, eid, pl, _, _, _, suffix in emitted:
        ml, cl = unpack(pl)
        b = 6 + ml + cl  # (_LENS.size == 6)
        hk, kk = pl[:b], pl[b:]
        ctx = heads.get(hk) or head(hk)
        cand = memo.get(kk) or features(kk)
        if ctx[2] & cand[2]:  # the candidate overrides a context slot or value: merge them
            cand = parsed.parse(2, pl[6 + ml:b], kk)
            ctx = _NONE + (ctx[4],)
        rows.append((eid, suffix, ctx, cand))
    plain = [r[0].decode() for r in rows]
    eids = [s + r[1] if r[1] else s for s, r in zip(plain, rows)]
    split = [s.rpartition("/") for s in plain]
    rids = [t[0] for t in split]
    items = np.fromiter((int(t[2]) for t in split), np.int64, n)
    models = [r[2][4] for r in rows]
    ctxs = [r[2] for r in rows]
    cands = [r[3] for r in rows]
    nan_input = (np.fromiter((c[3] or k[3] for c, k in zip(ctxs, cands)), bool, n) if parsed.nan_seen
                 else np.zeros(n, bool))
    sparse = {}
    for name, where in _where(parsed.sparse_in):  # (a name no row has gives no column)
        if where == 1:
            bags = [c[0].get(name, ()) for c in ctxs]
        elif where == 2:
            bags = [k[0].get(name, ()) for k in cands]
        else:
            bags = [k[0].get(name) or c[0].get(name, ()) for c, k in zip(ctxs, cands)]
        offs = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, bags), np.int64, n), out=offs[1:])
        if offs[-1]:
            sparse[name] = np.fromiter(chain.from_iterable(bags), np.int64, int(offs[-1])), offs
    nan = math.nan
    dense = {}
    for name, where in _where(parsed.dense_in):
        if where == 1:
            v = np.array([c[1].get(name, nan) for c in ctxs], np.float32)
        elif where == 2:
            v = np.array([k[1].get(name, nan) for k in cands], np.float32)
        else:
            v = np.array([k[1].get(name, c[1].get(name, nan)) for c, k in zip(ctxs, cands)], np.float32)
        if not np.isnan(v).all():  # (all absent; or NaN inputs, whose rows are invalid anyway)
            dense[name] = v
    col = lambda k, dt: np.fromiter((e[k] for e in emitted), dt, n)  # noqa: E731
    masks = col(4, np.int64)
    return ExampleColumns(
        eids, rids, items, col(0, np.int64), col(1, np.int64), col(5, np.float32), models,
        labels={name: ((masks >> i) & 1).astype(np.float32) for i, name in enumerate(labels)},
        sparse=sparse, dense=dense), nan_input


def valid_rows(c: ExampleColumns, nan_input: np.ndarray) -> tuple[np.ndarray, Counter[str]]:
    """``(ok, reasons)``: which rows :func:`services.example_batch.decode` would accept (its
    :func:`~services.example_batch.invalid_rows` rules; and no NaN input value, in ``nan_input``,
    which would read as "absent" in the batch, so it counts as ``non_finite``), and how many rows
    fail each rule (a row is counted under its first failed rule)."""
    checks = example_batch.invalid_rows(c)
    checks["non_finite"] = checks["non_finite"] | nan_input
    ok = np.ones(c.size, bool)
    reasons: Counter[str] = Counter()
    for reason, bad in checks.items():
        bad = bad & ok
        if bad.any():
            reasons[reason] = int(bad.sum())
            ok &= ~bad
    return ok, reasons
