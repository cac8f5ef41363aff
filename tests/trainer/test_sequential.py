"""A ``sequential`` model learns each example's first-order weights before scoring the next, through
``SparseModel.train_step``: an LR entirely, a DeepFM's first-order part (embeddings and head per batch)."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch

from trainer.config import SPARSE_ACC, ModelConfig, deepfm_config, lr_config
from trainer.data import MovieLensData
from trainer.model import NonFiniteStepError, SparseModel


@pytest.fixture(scope="module")
def ml() -> MovieLensData:
    return MovieLensData(limit=3_000)


def _cfg(sequential: bool) -> ModelConfig:
    d = lr_config(lr=0.3, sequential=sequential).model_dump()
    d["pooling"]["genres"] = "mean"
    return ModelConfig.model_validate(d)


def test_batch_of_examples_equals_batch_size_one_plain_lr(ml):
    """Sequential at batch 1 and plain LR at batch 1 are the same model (genres mean-pooled, the
    absent ``recent_items`` as empty bags); sequential at batch 64 scores every example with the
    sparse weights its predecessors left, so only the once-per-batch bias separates it from them."""
    rows = np.arange(400)
    plain, seq1, seq64 = SparseModel(_cfg(False)), SparseModel(_cfg(True)), SparseModel(_cfg(True))
    for m in (plain, seq1, seq64):  # started alike (batch 1 and 64 start it at different times: DenseHead.start_bias)
        m.head.bias.data.fill_(0.5)
    p_plain = np.concatenate([plain.train_step(b)[1] for b in ml.batches(1, rows)])
    p_seq1 = np.concatenate([seq1.train_step(b)[1] for b in ml.batches(1, rows)])
    p_seq64 = np.concatenate([seq64.train_step(b)[1] for b in ml.batches(64, rows)])
    np.testing.assert_allclose(p_seq1, p_plain, rtol=1e-4, atol=1e-5)
    for a, b in zip(seq1.tables["weights"].items(), plain.tables["weights"].items()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert np.abs(p_seq64 - p_plain).max() < 0.05
    assert float(seq1.head.bias.detach()) != 0.0 and seq64.tables["weights"].pending_updates == len(seq64.tables["weights"])


def test_loss_is_the_pre_update_log_loss(ml):
    m = SparseModel(_cfg(True))
    b = ml.batch(np.arange(256))
    loss, p = m.train_step(b)
    want = -np.mean(b.labels * np.log(p) + (1 - b.labels) * np.log(1 - p))
    assert loss == pytest.approx(want, rel=1e-4)


def test_sequential_needs_first_order_fields():
    d = deepfm_config(dim=4, mlp=[8]).model_dump()
    d["linear"] = {}
    d["tables"] = [t for t in d["tables"] if not t["name"].endswith("_w")]
    with pytest.raises(pydantic.ValidationError, match="sequential"):
        ModelConfig.model_validate(d)
    d["sequential"] = d["sequential_embeddings"] = False
    ModelConfig.model_validate(d)
    assert ModelConfig.model_validate_json(_cfg(True).model_dump_json()).sequential


def test_sequential_embeddings_need_a_sequential_deepfm_on_sgd_or_adagrad():
    d = deepfm_config(dim=4, mlp=[8]).model_dump()
    assert d["sequential_embeddings"]
    with pytest.raises(pydantic.ValidationError, match="needs a sequential deepfm"):
        ModelConfig.model_validate({**d, "sequential": False})
    d["tables"][0]["optimizer"] = {"kind": "adam", "lr": 0.01}
    with pytest.raises(pydantic.ValidationError, match="must use sgd or adagrad.*sequential_embeddings = false"):
        ModelConfig.model_validate(d)
    assert not ModelConfig.model_validate({**d, "sequential_embeddings": False}).sequential_embeddings
    with pytest.raises(pydantic.ValidationError, match="needs a sequential deepfm"):
        ModelConfig.model_validate({**lr_config(sequential=True).model_dump(), "sequential_embeddings": True})


def test_deepfm_later_examples_see_earlier_embedding_steps(ml):
    """With sequential embeddings a repeated example is scored with the FM and first-order steps
    its earlier copies took; with the first-order part alone its later copies move less."""
    b = ml.batch(np.array([0] * 8))
    _, p_emb = SparseModel(_deepfm(True)).train_step(b)
    lin = deepfm_config(dim=4, mlp=[8], sequential=True, sequential_embeddings=False, seed=0)
    _, p_lin = SparseModel(lin).train_step(b)
    assert p_emb[0] == pytest.approx(p_lin[0], abs=1e-6)  # the first copy: nothing learned yet
    assert abs(p_emb[-1] - p_emb[0]) > abs(p_lin[-1] - p_lin[0])


def _deepfm(sequential: bool, seed: int = 0) -> ModelConfig:
    # one embedding accumulator for both (deepfm_config's default differs by engine: SPARSE_ACC)
    return deepfm_config(dim=4, mlp=[8], sequential=sequential, seed=seed, acc=SPARSE_ACC)


def test_deepfm_batch_size_one_equals_plain_deepfm(ml):
    """At batch 1 there is nothing to be fresher than: the sequential DeepFM is the plain one
    (same rows, same head), up to float summation order."""
    rows = np.arange(200)
    plain, seq = SparseModel(_deepfm(False)), SparseModel(_deepfm(True))
    p_plain = np.concatenate([plain.train_step(b)[1] for b in ml.batches(1, rows)])
    p_seq = np.concatenate([seq.train_step(b)[1] for b in ml.batches(1, rows)])
    np.testing.assert_allclose(p_seq, p_plain, rtol=1e-4, atol=1e-5)
    for name, table in plain.tables.items():
        for a, b in zip(seq.tables[name].items(), table.items()):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5, err_msg=name)
    for a, b in zip(seq.head.parameters(), plain.head.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-3, atol=1e-5)


def test_deepfm_later_examples_see_earlier_first_order_steps(ml):
    """Within one batch, a repeated example is scored with the first-order step its earlier copy
    took (the deep part is the batch's start for both); the plain DeepFM scores both the same."""
    b = ml.batch(np.array([0] * 8))
    label = float(b.labels[0])
    _, p_seq = SparseModel(_deepfm(True)).train_step(b)
    _, p_plain = SparseModel(_deepfm(False)).train_step(b)
    assert np.ptp(p_plain) == 0
    steps = np.diff(p_seq)
    assert ((steps > 0) if label == 1.0 else (steps < 0)).all()


def test_deepfm_rows_reach_sync_and_a_non_finite_head_applies_nothing(ml):
    m = SparseModel(_deepfm(True))
    b = ml.batch(np.arange(64))
    m.train_step(b)
    for name, table in m.tables.items():  # every touched row of every table is queued for the deltas
        assert table.pending_updates == len(table), name
    before = {n: t.items() for n, t in m.tables.items()}
    head = [p.detach().clone() for p in m.head.parameters()]
    with torch.no_grad():
        m.head.bias.fill_(float("nan"))
    with pytest.raises(NonFiniteStepError):
        m.train_step(b)  # the same rows: nothing new to insert either
    for n, t in m.tables.items():
        for a, c in zip(t.items(), before[n]):
            np.testing.assert_array_equal(a, c, err_msg=n)
    for p, q in zip(list(m.head.parameters())[1:], head[1:]):
        assert torch.equal(p, q)
