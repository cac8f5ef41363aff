"""Packed multi-table lookup == per-table lookups; sharded table == unsharded."""

import numpy as np
import pytest
from conftest import assert_tables_identical
from hypothesis import given, settings
from hypothesis import strategies as st

from ps import AdamConfig, EmbeddingTable, InitializerConfig, ParameterServer, TableConfig
from ps.packed import packed_gather_kernel  # noqa: F401  (the single kernel under test)


def test_packed_lookup_over_many_tables_equals_per_table(rng):
    cfgs = [TableConfig(name=f"t{i}", dim=int(rng.integers(1, 17)), shards=int(rng.integers(1, 4)))
            for i in range(40)]
    slots = {f"slot{j}": f"t{j % 40}" for j in range(200)}
    ps = ParameterServer(cfgs, slots=slots)
    batch = {s: rng.integers(-50, 50, size=int(rng.integers(0, 30))) for s in slots}
    ps.gather(batch, insert=True, event_time=0)
    batch = {s: rng.integers(-80, 80, size=int(rng.integers(0, 30))) for s in slots}  # some absent
    out = ps.gather(batch)
    for s, ids in batch.items():
        ref = ps[slots[s]].gather(ids)
        assert out[s].shape == ref.shape and (out[s] == ref).all()
    found = np.empty(sum(ids.size for ids in batch.values()), np.bool_)
    flat = ps.gather_packed(batch, found=found)  # the same values as one buffer, in packed order
    assert flat.tobytes() == b"".join(out[s].tobytes() for s in batch)
    # found: which ids had a row (what trainer.prefetch re-reads with insert)
    assert found.tolist() == [bool(x) for s, ids in batch.items() for x in ps[slots[s]].contains(ids)]


def test_packed_insert_equals_per_table_insert(rng):
    def build():
        return ParameterServer([TableConfig(name="u", dim=4, shards=2), TableConfig(name="i", dim=3)],
                               slots={"hist": "i"})
    batch = {"u": rng.integers(0, 20, 50), "i": rng.integers(0, 20, 30), "hist": rng.integers(0, 30, 60)}
    a, b = build(), build()
    ea = a.gather(batch, insert=True, event_time=7)
    b["u"].gather(batch["u"], insert=True, event_time=7)
    b["i"].gather(np.concatenate([batch["i"], batch["hist"]]), insert=True, event_time=7)
    for name in ("u", "i"):
        assert_tables_identical(a[name], b[name])
    assert (ea["hist"] == b["i"].gather(batch["hist"])).all()
    grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in ea.items()}
    a.apply_gradients(batch, grads, event_time=8)
    b["u"].apply_gradients(batch["u"], grads["u"], event_time=8)
    b["i"].apply_gradients(np.concatenate([batch["i"], batch["hist"]]),
                           np.concatenate([grads["i"], grads["hist"]]), event_time=8)
    for name in ("u", "i"):
        assert_tables_identical(a[name], b[name])


@settings(max_examples=25)
@given(shards=st.integers(2, 7), seed=st.integers(0, 2**31))
def test_sharded_equals_unsharded(shards, seed):
    rng = np.random.default_rng(seed)

    def mk(n):
        return EmbeddingTable(TableConfig(name="s", dim=5, shards=n, optimizer=AdamConfig(lr=0.01),
                                          initializer=InitializerConfig(kind="normal", seed=4)))
    one, many = mk(1), mk(shards)
    for step in range(5):
        ids = rng.integers(-(2**63), 2**63 - 1, size=0, dtype=np.int64)
        ids = np.concatenate([ids, rng.integers(-100, 100, 64), [-(2**63), 2**63 - 1]]).astype(np.int64)
        t = np.full(ids.size, step * 10, np.int64) + rng.integers(0, 5, ids.size)
        assert (one.gather(ids, insert=True, event_time=t) == many.gather(ids, insert=True, event_time=t)).all()
        g = rng.normal(size=(ids.size, 5)).astype(np.float32)
        assert one.apply_gradients(ids, g, t) == many.apply_gradients(ids, g, t)
        gone = rng.integers(-100, 100, 5)
        assert one.delete(gone) == many.delete(gone)
    assert_tables_identical(one, many)
    # every shard holds only its own ids
    for i, s in enumerate(many.shards):
        k = s.items()[0]
        assert (many.router.shard_of(k) == i).all()
    # the stream of the sharded table carries the same final state
    a = {int(k): v for c in one.pop_updates() for k, v in zip(c.keys, c.values)}
    b = {int(k): v for c in many.pop_updates() for k, v in zip(c.keys, c.values)}
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_gather_is_torch_friendly():
    torch = pytest.importorskip("torch")
    t = EmbeddingTable(TableConfig(name="z", dim=4))
    out = t.gather(np.arange(3), insert=True, event_time=0)
    tt = torch.from_numpy(out)
    assert tt.dtype == torch.float32 and tt.data_ptr() == out.ctypes.data


@settings(max_examples=15)
@given(seed=st.integers(0, 2**31), per_id_times=st.booleans())
def test_packed_gradients_equal_per_table_calls(seed, per_id_times):
    """One ``apply_packed_gradients`` over shared, sharded tables with every optimizer, TTL expiry
    on update and per-id event times == the per-table calls, bit for bit (rows, state, times,
    watermarks, the touched-key stream)."""
    from ps import AdagradConfig, FtrlConfig, SGDConfig
    rng = np.random.default_rng(seed)
    opts = [SGDConfig(lr=0.1), AdagradConfig(lr=0.05), AdamConfig(lr=0.01), FtrlConfig(lr=0.05, l1=0.01)]

    def build():
        cfgs = [TableConfig(name=f"t{i}", dim=int(d), shards=int(n), optimizer=opts[i % 4],
                            initializer=InitializerConfig(kind="normal", seed=i),
                            ttl_seconds=5.0 if i == 1 else None)
                for i, (d, n) in enumerate(zip(rng.integers(1, 9, 4), rng.integers(1, 4, 4)))]
        return ParameterServer(cfgs, slots={"s0": "t0", "s2": "t2", "s2b": "t2"})

    state = rng.bit_generator.state
    a = build()
    rng.bit_generator.state = state
    b = build()
    slot_table = dict(a.slots)
    for step in range(4):
        # (empty slots only with one event time: the per-table reference path cannot take an
        # empty per-id time array)
        batch = {s: rng.integers(-40, 40, int(rng.integers(int(per_id_times), 60)))
                 for s in ("t0", "s0", "t1", "s2", "s2b", "t3")}
        n = sum(v.size for v in batch.values())
        t = (step * 3000 + rng.integers(0, 9000, n)) if per_id_times else step * 3000
        ea = a.gather(batch, insert=True, event_time=t)
        b_parts = {}
        for s in batch:
            b_parts.setdefault(slot_table[s], []).append(s)
        tt = np.asarray(t) if per_id_times else None
        offs = np.cumsum([0] + [v.size for v in batch.values()])
        span = {s: (offs[k], offs[k + 1]) for k, s in enumerate(batch)}
        for table, ss in b_parts.items():
            ids = np.concatenate([batch[s] for s in ss])
            et = np.concatenate([tt[slice(*span[s])] for s in ss]) if per_id_times else t
            b[table].gather(ids, insert=True, event_time=et)
        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in ea.items()}
        flat = np.concatenate([grads[s].reshape(-1) for s in batch])
        done = a.apply_packed_gradients(batch, flat, t)
        ref = {}
        for table, ss in b_parts.items():
            ids = np.concatenate([batch[s] for s in ss])
            et = np.concatenate([tt[slice(*span[s])] for s in ss]) if per_id_times else t
            ref[table] = b[table].apply_gradients(ids, np.concatenate([grads[s] for s in ss]), et)
        assert done == ref
    for name in a.table_names:
        assert_tables_identical(a[name], b[name])
        for x, y in zip(a[name].shards, b[name].shards):
            assert x.watermark == y.watermark and x.pending_updates == y.pending_updates
            assert (x.meta == y.meta).all()
        sa = [(c.keys.tobytes(), c.values.tobytes(), c.tombstones.tobytes()) for c in a[name].pop_updates()]
        sb = [(c.keys.tobytes(), c.values.tobytes(), c.tombstones.tobytes()) for c in b[name].pop_updates()]
        assert sa == sb


def test_packed_gradients_refuse_bad_buffers():
    from ps import InvalidGradientError, NonFiniteGradientError
    ps = ParameterServer([TableConfig(name="a", dim=2), TableConfig(name="b", dim=3, shards=2)])
    batch = {"a": np.arange(4), "b": np.arange(5)}
    ps.gather(batch, insert=True, event_time=0)
    before = [t.items() for t in ps.tables.values()]
    g = np.ones(4 * 2 + 5 * 3, np.float32)
    with pytest.raises(InvalidGradientError):
        ps.apply_packed_gradients(batch, g[:-1], event_time=1)
    with pytest.raises(InvalidGradientError):
        ps.apply_packed_gradients(batch, g.astype(np.int64), event_time=1)
    g[9] = np.nan  # one row of table b
    with pytest.raises(NonFiniteGradientError, match="^1 gradient row"):
        ps.apply_packed_gradients(batch, g, event_time=1)
    for b, t in zip(before, ps.tables.values()):
        assert all((x == y).all() for x, y in zip(b, t.items()))
