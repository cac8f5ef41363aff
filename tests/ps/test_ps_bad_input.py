"""Bad input raises a clear error and leaves every table unchanged."""

import numpy as np
import pytest
from conftest import assert_tables_identical

from ps import (
    EmbeddingTable,
    InvalidEventTimeError,
    InvalidGradientError,
    InvalidIdsError,
    NonFiniteGradientError,
    ParameterServer,
    ReadOnlyTableError,
    TableConfig,
    UnknownTableError,
)


def fresh(shards=1):
    t = EmbeddingTable(TableConfig(name="b", dim=3, shards=shards))
    ids = np.arange(20, dtype=np.int64)
    t.gather(ids, insert=True, event_time=1)
    t.apply_gradients(ids, np.ones((20, 3), np.float32), event_time=2)
    return t


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("call,exc", [
    (lambda t: t.gather(np.arange(4.0), insert=True, event_time=0), InvalidIdsError),
    (lambda t: t.gather(np.arange(4, dtype=np.uint64), insert=True, event_time=0), InvalidIdsError),
    (lambda t: t.gather(np.zeros((2, 2), np.int64), insert=True, event_time=0), InvalidIdsError),
    (lambda t: t.gather(np.arange(30), insert=True, event_time=1.5), InvalidEventTimeError),
    (lambda t: t.gather(np.arange(30), insert=True, event_time=None), InvalidEventTimeError),
    (lambda t: t.gather(np.arange(30), insert=True, event_time=np.zeros(3, np.int64)), InvalidEventTimeError),
    (lambda t: t.apply_gradients(np.arange(3), np.ones((3, 4), np.float32), 5), InvalidGradientError),
    (lambda t: t.apply_gradients(np.arange(3), np.ones((3, 3), np.int64), 5), InvalidGradientError),
    (lambda t: t.apply_gradients(np.arange(3), np.array([[1, 1, 1], [1, np.nan, 1], [1, 1, 1]], np.float32), 5),
     NonFiniteGradientError),
    (lambda t: t.apply_gradients(np.arange(3), np.full((3, 3), 1e300), 5), NonFiniteGradientError),
    (lambda t: t.apply_gradients(np.arange(3), np.full((3, 3), np.inf, np.float32), 5), NonFiniteGradientError),
    (lambda t: t.apply_gradients(np.array(["a", "b"]), np.ones((2, 3), np.float32), 5), InvalidIdsError),
])
def test_bad_input_leaves_table_unchanged(shards, call, exc):
    t, ref = fresh(shards), fresh(shards)
    with pytest.raises(exc) as e:
        call(t)
    assert isinstance(e.value, ValueError) and str(e.value)
    assert_tables_identical(t, ref)
    assert t.pending_updates == ref.pending_updates


def test_unknown_table_and_slot():
    ps = ParameterServer([TableConfig(name="u", dim=2)])
    with pytest.raises(UnknownTableError) as e:
        ps.gather({"nope": np.arange(3)})
    assert isinstance(e.value, KeyError)
    with pytest.raises(KeyError):
        ps["nope"]
    with pytest.raises(UnknownTableError):
        ParameterServer([TableConfig(name="u", dim=2)], slots={"s": "missing"})


def test_packed_apply_validates_all_slots_first():
    ps = ParameterServer([TableConfig(name="a", dim=2), TableConfig(name="b", dim=2)])
    batch = {"a": np.arange(5), "b": np.arange(5)}
    ps.gather(batch, insert=True, event_time=0)
    before = [t.items() for t in ps.tables.values()]
    bad = {"a": np.ones((5, 2), np.float32), "b": np.full((5, 2), np.nan, np.float32)}
    with pytest.raises(NonFiniteGradientError):
        ps.apply_gradients(batch, bad, event_time=1)
    for b, t in zip(before, ps.tables.values()):
        assert all((x == y).all() for x, y in zip(b, t.items()))


def test_serving_replica_refuses_training():
    t = EmbeddingTable(TableConfig(name="s", dim=2).serving())
    with pytest.raises(ReadOnlyTableError):
        t.gather(np.arange(3), insert=True, event_time=0)
    with pytest.raises(ReadOnlyTableError):
        t.apply_gradients(np.arange(3), np.ones((3, 2), np.float32), event_time=0)
    assert len(t) == 0


def test_config_is_validated():
    with pytest.raises(ValueError):
        TableConfig(name="bad name/..", dim=2)
    with pytest.raises(ValueError):
        TableConfig(name="x", dim=0)
    with pytest.raises(ValueError):
        TableConfig(name="x", dim=2, optimizer={"kind": "adagrad", "lr": -1})
