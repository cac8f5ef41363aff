"""A ``sequential`` LR learns each example before scoring the next, through ``SparseModel.train_step``."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

from trainer.config import ModelConfig, deepfm_config, lr_config
from trainer.data import MovieLensData
from trainer.model import SparseModel


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


def test_sequential_is_for_linear_models_only():
    d = deepfm_config(dim=4, mlp=[8]).model_dump()
    d["sequential"] = True
    with pytest.raises(pydantic.ValidationError, match="sequential"):
        ModelConfig.model_validate(d)
    assert ModelConfig.model_validate_json(_cfg(True).model_dump_json()).sequential
