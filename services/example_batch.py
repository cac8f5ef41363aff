"""One Kafka record on ``examples`` = one columnar batch of examples (Arrow IPC stream).

(Over 450 lines: the format, its codec, its row rules and its conversions are one contract between
the joiner and the trainer, kept and tested together by ``tests/test_example_batch.py``.)

Decision (groundwork for issue 13): an Arrow IPC stream holding one RecordBatch, decoded by
pyarrow into numpy views. Measured by ``bench/bench_example_format.py`` (one batch of 2000 examples,
8 slots of 1-5 random 62-bit ids, 2 labels, 1 dense; best of 10 on 2 shared cores, so +-30%):

============================  ==========  ==========  ========  ========
format                        encode/s    decode/s    B/ex raw  B/ex lz4
============================  ==========  ==========  ========  ========
protobuf Example per record   0.44 M      0.37 M      411       282
Arrow IPC, list<int64>        1.04 M      3.65 M      331       275
Arrow IPC, large_list<int64>  1.06 M      3.65 M      363       277
protobuf ExampleBatch bytes   0.87 M      6.0 M       329       275
============================  ==========  ==========  ========  ========

Decode is bytes -> ``SparseBatch`` arrays + id hashes (today's row: the numba ``trainer.wire``
parser); lz4 is aiokafka's codec over what one Kafka batch compresses (per-example records
concatenated; their per-record Kafka overhead is not counted). Random feature ids do not compress,
so lz4 only evens out varints vs fixed 8 bytes. Encode of both columnar formats is mostly the
stdlib BLAKE2b-128 id hash (~0.5 us/example). Arrow is chosen over the packed protobuf although
that decodes ~1.6x faster (~0.3 vs ~0.5 ms per 2000-example record, both ~10x today's parser): the
schema travels with the data (names, types, nullability), and a library validates it
(``validate(full=True)``: offsets in bounds and monotonic, UTF-8), whereas packed byte columns
need a hand-written layout convention (byte order, offset widths, which lengths agree) and
hand-written checks in every reader. ``list<int64>`` (int32 offsets) is written, 10% smaller than
``large_list``; the decoder accepts both.

Layout: fixed columns :data:`FIXED_SCHEMA` first, then by naming rule ``label.<name>`` float32,
``sparse.<slot>`` list<int64> (non-null ids), ``dense.<name>`` float32. NaN in a label or dense
column means "absent" (what ``SparseBatch.from_examples`` reads for a missing key); +-inf is
invalid. ``id_hash`` is BLAKE2b-128 of the UTF-8 example id (stdlib; the trainer's numba
MurmurHash3 is ~0.2 us/example but lives in ``trainer`` and services must not import it); the
decoder trusts it (re-hashing would cost more than the whole decode).

>>> import numpy as np
>>> c = ExampleColumns(["r1/5", "r1/6"], ["r1", "r1"], np.array([5, 6]), np.array([9, 9]),
...                    np.array([1000, 1001]), np.array([1.0, 0.5], np.float32), ["m", "m"],
...                    labels={"click": np.array([1, 0], np.float32)},
...                    sparse={"genre": (np.array([7, 8, 9]), np.array([0, 2, 3]))})
>>> d = decode(encode(c))
>>> d.size, list(d.example_ids), d.sparse["genre"][1].tolist(), d.labels["click"].tolist()
(2, ['r1/5', 'r1/6'], [0, 2, 3], [1.0, 0.0])
>>> a = to_sparse_batch_arrays([d, d], slots=["genre", "age"], label="click")
>>> a["size"], a["ids"]["genre"].tolist(), a["offsets"]["genre"].tolist(), a["offsets"]["age"].tolist()
(4, [7, 8, 9, 7, 8, 9], [0, 2, 3, 5, 6], [0, 0, 0, 0, 0])
>>> decode(b"garbage")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
services.example_batch.BadExampleBatch: undecodable: ArrowInvalid: Expected to read ... metadata bytes, ...
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from proto import Example

__all__ = ["BadExampleBatch", "ExampleColumns", "FIXED_SCHEMA", "decode", "encode", "from_examples",
           "ROW_RULES", "hash_ids", "invalid_rows", "slice_codes", "take", "take_lists", "to_examples",
           "to_sparse_batch_arrays"]

FORMAT = b"driftline.ExampleBatch/1"
FIXED_SCHEMA = pa.schema([
    pa.field("example_id", pa.string(), nullable=False),
    pa.field("id_hash", pa.binary(16), nullable=False),
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("item_id", pa.int64(), nullable=False),
    pa.field("user_id", pa.int64(), nullable=False),
    pa.field("event_time_ms", pa.int64(), nullable=False),
    pa.field("sample_rate", pa.float32(), nullable=False),
    pa.field("model_id", pa.dictionary(pa.int32(), pa.string()), nullable=False),
], metadata={b"format": FORMAT})
_NAMED = {"label.": pa.float32(), "sparse.": None, "dense.": pa.float32()}


class BadExampleBatch(ValueError):
    """Bytes that are not a usable ExampleBatch; ``kind`` is ``undecodable`` or ``invalid``
    (like :class:`services.codecs.MalformedMessage`)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass
class ExampleColumns:
    """A batch of examples, column by column. ``sparse[slot] = (ids int64, offsets int64 [n + 1])``;
    ``id_hash`` uint64 ``[n, 2]`` (computed by :func:`encode` when None)."""

    example_ids: Sequence[str]
    request_ids: Sequence[str]
    item_id: np.ndarray
    user_id: np.ndarray
    event_time_ms: np.ndarray
    sample_rate: np.ndarray
    model_ids: Sequence[str]
    labels: dict[str, np.ndarray] = field(default_factory=dict)
    sparse: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    id_hash: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.example_ids)


class _Strings(Sequence[str]):
    """An Arrow string column as a lazy ``Sequence[str]`` (converted on first element access)."""

    def __init__(self, arr: pa.Array) -> None:
        self.arrow = arr
        self._list: list[str] | None = None

    def __len__(self) -> int:
        return len(self.arrow)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if self._list is None:
            self._list = self.arrow.to_pylist()
        return self._list[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def hash_ids(ids: Sequence[str]) -> np.ndarray:
    """BLAKE2b-128 of each UTF-8 id as ``uint64 [n, 2]`` (little-endian halves).

    >>> h = hash_ids(["a", "a", "b"])
    >>> h.shape, h.dtype.name, (h[0] == h[1]).all(), (h[0] == h[2]).any()
    ((3, 2), 'uint64', np.True_, np.False_)
    """
    b2 = hashlib.blake2b
    raw = b"".join([b2(s.encode(), digest_size=16).digest() for s in ids])
    return np.frombuffer(raw, "<u8").reshape(-1, 2).astype(np.uint64, copy=False)


def encode(c: ExampleColumns, *, large_lists: bool = False) -> bytes:
    """The Arrow IPC stream bytes of one record batch (no compression: Kafka's lz4 does that)."""
    n = c.size
    h = hash_ids(c.example_ids) if c.id_hash is None else np.ascontiguousarray(c.id_hash, "<u8")
    if h.shape != (n, 2):
        raise ValueError(f"id_hash shape {h.shape} != ({n}, 2)")
    cols = [pa.array(c.example_ids, pa.string()),
            pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), n, [None, pa.py_buffer(h.tobytes())]),
            pa.array(c.request_ids, pa.string()),
            pa.array(np.asarray(c.item_id, np.int64)), pa.array(np.asarray(c.user_id, np.int64)),
            pa.array(np.asarray(c.event_time_ms, np.int64)), pa.array(np.asarray(c.sample_rate, np.float32)),
            pa.array(c.model_ids, pa.string()).dictionary_encode()]
    fields = list(FIXED_SCHEMA)
    list_type, off_type = (pa.large_list, np.int64) if large_lists else (pa.list_, np.int32)
    for name, v in sorted(c.labels.items()):
        fields.append(pa.field("label." + name, pa.float32(), nullable=False))
        cols.append(pa.array(np.asarray(v, np.float32)))
    for name, (ids, offs) in sorted(c.sparse.items()):
        offs = np.asarray(offs, np.int64) if len(offs) else np.zeros(1, np.int64)
        ids = np.asarray(ids, np.int64)[offs[0]:offs[-1]]
        if offs.size != n + 1 or (not large_lists and offs[-1] - offs[0] >= 2**31):
            raise ValueError(f"sparse {name}: {offs.size} offsets for {n} examples (or over 2^31 ids)")
        t = list_type(pa.field("id", pa.int64(), nullable=False))
        fields.append(pa.field("sparse." + name, t, nullable=False))
        cols.append(pa.Array.from_buffers(t, n, [None, pa.py_buffer((offs - offs[0]).astype(off_type).tobytes())],
                                          children=[pa.array(ids)]))
    for name, v in sorted(c.dense.items()):
        fields.append(pa.field("dense." + name, pa.float32(), nullable=False))
        cols.append(pa.array(np.asarray(v, np.float32)))
    try:
        batch = pa.RecordBatch.from_arrays(cols, schema=pa.schema(fields, metadata=FIXED_SCHEMA.metadata))
        batch.validate(full=True)
    except (pa.ArrowException, ValueError) as err:
        raise ValueError(f"columns do not make a batch: {err}") from err
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    out: bytes = sink.getvalue().to_pybytes()
    return out


def decode(raw: bytes) -> ExampleColumns:
    """:func:`encode`'s bytes -> columns (numpy views of ``raw`` where the layout allows); raises
    :class:`BadExampleBatch`, never another exception type."""
    try:
        return _decode(raw)
    except BadExampleBatch:
        raise
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, TypeError, ... on bad bytes
        raise BadExampleBatch("undecodable", f"{type(err).__name__}: {err}"[:300]) from err


def _invalid(detail: str) -> BadExampleBatch:
    return BadExampleBatch("invalid", detail)


def _np(arr: pa.Array) -> np.ndarray:
    out: np.ndarray = arr.to_numpy(zero_copy_only=True)
    return out


def _decode(raw: bytes) -> ExampleColumns:
    reader = pa.ipc.open_stream(pa.py_buffer(raw))
    batch = reader.read_next_batch()
    try:
        reader.read_next_batch()
        raise _invalid("more than one record batch")
    except StopIteration:
        pass
    schema = batch.schema
    if (schema.metadata or {}).get(b"format") != FORMAT:
        raise _invalid(f"format is {(schema.metadata or {}).get(b'format')!r}, not {FORMAT!r}")
    k = len(FIXED_SCHEMA)
    for want, got in zip(FIXED_SCHEMA, list(schema)[:k] + [None] * k):
        if got is None or want.name != got.name or want.type != got.type:
            raise _invalid(f"column {want.name} {want.type} expected, got {got}")
    batch.validate(full=True)  # offsets in bounds and monotonic, UTF-8, buffer sizes
    n = batch.num_rows
    c = batch.columns
    for f, col in zip(schema, c):
        if col.null_count or (pa.types.is_list(f.type) or pa.types.is_large_list(f.type)) and col.values.null_count:
            raise _invalid(f"column {f.name} has nulls")
    h = np.zeros((0, 2), np.uint64)
    if n:  # a view of the fixed_size_binary(16) data buffer (mind the array's offset)
        h = np.frombuffer(c[1].buffers()[1], "<u8", 2 * n, 16 * c[1].offset).reshape(n, 2)
    out = ExampleColumns(_Strings(c[0]), _Strings(c[2]), _np(c[3]), _np(c[4]), _np(c[5]), _np(c[6]),
                         _Strings(c[7].dictionary.take(c[7].indices)), id_hash=h.view(np.uint64))
    for f, col in zip(list(schema)[k:], c[k:]):
        prefix, _, name = f.name.partition(".")
        if prefix + "." not in _NAMED or not name:
            raise _invalid(f"column {f.name} follows no naming rule")
        if prefix == "sparse":
            if not ((pa.types.is_list(f.type) or pa.types.is_large_list(f.type)) and f.type.value_type == pa.int64()):
                raise _invalid(f"column {f.name} is {f.type}, not list<int64>")
            offs = _np(col.offsets).astype(np.int64)  # a sliced array's offsets need not start at 0
            offs = offs if offs.size else np.zeros(1, np.int64)  # a 0-row list may have no offsets
            out.sparse[name] = _np(col.values)[offs[0]:offs[-1]], offs - offs[0]
            continue
        if f.type != pa.float32():
            raise _invalid(f"column {f.name} is {f.type}, not float")
        (out.labels if prefix == "label" else out.dense)[name] = _np(col)
    for reason, bad in invalid_rows(out).items():
        if bad.any():
            raise _invalid(f"{int(bad.sum())} of {n} examples break a rule: {ROW_RULES[reason]}")
    return out


#: The rules every example of a batch keeps (:func:`invalid_rows`), by reason. Wire input: a batch
#: on the examples topic may come from any client, so its sample rates are checked here even though
#: the joiner's come from a validated setting (services.settings.SampleRate).
ROW_RULES = {
    "empty_example_id": "a non-empty example_id",
    "event_time": "event_time_ms > 0",
    "sample_rate": "sample_rate in (0, 1]",
    "non_finite": "no infinite label or dense value (NaN means absent)",
}


def invalid_rows(c: ExampleColumns) -> dict[str, np.ndarray]:
    """Which examples of a batch break each of :data:`ROW_RULES`: ``{reason: bool [n]}``, vectorized.
    :func:`decode` refuses a batch with any such example; the joiner leaves them out before
    :func:`encode` (``joiner.batches.valid_rows``).

    >>> c = ExampleColumns(["a", "", "c"], ["r"] * 3, np.arange(3), np.zeros(3), np.array([5, 5, 0]),
    ...                    np.array([1, 0.5, 2], np.float32), ["m"] * 3,
    ...                    dense={"d": np.array([np.nan, 1, np.inf], np.float32)})
    >>> {reason: bad.tolist() for reason, bad in invalid_rows(c).items()}  # doctest: +NORMALIZE_WHITESPACE
    {'empty_example_id': [False, True, False], 'event_time': [False, False, True],
     'sample_rate': [False, False, True], 'non_finite': [False, False, True]}
    >>> decode(encode(c))
    Traceback (most recent call last):
    ...
    services.example_batch.BadExampleBatch: invalid: 1 of 3 examples break a rule: a non-empty example_id
    """
    ids = c.example_ids
    if isinstance(ids, _Strings):
        empty = pc.equal(pc.binary_length(ids.arrow), 0).to_numpy(zero_copy_only=False)
    else:
        empty = np.fromiter(map(len, ids), np.int64, c.size) == 0
    non_finite = np.zeros(c.size, np.bool_)
    for v in (*c.labels.values(), *c.dense.values()):
        non_finite |= np.isinf(v)
    rate = c.sample_rate
    return {"empty_example_id": empty, "event_time": np.asarray(c.event_time_ms) <= 0,
            "sample_rate": ~((rate > 0) & (rate <= 1)),  # (NaN fails too)
            "non_finite": non_finite}


def to_sparse_batch_arrays(parts: Sequence[ExampleColumns], slots: Sequence[str], label: str,
                           dense_features: Sequence[str] = ()) -> dict[str, Any]:
    """Several decoded batches as the keyword arguments of ``trainer.batch.SparseBatch`` (a missing
    slot column = empty bags, a missing label or dense column = NaN); ``meta["id_hash"]`` holds the
    ids' hashes; ``slice_ids``/``slice_names`` each example's slice (:func:`slice_codes`: the
    trainer's sample-rate tracker groups by it). ``SparseBatch(**to_sparse_batch_arrays(...))``."""
    sizes = np.array([p.size for p in parts], np.int64)
    n = int(sizes.sum())

    def cat(xs: Sequence[np.ndarray], dt: type[np.generic]) -> np.ndarray:
        return np.concatenate(xs).astype(dt, copy=False) if xs else np.zeros(0, dt)

    def nan(p: ExampleColumns) -> np.ndarray:
        return np.full(p.size, math.nan, np.float32)

    ids, offsets = {}, {}
    for s in slots:
        got = [p.sparse.get(s) for p in parts]
        o = np.zeros(n + 1, np.int64)
        lens = [np.diff(g[1]) if g is not None else np.zeros(p.size, np.int64) for g, p in zip(got, parts)]
        np.cumsum(cat(lens, np.int64), out=o[1:])
        ids[s], offsets[s] = cat([g[0] for g in got if g is not None], np.int64), o
    dense = None
    if dense_features:
        dense = np.stack([cat([p.dense.get(d, nan(p)) for p in parts], np.float32) for d in dense_features], 1)
    slice_names, slice_ids = slice_codes([p.model_ids for p in parts])
    return dict(size=n, ids=ids, offsets=offsets,
                labels=cat([p.labels.get(label, nan(p)) for p in parts], np.float32),
                event_time_ms=cat([p.event_time_ms for p in parts], np.int64),
                sample_rate=cat([p.sample_rate for p in parts], np.float32), dense=dense,
                meta={"id_hash": cat([p.id_hash for p in parts if p.id_hash is not None], np.uint64).reshape(n, 2)},
                slice_ids=slice_ids, slice_names=slice_names)


def slice_codes(columns: Sequence[Sequence[str] | pa.Array]) -> tuple[tuple[str, ...], np.ndarray]:
    """The slices (``model_id``: the serving model an impression was served by) of several
    ``model_ids`` columns as ``(names, int32 index into names per example)``: the trainer groups
    examples by slice with integer codes (its sample-rate tracker), not per-example strings.
    Arrow's ``dictionary_encode`` does the per-example work; Python only sees the few names.

    >>> names, ids = slice_codes([["a", "b", "a"], ["b", "c"]])
    >>> names, ids.tolist()
    (('a', 'b', 'c'), [0, 1, 0, 1, 2])
    """
    names: dict[str, int] = {}
    codes = []
    for col in columns:
        arr = col.arrow if isinstance(col, _Strings) else col if isinstance(col, (pa.Array, pa.ChunkedArray)) \
            else pa.array(list(col), pa.string())
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if len(arr) == 0:
            continue
        enc = arr if pa.types.is_dictionary(arr.type) else arr.dictionary_encode()
        local = np.array([names.setdefault(s, len(names)) for s in enc.dictionary.to_pylist()], np.int32)
        codes.append(local[enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)])
    return tuple(names), np.concatenate(codes) if codes else np.zeros(0, np.int32)


def from_examples(examples: Sequence[Example]) -> ExampleColumns:
    """Columns of ``driftline.v1.Example`` protos (per-example Python: producers and tests only).
    A label/dense key an example lacks reads NaN; a slot it lacks is an empty bag."""
    n = len(examples)

    def col(get: Callable[[Example], Any], dt: type[np.generic]) -> np.ndarray:
        return np.fromiter(map(get, examples), dt, n)

    label_names = sorted({k for e in examples for k in e.labels})
    dense_names = sorted({k for e in examples for k in e.features.dense})
    slots = sorted({k for e in examples for k in e.features.sparse})
    sparse = {}
    for s in slots:
        bags = [e.features.sparse[s].ids if s in e.features.sparse else () for e in examples]
        offs = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, bags), np.int64, n), out=offs[1:])
        sparse[s] = np.fromiter((i for b in bags for i in b), np.int64, int(offs[-1])), offs
    return ExampleColumns(
        [e.example_id for e in examples], [e.request_id for e in examples],
        col(lambda e: e.item_id, np.int64), col(lambda e: e.user_id, np.int64),
        col(lambda e: e.event_time_ms, np.int64), col(lambda e: e.sample_rate, np.float32),
        [e.model_id for e in examples],
        labels={k: col(partial(_label, k), np.float32) for k in label_names},
        sparse=sparse,
        dense={k: col(partial(_dense, k), np.float32) for k in dense_names})


def _label(name: str, e: Example) -> float:
    return float(e.labels.get(name, math.nan))


def _dense(name: str, e: Example) -> float:
    return float(e.features.dense.get(name, math.nan))


def to_examples(c: ExampleColumns) -> list[Example]:
    """The ``driftline.v1.Example`` protos of a batch (per-example Python: tests and tools only):
    the inverse of :func:`from_examples` (a NaN label or dense value is left out, an empty bag
    is an absent slot).

    >>> from proto import Example
    >>> e = Example(example_id="r/1", request_id="r", item_id=1, event_time_ms=5, sample_rate=1.0)
    >>> e.labels["click"] = 1.0
    >>> e.features.sparse["genre"].ids.extend([3, 4])
    >>> to_examples(decode(encode(from_examples([e])))) == [e]
    True
    """
    from proto import Example

    out = []
    sparse = {s: (ids, offs) for s, (ids, offs) in c.sparse.items()}
    for i in range(c.size):
        e = Example(example_id=c.example_ids[i], request_id=c.request_ids[i], item_id=int(c.item_id[i]),
                    user_id=int(c.user_id[i]), event_time_ms=int(c.event_time_ms[i]),
                    sample_rate=float(c.sample_rate[i]), model_id=c.model_ids[i])
        for name, v in c.labels.items():
            if not math.isnan(v[i]):
                e.labels[name] = float(v[i])
        for s, (ids, offs) in sparse.items():
            if offs[i + 1] > offs[i]:
                e.features.sparse[s].ids.extend(ids[offs[i]:offs[i + 1]].tolist())
        for name, v in c.dense.items():
            if not math.isnan(v[i]):
                e.features.dense[name] = float(v[i])
        out.append(e)
    return out


def take_lists(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` (int indices, in any order, repeats allowed) of a list column given as
    ``(values, offsets)`` (row i is ``values[offsets[i]:offsets[i + 1]]``), as ``(values, offsets)``
    of their own (offsets int64 from 0): pyarrow's ``take`` of a large list array.

    >>> v, o = take_lists(np.array([7, 8, 9]), np.array([0, 1, 1, 3]), np.array([2, 0, 2]))
    >>> v.tolist(), o.tolist()
    ([8, 9, 7, 8, 9], [0, 2, 3, 5])
    """
    col = pa.LargeListArray.from_arrays(np.asarray(offsets, np.int64), values).take(np.asarray(rows, np.int64))
    return col.flatten().to_numpy(), col.offsets.to_numpy()


def take(c: ExampleColumns, rows: np.ndarray) -> ExampleColumns:
    """The examples ``rows`` (int indices) of a batch, as a batch of their own: how a consumer
    dead-letters just the examples it refuses.

    >>> c = ExampleColumns(["a", "b"], ["r", "r"], np.array([1, 2]), np.zeros(2), np.array([5, 6]),
    ...                    np.ones(2, np.float32), ["m", "m"], sparse={"s": (np.array([7, 8, 9]), np.array([0, 1, 3]))})
    >>> t = decode(encode(take(decode(encode(c)), np.array([1]))))
    >>> list(t.example_ids), t.sparse["s"][0].tolist(), t.sparse["s"][1].tolist()
    (['b'], [8, 9], [0, 2])
    """
    rows = np.asarray(rows, np.int64)
    idx = rows.tolist()
    sparse = {s: take_lists(ids, o, rows) for s, (ids, o) in c.sparse.items()}
    return ExampleColumns([c.example_ids[i] for i in idx], [c.request_ids[i] for i in idx], c.item_id[rows],
                          c.user_id[rows], c.event_time_ms[rows], c.sample_rate[rows],
                          [c.model_ids[i] for i in idx], labels={k: v[rows] for k, v in c.labels.items()},
                          sparse=sparse, dense={k: v[rows] for k, v in c.dense.items()},
                          id_hash=None if c.id_hash is None else c.id_hash[rows])
