"""``ps.sequential_fm``: the kernel against a plain-Python reading of its module docstring."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ps import (
    AdagradConfig,
    AdamConfig,
    AdmissionConfig,
    InitializerConfig,
    InvalidInputError,
    ParameterServer,
    SGDConfig,
    TableConfig,
)
from ps.sequential_fm import train_fm_sequential

D = 3


def _server(admission: int = 1, emb_opt=None, cap: float | None = None) -> ParameterServer:
    adm = AdmissionConfig(min_count=admission)
    return ParameterServer([
        TableConfig(name="v", dim=D, optimizer=emb_opt or AdagradConfig(lr=0.2, max_accumulator=cap),
                    initializer=InitializerConfig(kind="normal", scale=0.3, seed=3), admission=adm, shards=2),
        TableConfig(name="u", dim=D, optimizer=SGDConfig(lr=0.1), initializer=InitializerConfig(kind="normal", scale=0.3,
                                                                                               seed=4)),
        TableConfig(name="w", dim=1, optimizer=AdagradConfig(lr=0.5, max_accumulator=cap), initializer=InitializerConfig(kind="zeros"),
                    admission=adm)],
        {"a": "v", "b": "v", "c": "u", "wa": "w", "wc": "w"})


def _batch(rng, n: int):
    """Fields a (one id), b (a bag, mean-pooled, sharing table v with a), c; first-order wa, wc."""
    bags = {"a": [[int(rng.integers(0, 5))] for _ in range(n)],
            "b": [rng.integers(0, 5, int(rng.integers(0, 4))).tolist() for _ in range(n)],
            "c": [[int(rng.integers(0, 3))] for _ in range(n)]}
    bags["wa"], bags["wc"] = bags["a"], bags["c"]
    slots = ("a", "b", "c", "wa", "wc")
    offs = np.array([np.concatenate([[0], np.cumsum([len(x) for x in bags[s]])]) for s in slots])
    ids = {s: np.array([i for x in bags[s] for i in x], np.int64) for s in slots}
    return slots, bags, offs, ids


def _reference(server: ParameterServer, slots, bags, labels, offset, jac, mean, cap: float = math.inf,
               scale=(1.0, 1.0)):
    """Example by example, straight from the docstring, on dict copies of the rows (the first-order
    fields ``wa``, ``wc`` times ``scale``); also each example's first-order pooled sums."""
    names = {"a": "v", "b": "v", "c": "u", "wa": "w", "wc": "w"}
    rows, acc = {}, {}
    for s in slots:
        for bag in bags[s]:
            for i in bag:
                key = (names[s], i)
                got = server.tables[names[s]].gather(np.array([i]))[0]
                rows[key] = got.astype(np.float64)
                st = server.tables[names[s]].items()
                k = np.flatnonzero(st[0] == i)
                acc[key] = (st[2][k[0]].astype(np.float64) if k.size and st[2].shape[1] else np.zeros(len(got)))
    present = {(names[s], i) for s in slots for bag in bags[s] for i in bag
               if np.flatnonzero(server.tables[names[s]].items()[0] == i).size}
    lr = {"v": 0.2, "u": 0.1, "w": 0.5}
    probs, pooled = [], np.zeros((labels.size, 2))
    for e in range(labels.size):
        xs = []
        for f, s in enumerate(("a", "b", "c")):
            bag = [i for i in bags[s][e] if (names[s], i) in present]
            c = 1.0 / len(bags[s][e]) if mean[f] and bags[s][e] else 1.0
            xs.append(sum((c * rows[(names[s], i)] for i in bag), np.zeros(D)))
        S = sum(xs)
        logit = offset[e] + 0.5 * (S @ S - sum(x @ x for x in xs))
        grads: dict = {}
        for j, s in enumerate(("wa", "wc")):
            for i in bags[s][e]:
                if ("w", i) in present:
                    logit += scale[j] * rows[("w", i)][0]
                    pooled[e, j] += rows[("w", i)][0]
                    grads[("w", i)] = grads.get(("w", i), 0.0) + 1.0  # (unscaled: ps.sequential)
        p = 1 / (1 + math.exp(-logit))
        probs.append(p)
        g = p - labels[e]
        for f, s in enumerate(("a", "b", "c")):
            c = 1.0 / len(bags[s][e]) if mean[f] and bags[s][e] else 1.0
            for i in bags[s][e]:
                if (names[s], i) in present:
                    key = (names[s], i)
                    grads[key] = grads.get(key, 0.0) + c * (S - xs[f] + jac[e, f])
        for key, d in grads.items():
            gr = np.float32(g * np.asarray(d, np.float64)).astype(np.float64)
            if key[0] == "u":
                rows[key] = rows[key] - lr["u"] * gr
            else:
                acc[key] = np.minimum(acc[key] + gr * gr, cap)
                rows[key] = rows[key] - lr[key[0]] * gr / (np.sqrt(acc[key]) + 1e-10)
    return np.array(probs), rows, pooled


@pytest.mark.parametrize("admission,cap,scale", [(1, None, None), (2, None, None), (1, 0.05, None),
                                                 (1, None, (0.0, 2.5))])
def test_the_kernel_learns_example_by_example_as_the_docstring_says(admission, cap, scale):
    """(``cap``: Adagrad's ``max_accumulator``, low enough that rows reach it within the batches;
    ``scale``: the first-order fields' factors, one 0)"""
    rng = np.random.default_rng(0)
    server = _server(admission, cap=cap)
    mean = np.array([False, True, False, False, False])
    for step in range(3):
        n = 16
        slots, bags, offs, ids = _batch(rng, n)
        pb = server.pack(ids)
        server.gather_packed(pb, insert=True, event_time=step)  # admission first, as the trainer does
        labels = rng.integers(0, 2, n).astype(np.float64)
        offset = rng.normal(0, 0.3, n)
        jac = rng.normal(0, 0.2, (n, 3, D)).astype(np.float32)
        want_p, want_rows, want_pooled = _reference(server, slots, bags, labels, offset, jac, mean,
                                                    math.inf if cap is None else cap, scale or (1.0, 1.0))
        pooled = np.zeros((n, 5))
        p, loss, resid = train_fm_sequential(server, pb, 3, offs, mean, labels, offset, jac, step, insert=False,
                                             scale=None if scale is None else np.array([1.0, 1.0, 1.0, *scale]),
                                             pooled=pooled)
        np.testing.assert_allclose(pooled[:, 3:], want_pooled, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(p, want_p, rtol=1e-5)
        np.testing.assert_allclose(resid, p.astype(np.float64) - labels, atol=1e-6)
        for (table, i), row in want_rows.items():
            np.testing.assert_allclose(server.tables[table].gather(np.array([i]))[0], row, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{table}[{i}] after step {step}")
        # every row the batch stepped is queued for the deltas
        assert all(t.pending_updates > 0 for t in server.tables.values())


def test_unsupported_optimizers_and_shapes_are_refused():
    rng = np.random.default_rng(1)
    slots, bags, offs, ids = _batch(rng, 4)
    server = _server(emb_opt=AdamConfig(lr=0.01))
    pb = server.pack(ids)
    args = (offs, np.zeros(5, bool), np.ones(4), np.zeros(4))
    with pytest.raises(InvalidInputError, match="SGD or Adagrad"):
        train_fm_sequential(server, pb, 3, *args, np.zeros((4, 3, D)), 1)
    server = _server()
    with pytest.raises(InvalidInputError, match="jac"):
        train_fm_sequential(server, server.pack(ids), 3, *args, np.zeros((4, 2, D)), 1)
    with pytest.raises(InvalidInputError, match="one dim"):
        train_fm_sequential(server, server.pack(ids), 4, *args, np.zeros((4, 4, D)), 1)
