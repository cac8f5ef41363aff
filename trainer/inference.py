"""Scoring API for serving: the same model code as training, read-only tables.

>>> from trainer.config import deepfm_config
>>> from trainer.batch import SparseBatch
>>> cfg = deepfm_config(dim=4, mlp=[8])
>>> s = Scorer(cfg)   # empty serving tables, freshly initialised dense head
>>> p = s.predict(SparseBatch.from_slot_dicts([{"user_id": [1], "genres": [3, 4]}], slots=cfg.all_slots))
>>> p.shape, bool(0 < p[0] < 1)
((1,), True)
"""

from __future__ import annotations

import numpy as np
import torch

from ps import EmbeddingTable

from .batch import SparseBatch
from .config import ModelConfig
from .head import DenseHead
from .model import SparseModel, make_tables


class Scorer:
    """``Scorer(config, tables=None, dense_state=None)``; ``predict(batch) -> np.ndarray`` of probabilities.

    ``tables``: name -> :class:`ps.EmbeddingTable` (serving replicas kept fresh with
    :func:`trainer.sync.apply_delta`); missing ones are created empty. ``dense_state``: a torch
    state_dict (from :func:`trainer.sync.decode_dense` or a snapshot); ``load_dense`` swaps it later.
    Absent ids score with zero embeddings. Thread-safe for concurrent ``predict`` calls
    (tables lock per shard; the head is only read).
    """

    def __init__(self, config: ModelConfig, tables: dict[str, EmbeddingTable] | None = None,
                 dense_state: dict[str, torch.Tensor] | None = None):
        self.config = config
        tables = dict(tables or {})
        for name, t in make_tables(config, serving=True).items():
            tables.setdefault(name, t)
        self.tables = tables
        self.head = DenseHead(config)
        if dense_state is not None:
            self.head.load_state_dict(dense_state)
        self.head.eval()
        self._model = SparseModel(config, tables, self.head, train=False)

    @property
    def slots(self) -> list[str]:
        return self.config.all_slots

    def load_dense(self, dense_state: dict[str, torch.Tensor]) -> None:
        head = DenseHead(self.config)
        head.load_state_dict(dense_state)
        head.eval()
        self.head = head
        self._model = SparseModel(self.config, self.tables, head, train=False)

    def predict(self, batch: SparseBatch) -> np.ndarray:
        return self._model.predict(batch)

    def predict_slot_dicts(self, rows, dense=None) -> np.ndarray:
        return self.predict(SparseBatch.from_slot_dicts(rows, dense, slots=self.slots))
