"""Optimizers against torch.optim / the FTRL paper formula, with duplicate-id summing."""

import math

import numpy as np
import pytest
import torch

from ps import AdagradConfig, AdamConfig, EmbeddingTable, FtrlConfig, InitializerConfig, SGDConfig, TableConfig

IDS = np.array([5, 9, 5, 2, 9, 5], np.int64)  # duplicates on purpose
DIM = 4


def run_ps(opt, steps, grads_seq):
    t = EmbeddingTable(TableConfig(name="o", dim=DIM, optimizer=opt,
                                   initializer=InitializerConfig(kind="normal", scale=0.3, seed=3)))
    w0 = t.gather(IDS, insert=True, event_time=0).copy()
    for s in range(steps):
        t.apply_gradients(IDS, grads_seq[s], event_time=s + 1)
    return w0, t.gather(IDS)


def run_torch(make_opt, w0, steps, grads_seq):
    uniq, first = np.unique(IDS, return_index=True)
    p = torch.nn.Parameter(torch.from_numpy(w0[first].copy()))
    opt = make_opt([p])
    inv = np.searchsorted(uniq, IDS)
    for s in range(steps):
        g = np.zeros((uniq.size, DIM), np.float32)
        np.add.at(g, inv, grads_seq[s])  # duplicate ids: gradients summed
        p.grad = torch.from_numpy(g)
        opt.step()
    return p.detach().numpy()[inv]


@pytest.mark.parametrize("opt,make", [
    (SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (AdagradConfig(lr=0.1, initial_accumulator_value=0.1, eps=1e-10),
     lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=1e-10)),
    (AdamConfig(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8),
     lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.9, 0.99), eps=1e-8)),
])
def test_matches_torch(opt, make, rng):
    grads = [rng.normal(size=(IDS.size, DIM)).astype(np.float32) for _ in range(3)]
    w0, ours = run_ps(opt, 3, grads)
    ref = run_torch(make, w0, 3, grads)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-6)


def test_ftrl_matches_formula(rng):
    cfg = FtrlConfig(lr=0.1, beta=1.0, l1=0.01, l2=0.1, initial_accumulator_value=0.1)
    grads = [rng.normal(size=(IDS.size, DIM)).astype(np.float32) for _ in range(3)]
    w0, ours = run_ps(cfg, 3, grads)
    uniq, first = np.unique(IDS, return_index=True)
    inv = np.searchsorted(uniq, IDS)
    w = w0[first].astype(np.float64)
    n = np.full_like(w, 0.1)
    denom0 = (cfg.beta + np.sqrt(n)) / cfg.lr + cfg.l2
    z = -(w * denom0 + np.sign(w) * cfg.l1)
    for s in range(3):
        g = np.zeros_like(w)
        np.add.at(g, inv, grads[s].astype(np.float64))
        sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / cfg.lr
        z = z + g - sigma * w
        n = n + g * g
        w = np.where(np.abs(z) <= cfg.l1, 0.0,
                     -(z - np.sign(z) * cfg.l1) / ((cfg.beta + np.sqrt(n)) / cfg.lr + cfg.l2))
    np.testing.assert_allclose(ours, w[inv], rtol=1e-4, atol=1e-6)


def test_ftrl_insert_keeps_initializer():
    t = EmbeddingTable(TableConfig(name="f", dim=8, optimizer=FtrlConfig(l1=0.5),
                                   initializer=InitializerConfig(kind="uniform", scale=1.0)))
    ids = np.arange(50, dtype=np.int64)
    w = t.gather(ids, insert=True, event_time=0).copy()
    assert np.abs(w).max() > 0.5
    # a zero gradient step leaves weights where the initializer put them
    t.apply_gradients(ids, np.zeros((50, 8), np.float32), event_time=1)
    np.testing.assert_allclose(t.gather(ids), w, rtol=1e-6, atol=1e-7)


def test_duplicate_ids_one_step_with_summed_grad():
    t = EmbeddingTable(TableConfig(name="d", dim=1, optimizer=AdagradConfig(lr=1.0),
                                   initializer=InitializerConfig(kind="zeros")))
    ids = np.array([1, 1, 1], np.int64)
    t.gather(ids, insert=True, event_time=0)
    t.apply_gradients(ids, np.array([[1.0], [2.0], [3.0]], np.float32), event_time=1)
    # one Adagrad step with g=6: w = -6/sqrt(36) = -1 (three steps would give another value)
    assert t.gather(ids[:1])[0, 0] == pytest.approx(-1.0)
    assert t.items()[2][0, 0] == pytest.approx(36.0)


def test_initializers_seeded_and_scaled():
    ids = np.arange(20000, dtype=np.int64)
    for kind, check in [("zeros", lambda w: (w == 0).all()),
                        ("uniform", lambda w: np.abs(w).max() <= 0.2 and abs(w.std() - 0.2 / math.sqrt(3)) < 0.005),
                        ("normal", lambda w: abs(w.std() - 0.2) < 0.005 and abs(w.mean()) < 0.005)]:
        def mk(seed, kind=kind):
            return EmbeddingTable(TableConfig(name="i", dim=8, initializer=InitializerConfig(
                kind=kind, scale=0.2, seed=seed)))
        a = mk(1).gather(ids, insert=True, event_time=0)
        assert check(a), kind
        assert (mk(1).gather(ids[::-1], insert=True, event_time=0) == a[::-1]).all()
        if kind != "zeros":
            assert not (mk(2).gather(ids, insert=True, event_time=0) == a).all()


def test_max_accumulator_keeps_a_busy_rows_step_from_shrinking(rng):
    """Capped Adagrad is Adagrad until a weight's accumulator reaches the cap, then a constant step
    ``lr / sqrt(cap)``: a row with a long history still moves with its newest gradients."""
    cap = 2.0
    grads = [rng.normal(size=(IDS.size, DIM)).astype(np.float32) for _ in range(40)]
    w0, ours = run_ps(AdagradConfig(lr=0.1, initial_accumulator_value=0.1, max_accumulator=cap), 40, grads)
    uniq, first = np.unique(IDS, return_index=True)
    inv = np.searchsorted(uniq, IDS)
    w, acc = w0[first].astype(np.float64), np.full((uniq.size, DIM), 0.1)
    for g_ex in grads:
        g = np.zeros((uniq.size, DIM))
        np.add.at(g, inv, g_ex.astype(np.float64))
        acc = np.minimum(acc + g * g, cap).astype(np.float32).astype(np.float64)
        w = (w - 0.1 * g / (np.sqrt(acc) + 1e-10)).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(ours, w[inv], rtol=2e-5, atol=2e-6)
    assert (acc == np.float32(cap)).all()  # every weight reached the cap: the last steps were lr/sqrt(cap)
    _, plain = run_ps(AdagradConfig(lr=0.1, initial_accumulator_value=0.1), 40, grads)
    assert np.abs(ours - w0).sum() > np.abs(plain - w0).sum()  # the capped rows moved further
