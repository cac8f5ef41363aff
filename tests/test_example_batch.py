"""services.example_batch: round trips, schema agreement, and typed errors on bad bytes."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import Example
from services import example_batch as eb
from trainer.batch import SparseBatch

I64 = st.integers(-(2**63), 2**63 - 1)
NAMES = st.text("abcxyz_", min_size=1, max_size=4)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def columns(draw, large: bool = False) -> eb.ExampleColumns:
    n = draw(st.integers(0, 6))
    ids = draw(st.lists(st.text(min_size=1, max_size=6), min_size=n, max_size=n))
    f32 = st.floats(width=32, allow_infinity=False)
    arr = lambda s, dt: np.array(draw(st.lists(s, min_size=n, max_size=n)), dt).reshape(n)  # noqa: E731
    sparse = {}
    for slot in draw(st.sets(NAMES, max_size=3)):
        bags = draw(st.lists(st.lists(I64, max_size=4), min_size=n, max_size=n))
        offs = np.zeros(n + 1, np.int64)
        np.cumsum([len(b) for b in bags], out=offs[1:])
        sparse[slot] = np.array([i for b in bags for i in b], np.int64), offs
    return eb.ExampleColumns(
        ids, draw(st.lists(st.text(max_size=5), min_size=n, max_size=n)), arr(I64, np.int64), arr(I64, np.int64),
        arr(st.integers(1, 2**63 - 1), np.int64),
        arr(st.floats(0, 1, exclude_min=True, width=32), np.float32),
        draw(st.lists(st.sampled_from(["", "m1", "модель"]), min_size=n, max_size=n)),
        labels={k: arr(f32, np.float32) for k in draw(st.sets(NAMES, max_size=2))},
        sparse=sparse, dense={k: arr(f32, np.float32) for k in draw(st.sets(NAMES, max_size=2))})


def assert_same(a: eb.ExampleColumns, b: eb.ExampleColumns) -> None:
    assert list(a.example_ids) == list(b.example_ids) and list(a.request_ids) == list(b.request_ids)
    assert list(a.model_ids) == list(b.model_ids)
    for f in ("item_id", "user_id", "event_time_ms", "sample_rate"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert getattr(b, f).dtype == (np.float32 if f == "sample_rate" else np.int64)
    for name in ("labels", "dense"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])  # NaN == NaN here
    assert a.sparse.keys() == b.sparse.keys()
    for k, (ids, offs) in a.sparse.items():
        np.testing.assert_array_equal(b.sparse[k][0], ids[offs[0]:offs[-1]])
        np.testing.assert_array_equal(b.sparse[k][1], offs - offs[0])


@FAST
@given(columns(), st.booleans())
def test_round_trip(c, large):
    d = eb.decode(eb.encode(c, large_lists=large))
    assert d.size == c.size
    assert_same(c, d)
    np.testing.assert_array_equal(d.id_hash, eb.hash_ids(c.example_ids))


def test_empty_batch_and_extremes():
    empty = eb.ExampleColumns([], [], np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), [],
                              labels={"click": np.zeros(0)}, sparse={"a": (np.zeros(0), np.zeros(1))})
    d = eb.decode(eb.encode(empty))
    assert d.size == 0 and d.sparse["a"][1].tolist() == [0] and d.id_hash.shape == (0, 2)
    lo, hi = -(2**63), 2**63 - 1
    c = eb.ExampleColumns(["é/✓", "🙂"], ["", "x"], np.array([lo, hi]), np.array([hi, lo]), np.array([1, hi]),
                          np.array([1.0, 1e-30], np.float32), ["m", "m"],
                          sparse={"a": (np.array([lo, hi]), np.array([0, 0, 2])), "b": (np.zeros(0, np.int64), np.zeros(3, np.int64))})
    assert_same(c, eb.decode(eb.encode(c)))


def test_sliced_offsets_are_rebased():
    # offsets that do not start at 0 (a slice of a bigger batch) come back starting at 0
    c = eb.ExampleColumns(["a"], ["r"], np.array([1]), np.array([2]), np.array([3]), np.array([1.0], np.float32),
                          ["m"], sparse={"s": (np.array([9, 9, 4, 5, 9]), np.array([2, 4]))})
    d = eb.decode(eb.encode(c))
    assert d.sparse["s"][0].tolist() == [4, 5] and d.sparse["s"][1].tolist() == [0, 2]


def examples(n: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        e = Example(example_id=f"r{i // 3}/{i}", request_id=f"r{i // 3}", item_id=i, user_id=7 * i,
                    event_time_ms=1_700_000_000_000 + i, sample_rate=1.0 if i % 2 else 0.25, model_id="m")
        e.labels["click"] = float(i % 2)
        if i % 4:
            e.labels["watch"] = 0.5
        for s in ("genre", "age", "tag")[: 1 + i % 3]:
            e.features.sparse[s].ids.extend(rng.integers(-5, 2**40, 1 + i % 4).tolist())
        if i % 5:
            e.features.dense["score"] = i / 10
        out.append(e)
    return out


@pytest.mark.parametrize("split", [[7], [3, 0, 4], [1, 1, 5]])
def test_sparse_batch_matches_per_example_path(split):
    exs = examples(sum(split))
    parts, i = [], 0
    for k in split:  # several records, each a batch, some without a slot column
        parts.append(eb.decode(eb.encode(eb.from_examples(exs[i:i + k]))))
        i += k
    slots = ["genre", "age", "tag", "never"]
    got = SparseBatch(**eb.to_sparse_batch_arrays(parts, slots, "watch", ["score", "absent"]))
    want = SparseBatch.from_examples(exs, slots, "watch", ["score", "absent"])
    assert got.size == want.size
    for s in slots:
        np.testing.assert_array_equal(got.ids[s], want.ids[s])
        np.testing.assert_array_equal(got.offsets[s], want.offsets[s])
        assert got.ids[s].dtype == got.offsets[s].dtype == np.int64
    for f in ("labels", "event_time_ms", "sample_rate", "dense"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
        assert getattr(got, f).dtype == getattr(want, f).dtype
    np.testing.assert_array_equal(got.meta["id_hash"], eb.hash_ids([e.example_id for e in exs]))


def test_encoder_schema_is_what_the_decoder_checks():
    raw = eb.encode(eb.from_examples(examples(3)))
    schema = pa.ipc.open_stream(raw).schema
    k = len(eb.FIXED_SCHEMA)
    assert list(schema)[:k] == list(eb.FIXED_SCHEMA) and schema.metadata == eb.FIXED_SCHEMA.metadata
    assert all(f.name.split(".")[0] in ("label", "sparse", "dense") for f in list(schema)[k:])


def _rewrite(raw: bytes, fn) -> bytes:
    batch = fn(pa.ipc.open_stream(raw).read_next_batch())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _set(name, arr):
    return lambda b: b.set_column(b.schema.get_field_index(name), name, arr)


BAD = {
    "wrong format tag": lambda b: b.replace_schema_metadata({"format": "other"}),
    "event_time int32": _set("event_time_ms", pa.array([1, 2, 3], pa.int32())),
    "missing column": lambda b: b.drop_columns(["request_id"]),
    "swapped columns": lambda b: b.select([2, 1, 0] + list(range(3, b.num_columns))),
    "nan sample_rate": _set("sample_rate", pa.array([1, math.nan, 1], pa.float32())),
    "zero sample_rate": _set("sample_rate", pa.array([1, 0, 1], pa.float32())),
    "unset event time": _set("event_time_ms", pa.array([1, -(2**63), 1], pa.int64())),
    "empty example_id": _set("example_id", pa.array(["a", "", "c"])),
    "null example_id": _set("example_id", pa.array(["a", None, "c"])),
    "inf label": _set("label.click", pa.array([1, math.inf, 0], pa.float32())),
    "unnamed column": lambda b: b.append_column("weird", pa.array([1, 2, 3], pa.float32())),
    "int sparse": lambda b: b.append_column("sparse.x", pa.array([[1], [2], []], pa.list_(pa.int32()))),
    "null id": lambda b: b.append_column("sparse.x", pa.array([[1], [None], []], pa.list_(pa.int64()))),
    "float64 dense": lambda b: b.append_column("dense.y", pa.array([1.0, 2, 3])),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_batches_raise_typed_error(case):
    raw = _rewrite(eb.encode(eb.from_examples(examples(3))), BAD[case])
    with pytest.raises(eb.BadExampleBatch) as err:
        eb.decode(raw)
    assert err.value.kind in ("invalid", "undecodable") and str(err.value)


def test_non_monotonic_offsets_and_two_batches():
    raw = eb.encode(eb.from_examples(examples(3)))
    batch = pa.ipc.open_stream(raw).read_next_batch()
    i = batch.schema.get_field_index("sparse.genre")
    col = batch.column(i)
    bad = pa.Array.from_buffers(col.type, 3, [None, pa.py_buffer(np.array([0, 3, 1, 4], np.int32).tobytes())],
                                children=[col.values])
    with pytest.raises(eb.BadExampleBatch, match="undecodable"):
        eb.decode(_rewrite(raw, lambda b: b.set_column(i, "sparse.genre", bad)))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
        w.write_batch(batch)
    with pytest.raises(eb.BadExampleBatch, match="more than one"):
        eb.decode(sink.getvalue().to_pybytes())


@FAST
@given(st.data())
def test_corrupt_bytes_raise_only_typed_error(data):
    raw = bytearray(eb.encode(eb.from_examples(examples(4))))
    how = data.draw(st.sampled_from(["truncate", "flip", "random"]))
    if how == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    else:
        raw = bytearray(data.draw(st.binary(max_size=200)))
    try:
        eb.decode(bytes(raw))
    except eb.BadExampleBatch:
        pass


def test_encode_refuses_mismatched_lengths():
    c = eb.from_examples(examples(3))
    c.item_id = c.item_id[:2]
    with pytest.raises(ValueError):
        eb.encode(c)
