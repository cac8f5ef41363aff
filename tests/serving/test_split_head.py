"""The split head (:mod:`serving.split_head`) scores as the trainer's merged rows do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps import SyncChunk
from serving.model import TrainerModel
from trainer.batch import SparseBatch
from trainer.config import deepfm_config, lr_config

DENSE = {"dense_features": ["price", "hour"]}  # scaled by running statistics (trainer.dense_scaling)


@pytest.mark.parametrize("config", [deepfm_config(dim=4, mlp=[8, 4]), deepfm_config(dim=4, mlp=[]), lr_config(),
                                    deepfm_config(dim=4, mlp=[8, 4]).model_copy(update=DENSE),
                                    lr_config().model_copy(update=DENSE)],
                         ids=["deepfm", "deepfm-no-hidden", "lr", "deepfm-dense", "lr-dense"])
@pytest.mark.parametrize("user", [{"user_id": [5], "gender": [1], "recent_items": [3, 4, 9]}, {}],
                         ids=["user", "no-user-fields"])
def test_split_head_matches_the_merged_rows(config, user) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    model = TrainerModel(config=config)
    with torch.no_grad():
        for p in model.scorer.head.parameters():
            p.normal_(0, 0.3)
        if model.scorer.head.scaler is not None:
            model.scorer.head.scaler.var.uniform_(0.5, 2.0)
    for table in model.tables.values():
        keys = np.arange(0, 50, dtype=np.int64)
        table.apply_sync(SyncChunk(keys, rng.normal(0, 0.3, (50, table.dim)).astype(np.float32),
                                   np.ones(50, np.int64), np.empty(0, np.int64)))
    items = [{"item_id": [int(rng.integers(0, 50))], "genres": list(map(int, rng.integers(0, 50, k)))}
             for k in rng.integers(0, 3, 40)]
    dense = (1000 * rng.lognormal(0, 2, (40, 2))).astype(np.float32) if config.dense_features else None
    want = model.scorer.predict(SparseBatch.from_slot_dicts([{**user, **i} for i in items], dense,
                                                            slots=config.all_slots))
    got = model.score(user, items, dense)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert got.dtype == np.float64 and got.shape == (40,)
