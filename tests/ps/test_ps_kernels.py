"""The batched/prefetching kernels: same answers as plain models, bit-exact optimizer math,
64-byte aligned storage, and prefetch hints that never fault."""

import math

import numpy as np
import pytest

from ps import (
    AdagradConfig,
    AdmissionConfig,
    EmbeddingTable,
    InitializerConfig,
    SGDConfig,
    TableConfig,
    restore_table,
    save_table,
)
from ps._jit import aligned_zeros, njit, prefetch, prefetch_row
from ps.hashmap import GROUP
from ps.optimizers import dedupe


def _aligned(a):
    return a.ctypes.data % 64 == 0


def test_aligned_zeros_shapes_and_alignment():
    for shape, dt in [((1000, 16), np.float32), (7, np.int64), ((3, 5), np.uint8), ((0, 4), np.float32)]:
        a = aligned_zeros(shape, dt)
        assert a.shape == (shape if isinstance(shape, tuple) else (shape,))
        assert a.dtype == dt and a.flags.c_contiguous and a.flags.writeable
        assert (_aligned(a) or a.size == 0) and not a.any()


def test_storage_stays_aligned_through_growth_and_restore(tmp_path):
    t = EmbeddingTable(TableConfig(name="al", dim=16, optimizer=AdagradConfig(), initial_capacity=16))
    s = t.shards[0]
    for i in range(5):  # several row-storage and index growths
        t.gather(np.arange(i * 3000, (i + 1) * 3000), insert=True, event_time=1)
        assert _aligned(s._emb) and _aligned(s._state) and _aligned(s._slots)
    save_table(t, tmp_path)
    r = restore_table(tmp_path, "al").shards[0]
    assert _aligned(r._emb) and _aligned(r._state) and _aligned(r._slots)


@njit
def _prefetch_everywhere(a, b, idx):
    for i in idx:
        prefetch(a, i)
        prefetch_row(b, i)
    return a[0]


def test_prefetch_is_only_a_hint():
    a = np.arange(10, dtype=np.int64)
    b = np.ones((4, 40), np.float32)  # 40 floats: a row spans three cache lines
    idx = np.array([-1, 0, 3, 9, 10, 1 << 40, -(1 << 40)], np.int64)
    assert _prefetch_everywhere(a, b, idx) == 0  # out-of-range hints neither fault nor write
    assert (a == np.arange(10)).all() and (b == 1).all()


def test_batched_lookup_and_gather_match_a_dict(rng):
    """Batches far larger than a prefetch group, with repeats, misses and probe chains."""
    t = EmbeddingTable(TableConfig(name="m", dim=5, optimizer=SGDConfig(),
                                   initializer=InitializerConfig(kind="uniform", scale=1.0)))
    keys = rng.integers(-(2**63), 2**63 - 1, size=20 * GROUP + 7, dtype=np.int64)
    vals = t.gather(keys, insert=True, event_time=0).copy()
    model = {int(k): vals[i] for i, k in enumerate(keys)}
    probe = np.concatenate([keys, rng.integers(-(2**63), 2**63 - 1, size=3 * GROUP, dtype=np.int64)])
    probe = probe[rng.permutation(probe.size)]
    got = t.gather(probe)
    rows = t.shards[0].lookup(probe)
    for i, k in enumerate(probe.tolist()):
        if k in model:
            assert rows[i] >= 0 and (got[i] == model[k]).all()
        else:
            assert rows[i] == -1 and (got[i] == 0).all()
    for n in (0, 1, GROUP - 1, GROUP, GROUP + 1):  # group boundaries
        assert (t.gather(probe[:n]) == got[:n]).all()


def test_gather_insert_mixes_hits_new_and_unadmitted():
    cfg = TableConfig(name="mix", dim=3, optimizer=SGDConfig(),
                      initializer=InitializerConfig(kind="normal", scale=1.0),
                      admission=AdmissionConfig(min_count=2))
    t = EmbeddingTable(cfg)
    twice = np.arange(0, 300, dtype=np.int64)
    t.gather(twice, insert=True, event_time=1)  # first sighting: not admitted, zeros
    assert len(t) == 0
    batch = np.concatenate([twice, np.arange(1000, 1200), twice[:50]])  # admitted, unadmitted, repeats
    got = t.gather(batch, insert=True, event_time=2)
    ref = EmbeddingTable(cfg)
    ref.gather(twice, insert=True, event_time=1)
    rows = ref.shards[0].lookup_or_insert(batch, event_time=2)
    want = np.where((rows >= 0)[:, None], ref.shards[0]._emb[np.maximum(rows, 0)], 0)
    assert (got == want).all()
    assert (got[300:500] == 0).all() and (got[:300] != 0).any()
    assert (got[500:] == got[:50]).all()


def _reference_adagrad(w, acc, ids, grads, lr, eps):
    """The documented math, one id at a time in numpy: float32 sums in batch order starting
    from 0.0, then acc = f32(acc + g*g) and w = f32(w - lr*g/(sqrt(acc)+eps)) in float64."""
    sums = {}
    for i, k in enumerate(ids.tolist()):
        if k not in sums:
            sums[k] = np.zeros(grads.shape[1], np.float32)
        sums[k] = sums[k] + grads[i]
    for k, g in sums.items():
        g64 = g.astype(np.float64)
        a = (acc[k].astype(np.float64) + g64 * g64).astype(np.float32)
        acc[k] = a
        w[k] = (w[k].astype(np.float64) - lr * g64 / (np.sqrt(a.astype(np.float64)) + eps)).astype(np.float32)


@pytest.mark.parametrize("shards", [1, 2])
def test_adagrad_bit_exact_against_reference(rng, shards):
    lr, eps, dim = 0.05, 1e-10, 16
    t = EmbeddingTable(TableConfig(name="ada", dim=dim, shards=shards,
                                   optimizer=AdagradConfig(lr=lr, initial_accumulator_value=0.1, eps=eps),
                                   initializer=InitializerConfig(kind="normal", scale=0.1)))
    universe = rng.integers(-(2**63), 2**63 - 1, size=3000, dtype=np.int64)
    w, acc = {}, {}
    for step in range(6):
        ids = universe[np.minimum(rng.zipf(1.2, size=4 * GROUP + 3) - 1, universe.size - 1)]
        e = t.gather(ids, insert=True, event_time=step)
        for i, k in enumerate(ids.tolist()):
            if k not in w:
                w[k] = e[i].copy()
                acc[k] = np.full(dim, 0.1, np.float32)
        grads = rng.normal(size=(ids.size, dim)).astype(np.float32)
        grads[::5] = -0.0  # signed zeros must not change the sums' bits
        t.apply_gradients(ids, grads, event_time=step)
        _reference_adagrad(w, acc, ids, grads, lr, eps)
    keys, values, state, _ = t.items()
    for i, k in enumerate(keys.tolist()):
        assert values[i].tobytes() == w[k].tobytes()
        assert state[i].tobytes() == acc[k].tobytes()


def test_dedupe_sums_bit_exact_and_keeps_first_seen_order(rng):
    rows = rng.integers(-1, 50, size=5 * GROUP).astype(np.int64)  # -1: no row, skipped
    grads = rng.normal(size=(rows.size, 3)).astype(np.float32)
    grads[::3] = -0.0
    times = rng.integers(0, 100, size=rows.size).astype(np.int64)
    k, urows, ugrads, utimes = dedupe(rows, grads, times)
    order = list(dict.fromkeys(r for r in rows.tolist() if r >= 0))
    assert urows[:k].tolist() == order
    for p, r in enumerate(order):
        s = np.zeros(3, np.float32)
        for i in np.flatnonzero(rows == r):
            s = s + grads[i]
        assert ugrads[p].tobytes() == s.tobytes()
        assert utimes[p] == times[rows == r].max()
    assert math.isfinite(float(ugrads[:k].sum()))
