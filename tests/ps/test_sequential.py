"""Sequential (per-example) linear updates equal a plain per-example loop, and feed parameter sync."""

import math

import numpy as np
import pytest

from ps import AdagradConfig, AdamConfig, FtrlConfig, InitializerConfig, ParameterServer, SGDConfig, TableConfig
from ps.errors import InvalidInputError
from ps.optimizers import OPT_ADAM, adam_corrections, step_elem
from ps.sequential import train_linear_sequential

OPTIMIZERS = {"sgd": SGDConfig(lr=0.3), "adagrad": AdagradConfig(lr=0.2, initial_accumulator_value=0.1),
              "adam": AdamConfig(lr=0.05), "ftrl": FtrlConfig(lr=0.1, l1=0.01, l2=0.1)}


def make_server(one_table: bool = False):
    """One dim-1 table per optimizer (random init, so FTRL's state is non-trivial); ``adagrad`` has
    2 shards and is read by two slots (``genre``, mean-pooled, and ``pair``, summed). ``one_table``:
    every slot reads one 1-shard Adagrad table (an LR's layout: the write-through kernel's case)."""
    if one_table:
        t = TableConfig(name="adagrad", dim=1, optimizer=OPTIMIZERS["adagrad"],
                        initializer=InitializerConfig(kind="normal", scale=0.3, seed=1))
        return ParameterServer([t], slots={s: "adagrad" for s in ("sgd", "genre", "pair", "adam", "ftrl")})
    tables = [TableConfig(name=n, dim=1, optimizer=o, shards=2 if n == "adagrad" else 1,
                          initializer=InitializerConfig(kind="normal", scale=0.3, seed=i))
              for i, (n, o) in enumerate(OPTIMIZERS.items())]
    return ParameterServer(tables, slots={"genre": "adagrad", "pair": "adagrad"})


def make_batch(rng, n):
    """``{slot: ids}`` and per-slot offsets; bags of 0..3 ids from few ids, so rows repeat within
    an example (``genre`` and ``pair`` share ``adagrad``'s rows) and across examples."""
    ids, offs = {}, {}
    for slot in ("sgd", "adagrad", "genre", "pair", "adam", "ftrl"):
        lens = rng.integers(1, 2, n) if slot in ("sgd", "adam") else rng.integers(0, 4, n)
        offs[slot] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ids[slot] = rng.integers(0, 5, int(lens.sum())).astype(np.int64)
    return ids, offs


def reference(server, ids, offs, mean, labels, offset, scale=None):
    """Per-example loop in plain Python over copies of the tables' rows (after insertion); each
    slot's pooled sum times ``scale[slot]`` (default 1). Also returns each example's pooled sums."""
    scale = scale or {slot: 1.0 for slot in ids}
    pooled = {slot: np.zeros(labels.size) for slot in ids}
    rows = {}  # (table, id) -> [w float32[1], state float32[width]]
    for name, table in server.tables.items():
        k, v, s, _ = table.items()
        for key, w, st in zip(k.tolist(), v, s):
            rows[(name, key)] = [w.copy(), st.copy()]
    probs, resid = [], []
    for e in range(labels.size):
        logit = float(offset[e])
        grads: dict = {}
        for slot, a in ids.items():
            bag = a[offs[slot][e]:offs[slot][e + 1]]
            wgt = 1.0 / bag.size if mean[slot] and bag.size else 1.0
            for i in bag.tolist():
                key = (server.slots[slot], i)
                logit += scale[slot] * wgt * float(rows[key][0][0])
                pooled[slot][e] += wgt * float(rows[key][0][0])
                grads[key] = grads.get(key, 0.0) + wgt  # (the factor scales the logit, not the rows' steps)
        p = 1.0 / (1.0 + math.exp(-logit))
        probs.append(p)
        resid.append(p - labels[e])
        for key, wsum in grads.items():
            table = server.tables[key[0]].shards[0]
            w, st = rows[key]
            kind, hyper = table._opt_kind, table._hyper
            bc1 = bc2 = 1.0
            if kind == OPT_ADAM:
                st[2] += 1
                bc1, bc2 = adam_corrections.py_func(hyper, float(st[2]))
            a, b = (float(st[0]) if st.size > 0 else 0.0), (float(st[1]) if st.size > 1 else 0.0)
            g = float(np.float32((p - labels[e]) * wsum))
            w[0], a, b = step_elem.py_func(kind, hyper, float(w[0]), a, b, g, bc1, bc2)
            st[:2] = [a, b][:min(2, st.size)]
    return np.array(probs), np.array(resid), rows, pooled


@pytest.mark.parametrize("scaled", [False, True], ids=["", "scaled"])
@pytest.mark.parametrize("one_table", [False, True], ids=["scratch", "write_through"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_per_example_reference(seed, one_table, scaled):
    """``scaled``: each segment's pooled sum times a factor in the logit (0 for one: its rows add
    nothing there, and still learn)."""
    rng = np.random.default_rng(seed)
    server = make_server(one_table)
    n = 40
    ids, offs = make_batch(rng, n)
    mean = {s: s == "genre" for s in ids}
    labels = (rng.random(n) < 0.5).astype(np.float32)
    offset = rng.normal(0, 0.2, n)
    pb = server.pack(ids)
    server.gather_packed(pb, insert=True, event_time=5)  # rows exist, as the kernel's gather makes them
    scale = dict(zip(ids, [0.5, 0.0, 2.0, 1.0, 1.5, 0.25])) if scaled else None
    want_p, want_r, want_rows, want_pooled = reference(server, ids, offs, mean, labels, offset, scale)
    bags = np.stack([offs[s] - offs[s][0] for s in pb.slots])
    pooled = np.zeros((n, len(pb.slots)))
    p, loss, r = train_linear_sequential(server, pb, bags, np.array([mean[s] for s in pb.slots]), labels,
                                         offset, event_time=7, pooled=pooled,
                                         scale=None if scale is None else np.array([scale[s] for s in pb.slots]))
    for j, slot in enumerate(pb.slots):
        np.testing.assert_allclose(pooled[:, j], want_pooled[slot], rtol=1e-6, atol=1e-7, err_msg=slot)
    np.testing.assert_allclose(p, want_p, rtol=1e-6)
    np.testing.assert_allclose(r, want_r, rtol=1e-5, atol=1e-7)
    lg = np.log(want_p / (1 - want_p))
    np.testing.assert_allclose(loss, np.mean(np.logaddexp(0, lg) - labels * lg), rtol=1e-6)
    for name, table in server.tables.items():
        k, v, s, t = table.items()
        assert (t[np.isin(k, [key for (tn, key) in want_rows if tn == name])] == 7).all()
        for key, w, st in zip(k.tolist(), v, s):
            ww, ws = want_rows[(name, key)]
            np.testing.assert_allclose(w, ww, rtol=1e-6, atol=1e-7, err_msg=f"{name}[{key}]")
            np.testing.assert_allclose(st, ws, rtol=1e-6, atol=1e-7, err_msg=f"{name}[{key}] state")


def test_later_examples_see_earlier_updates_and_rows_reach_sync():
    cfg = TableConfig(name="w", dim=1, optimizer=AdagradConfig(lr=0.5), initializer=InitializerConfig(kind="zeros"))
    server = ParameterServer([cfg])
    ids = np.array([3, 3, 3, 9], np.int64)
    pb = server.pack({"w": ids})
    p, _, _ = train_linear_sequential(server, pb, np.array([[0, 1, 2, 3, 4]]), np.zeros(1, bool),
                                      np.ones(4, np.float32), np.zeros(4), event_time=11)
    assert p[0] == 0.5 and p[1] > p[0] and p[2] > p[1] and p[3] == 0.5
    table = server["w"]
    assert table.pending_updates == 2
    chunks = list(table.pop_updates())
    keys = np.concatenate([c.keys for c in chunks])
    assert sorted(keys.tolist()) == [3, 9]
    assert (np.concatenate([c.times for c in chunks]) == 11).all()
    k, v, _, _ = table.items()
    np.testing.assert_array_equal(np.concatenate([c.values for c in chunks])[np.argsort(keys)], v)
    # touched again: queued again
    train_linear_sequential(server, pb, np.array([[0, 1, 2, 3, 4]]), np.zeros(1, bool),
                            np.zeros(4, np.float32), np.zeros(4), event_time=12)
    assert table.pending_updates == 2


def test_not_admitted_ids_read_zero_and_are_not_stepped():
    cfg = TableConfig(name="w", dim=1, optimizer=SGDConfig(lr=1.0), admission={"min_count": 3},
                      initializer=InitializerConfig(kind="zeros"))
    server = ParameterServer([cfg])
    pb = server.pack({"w": np.array([1, 2], np.int64)})
    train_linear_sequential(server, pb, np.array([[0, 1, 2]]), np.zeros(1, bool), np.ones(2, np.float32),
                            np.zeros(2), event_time=1)
    assert len(server["w"]) == 0 and server["w"].pending_updates == 0


def test_rejects_wide_tables_and_bad_bags():
    server = ParameterServer([TableConfig(name="e", dim=4), TableConfig(name="w", dim=1)])
    with pytest.raises(InvalidInputError):
        train_linear_sequential(server, server.pack({"e": np.array([1])}), np.array([[0, 1]]), np.zeros(1, bool),
                                np.ones(1, np.float32), np.zeros(1), event_time=1)
    with pytest.raises(InvalidInputError):
        train_linear_sequential(server, server.pack({"w": np.array([1, 2])}), np.array([[0, 1]]),
                                np.zeros(1, bool), np.ones(1, np.float32), np.zeros(1), event_time=1)
