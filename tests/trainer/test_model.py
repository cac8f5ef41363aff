"""Model and snapshot unit tests (no broker): packed lookup layout, LR learns, exact snapshot round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps import SyncChunk
from trainer import snapshots
from trainer.batch import SparseBatch
from trainer.config import deepfm_config, lr_config
from trainer.data import MovieLensData
from trainer.metrics import StreamingAUC
from trainer.model import SparseModel


@pytest.fixture(scope="module")
def ml() -> MovieLensData:
    return MovieLensData(limit=40_000)


def _fill(model: SparseModel, rng: np.random.Generator, ids: np.ndarray) -> None:
    for t in model.tables.values():
        vals = rng.normal(size=(ids.size, t.dim)).astype(np.float32)
        t.apply_sync(SyncChunk(ids, vals, np.ones(ids.size, np.int64), np.zeros(0, np.int64)))


def test_packed_forward_matches_per_slot_reference():
    """One packed gather + one pooling op per block == per-slot lookups with sum/mean bags
    (``recent_items`` reads the item table with the raw ids: the same rows as ``item_id``)."""
    cfg = deepfm_config(dim=4, mlp=[8], slots=("user_id", "genres", "item_id"))
    assert cfg.slots["recent_items"] == "item_id" and "recent_items" not in cfg.linear
    m = SparseModel(cfg)
    rng = np.random.default_rng(0)
    _fill(m, rng, np.arange(1, 10, dtype=np.int64))
    rows = [{"user_id": [1], "genres": [2, 3, 4], "item_id": [5], "recent_items": [5, 6, 9]},
            {"user_id": [2], "genres": [], "item_id": [99]},   # empty bags, absent id
            {"user_id": [3], "genres": [7], "item_id": [6], "recent_items": [99, 8]}]
    b = SparseBatch.from_slot_dicts(rows, slots=cfg.all_slots)

    def bag(table, ids, mode):
        t = m.tables[table]
        if not ids:
            return np.zeros(t.dim, np.float32)
        v = t.gather(np.array(ids, np.int64))
        return v.mean(0) if mode == "mean" else v.sum(0)

    emb = np.stack([np.stack([bag(cfg.slots[s], r.get(s, []), cfg.pooling.get(s, "sum")) for s in cfg.slots])
                    for r in rows])
    lin = np.stack([np.concatenate([bag(cfg.linear[s], r[s], cfg.pooling.get(s, "sum")) for s in cfg.linear])
                    for r in rows])
    with torch.no_grad():
        want = m.head(torch.from_numpy(emb), torch.from_numpy(lin), None).numpy()
        got, _ = m.forward(b)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_recent_items_shares_item_rows_and_may_be_absent():
    """Batches without the real-time slot (historical data) train and score as an empty bag; with
    it, a clicked item's gradient lands on the item's own row (no salt, no row of its own)."""
    cfg = deepfm_config(dim=4, mlp=[8], slots=("user_id", "item_id"))
    with_slot = SparseBatch.from_slot_dicts([{"user_id": [1], "item_id": [5], "recent_items": [7]}],
                                            slots=cfg.all_slots, labels=[1.0], event_time_ms=[1])
    without = SparseBatch.from_slot_dicts([{"user_id": [1], "item_id": [5]}], slots=["user_id", "item_id"],
                                          labels=[1.0], event_time_ms=[1])
    assert "recent_items" not in without.ids
    a, b = SparseModel(cfg), SparseModel(cfg)
    b.head.load_state_dict(a.head.state_dict())
    empty = SparseBatch.from_slot_dicts([{"user_id": [1], "item_id": [5], "recent_items": []}],
                                        slots=cfg.all_slots)
    np.testing.assert_array_equal(a.predict(without), a.predict(empty))
    a.train_step(without)
    assert len(a.tables["item_id"]) == 1  # item 5 only
    b.train_step(with_slot)
    keys = b.tables["item_id"].items()[0].tolist()
    assert keys == [5, 7], keys  # the recent item is an item row under its raw id
    other = deepfm_config(dim=4, mlp=[8], slots=("user_id", "item_id"), recent_items=False)
    assert set(other.slots) == {"user_id", "item_id"} and other.salt == {}


@pytest.mark.parametrize("make", [lr_config, lambda: deepfm_config(dim=8, mlp=[32])], ids=["lr", "deepfm"])
def test_model_learns(ml, make):
    """LR (one shared dim-1 table, salted ids) and DeepFM both learn: held-out AUC well above 0.5."""
    cfg = make()
    m = SparseModel(cfg)
    train, test = np.arange(35_000), np.arange(35_000, len(ml))
    for _ in range(2):
        for b in ml.batches(1024, train):
            loss, probs = m.train_step(b)
            assert np.isfinite(loss) and probs.shape == (b.size,)
    auc = StreamingAUC()
    for b in ml.batches(4096, test):
        auc.update(m.predict(b), b.labels)
    assert auc.value() > 0.62, auc.value()
    if cfg.kind == "lr":
        assert list(m.tables) == ["weights"] and len(m.tables["weights"]) > 1000


def _rare_clicks(rng: np.random.Generator, n: int, clicks: int) -> SparseBatch:
    off = np.arange(n + 1, dtype=np.int64)
    labels = np.zeros(n, np.float32)
    labels[rng.choice(n, clicks, replace=False)] = 1.0
    return SparseBatch(n, {"user_id": rng.integers(0, 10**6, n), "item_id": rng.integers(0, 10**6, n)},
                       {"user_id": off, "item_id": off}, labels=labels)


def test_a_fresh_head_starts_its_bias_at_the_labels_log_odds_and_a_restored_one_keeps_its_own():
    """Clicks are rare (1 in 500): the bias waits at 0 until a click and a non-click were seen, then
    starts at the smoothed log-odds of every label seen, before the batch that brought them is
    scored: that batch's scores are already near the click rate (a head left at 0 scores them near
    1/2 and its rows take the offset)."""
    rng = np.random.default_rng(0)
    cfg = deepfm_config("m", slots=("user_id", "item_id"), recent_items=False)
    m = SparseModel(cfg)
    _, probs = m.train_step(_rare_clicks(rng, 1000, 0))
    assert m.head.bias.item() == 0.0 and probs.mean() > 0.3
    _, probs = m.train_step(_rare_clicks(rng, 1000, 4))
    assert probs.mean() < 0.01, probs.mean()
    assert m.head.bias.item() == pytest.approx(np.log(4.5 / 1996.5), abs=2e-3)  # logit(4.5 / 2001), one Adam step
    _, probs = m.train_step(_rare_clicks(rng, 1000, 2))
    assert probs.mean() < 0.01, probs.mean()
    restored = SparseModel(cfg)
    head = {k: v.clone() for k, v in m.head.state_dict().items()}
    head["bias"].fill_(-1.5)
    restored.head.load_state_dict(head)
    restored.train_step(_rare_clicks(rng, 1000, 4))
    assert restored.head.bias.item() == pytest.approx(-1.5, abs=2e-3)  # one Adam step


def _noise_batch(rng: np.random.Generator, n: int) -> SparseBatch:
    """``user_id`` (200 users) tells the click; ``noise`` (5,000 values) says nothing."""
    off = np.arange(n + 1, dtype=np.int64)
    users = rng.integers(0, 200, n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-(users % 7 - 3.0)))).astype(np.float32)
    return SparseBatch(n, {"user_id": users, "noise": rng.integers(0, 5000, n)}, {"user_id": off, "noise": off},
                       labels=labels)


def test_the_first_order_factors_shrink_a_feature_that_says_nothing_and_restore_across_versions():
    """Each first-order field's learned factor (DenseHead.linear_scale) starts at 1 and learns from
    the examples' progressive scores: a feature that says nothing falls well below the one that
    tells the click. A head without a rate holds its factors where they are (1 when new, a
    restored head's own), so a trainer and a serving replica that differ in the setting score
    alike; neither blocks a restore. A state saved before heads held factors (no key, no optimizer
    group) restores with factors at 1 and a fresh group, as does one with other first-order fields."""
    from trainer.snapshot_store import restore_blockers

    rng = np.random.default_rng(0)
    cfg = deepfm_config("m", slots=("user_id", "noise"), recent_items=False)
    m = SparseModel(cfg)
    for _ in range(60):
        m.train_step(_noise_batch(rng, 1000))
    user, noise = m.head.linear_scale.tolist()
    assert noise < 0.75 < 1.0 < user, (user, noise)
    off = cfg.model_copy(update={"linear_scale_lr": None})
    assert restore_blockers(off, cfg) == [] and restore_blockers(cfg, off) == []
    held = SparseModel(off)
    held.train_step(_noise_batch(rng, 100))
    assert held.head.linear_scale.tolist() == [1.0, 1.0]
    held.load_dense_state(m.dense_state())
    held.train_step(_noise_batch(rng, 100))
    assert held.head.linear_scale.tolist() == [user, noise]  # restored, and held there
    older = m.dense_state()
    older["head"] = {k: v for k, v in older["head"].items() if k != "linear_scale"}
    older["optimizer"] = {**older["optimizer"], "param_groups": older["optimizer"]["param_groups"][:-1]}
    older["optimizer"]["state"] = {k: v for k, v in older["optimizer"]["state"].items()
                                   if k < len(older["optimizer"]["param_groups"][0]["params"])}
    for state in (older, SparseModel(cfg.model_copy(update={"linear": {"user_id": "user_id_w"}})).dense_state()):
        fresh = SparseModel(cfg)
        fresh.load_dense_state(state)
        assert fresh.head.linear_scale.tolist() == [1.0, 1.0]
        assert [g["lr"] for g in fresh.optimizer.param_groups] == [cfg.dense_lr, cfg.linear_scale_lr]
        fresh.train_step(_noise_batch(rng, 100))
        assert fresh.head.linear_scale.tolist() != [1.0, 1.0]


def test_snapshot_round_trip_is_exact(ml, tmp_path):
    """Tables come back with optimizer state and admission sketches: training on continues identically."""
    cfg = deepfm_config(dim=8, mlp=[16], min_count=2)  # admission: sketches matter
    m = SparseModel(cfg)
    batches = list(ml.batches(512, np.arange(6 * 512)))
    for b in batches[:5]:
        m.train_step(b)
    snapshots.save(tmp_path, cfg, m.tables, {"head": m.head.state_dict(), "optimizer": m.optimizer.state_dict()},
                   {"offsets": {}, "sparse_version": 0, "dense_version": 0, "param_deltas_offset": 0})
    saved_keys, saved_values, _, _ = m.tables["item_id"].items()
    tables, dense, man = snapshots.load(tmp_path, cfg, serving=False)
    r = SparseModel(cfg, tables)
    r.head.load_state_dict(dense["head"])
    r.optimizer.load_state_dict(dense["optimizer"])
    for name in cfg.tables:
        a, b = m.tables[name.name].items(), r.tables[name.name].items()
        for x, y in zip(a, b):  # keys, values, optimizer state, times
            np.testing.assert_array_equal(x, y, err_msg=name.name)
    # ids seen once before the snapshot are admitted on their second sighting after it, in both
    m.train_step(batches[5])
    r.train_step(batches[5])
    for name in m.tables:
        for x, y in zip(m.tables[name].items(), r.tables[name].items()):
            np.testing.assert_array_equal(x, y, err_msg=name)
    # serving replicas: same keys and values, no optimizer
    st, _, _ = snapshots.load(tmp_path, cfg, serving=True)
    k, v, _, _ = st["item_id"].items()
    np.testing.assert_array_equal(k, saved_keys)
    np.testing.assert_array_equal(v, saved_values)
    assert st["item_id"].config.optimizer is None


def test_a_restart_from_a_snapshot_learns_on_at_the_configurations_rates(ml, tmp_path):
    """A snapshot brings back what was learned (Adam's moments and steps, the tables' accumulators),
    and the configuration says how to learn on: a ``dense_lr`` or table rate changed in the project
    file holds after the restart (torch's ``load_state_dict`` alone would put the saved rate back)."""
    from trainer.manifest import Manifest

    cfg = deepfm_config(dim=8, mlp=[16])
    m = SparseModel(cfg)
    for b in ml.batches(512, np.arange(3 * 512)):
        m.train_step(b)
    snapshots.save(tmp_path, cfg, m.tables, m.dense_state(), Manifest(max_event_time_ms=1))
    faster = cfg.model_copy(update={"dense_lr": 0.004, "tables": [
        t.model_copy(update={"optimizer": t.optimizer.model_copy(update={"lr": 0.2})}) for t in cfg.tables]})
    tables, dense, _ = snapshots.load(tmp_path, faster, serving=False)
    r = SparseModel(faster, tables)
    r.load_dense_state(dense)
    assert [g["lr"] for g in r.optimizer.param_groups] == [0.004, faster.linear_scale_lr]
    assert [g["lr"] for g in m.optimizer.param_groups] == [cfg.dense_lr, cfg.linear_scale_lr]
    steps = {int(s["step"]) for s in r.optimizer.state.values()}
    assert steps == {int(s["step"]) for s in m.optimizer.state.values()} == {3}  # the moments came back
    assert {t.config.optimizer.lr for t in r.tables.values()} == {0.2}


@pytest.mark.parametrize("kind", ["adagrad", "sgd"])
def test_a_dense_optimizer_changed_since_the_snapshot_starts_fresh_and_the_rest_restores(ml, tmp_path, kind):
    """``dense_optimizer`` edited in the project file: the snapshot's head weights and tables come
    back, the new optimizer starts fresh (Adam's moments mean nothing to it) and learns on. Before,
    the restart was refused (exit 78) until the snapshots were moved aside, losing every table."""
    from trainer.manifest import Manifest
    from trainer.snapshot_store import restore_blockers

    cfg = deepfm_config(dim=8, mlp=[16])
    m = SparseModel(cfg)
    batches = list(ml.batches(512, np.arange(4 * 512)))
    for b in batches[:3]:
        m.train_step(b)
    snapshots.save(tmp_path, cfg, m.tables, m.dense_state(), Manifest(max_event_time_ms=1))
    other = cfg.model_copy(update={"dense_optimizer": kind})
    assert restore_blockers(cfg, other) == []
    tables, dense, _ = snapshots.load(tmp_path, other, serving=False)
    r = SparseModel(other, tables)
    r.load_dense_state(dense)
    assert type(r.optimizer).__name__.lower() == kind
    for a, b in zip(r.head.state_dict().values(), m.head.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)  # the weights came back
    assert all(int(s.get("step", 0)) == 0 for s in r.optimizer.state.values())  # the optimizer is fresh
    before = {k: v.clone() for k, v in r.head.state_dict().items()}
    assert np.isfinite(r.train_step(batches[3])[0])  # and learns on
    assert any(not torch.equal(before[k], v) for k, v in r.head.state_dict().items())


def test_head_slopes_equal_autograd():
    """DenseHead.slopes: each example's input gradient and, from any seed, the head's gradients
    are what autograd gives the same head (one backward pass instead of two)."""
    cfg = deepfm_config(dim=4, mlp=[16, 8], recent_items=False).model_copy(update={"dense_features": ["r", "s"]})
    head = SparseModel(cfg).head
    torch.manual_seed(0)
    emb, dense = torch.randn(32, len(cfg.slots), 4), torch.randn(32, 2)
    seed = torch.randn(32)
    slopes = head.slopes(emb, dense)
    x = emb.clone().requires_grad_(True)
    want = head(x, None, dense, fm=False)
    (jac,) = torch.autograd.grad(want.sum(), x, retain_graph=True)
    torch.testing.assert_close(slopes.logits, want.detach())
    np.testing.assert_allclose(slopes.jac, jac.numpy(), rtol=1e-5, atol=1e-6)
    head.zero_grad(set_to_none=True)
    want.backward(seed)
    # (the dense scaler's statistics are no learned parameters: trainer.dense_scaling; the
    # first-order factors are not in the slopes' logits: the kernel's pooled sums give theirs)
    learned = [(n, p) for n, p in head.named_parameters() if p.requires_grad and n != "linear_scale"]
    expected = {n: p.grad.clone() for n, p in learned}
    head.zero_grad(set_to_none=True)
    slopes.backward(seed)
    assert set(expected) == {n for n, p in learned if p.grad is not None}
    for n, p in learned:
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)
