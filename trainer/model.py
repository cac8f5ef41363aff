"""Models: sparse parameters in PS tables, dense parameters in torch.

:class:`DenseHead` is the torch part (DeepFM or LR head) over pooled slot embeddings.
:class:`SparseModel` joins it with the PS tables: one ``gather`` per table per batch (all slots
of a table packed into one call), embedding-bag pooling in torch, and one ``apply_gradients``
per table after ``backward``. No per-example Python loops.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import EmbeddingTable

from .batch import SparseBatch
from .config import ModelConfig


class DenseHead(nn.Module):
    """``forward(emb [B, F, D] or None, lin [B, L] or None, dense [B, K] or None) -> logits [B]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.kind = cfg.kind
        self.bias = nn.Parameter(torch.zeros(1))
        nf, d, nd = len(cfg.slots), cfg.embed_dim, len(cfg.dense_features)
        self.dense_linear = nn.Linear(nd, 1, bias=False) if nd else None
        if cfg.kind == "deepfm":
            layers: list[nn.Module] = []
            width = nf * d + nd
            for h in cfg.mlp:
                layers += [nn.Linear(width, h), nn.ReLU()]
                width = h
            layers.append(nn.Linear(width, 1))
            self.mlp = nn.Sequential(*layers)
        else:
            self.mlp = None

    def forward(self, emb, lin, dense):
        out = self.bias.expand(_batch(emb, lin, dense))
        if lin is not None:
            out = out + lin.sum(1)
        if dense is not None and self.dense_linear is not None:
            out = out + self.dense_linear(dense).squeeze(1)
        if self.mlp is not None and emb is not None:
            s = emb.sum(1)
            fm = 0.5 * (s * s - (emb * emb).sum(1)).sum(1)
            x = emb.flatten(1)
            if dense is not None:
                x = torch.cat([x, dense], 1)
            out = out + fm + self.mlp(x).squeeze(1)
        return out


def _batch(*xs):
    for x in xs:
        if x is not None:
            return x.shape[0]
    raise ValueError("no input")


def make_tables(cfg: ModelConfig, serving: bool = False) -> dict[str, EmbeddingTable]:
    return {t.name: EmbeddingTable(t.serving() if serving else t) for t in cfg.tables}


def make_dense_optimizer(cfg: ModelConfig, head: DenseHead) -> torch.optim.Optimizer:
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[cfg.dense_optimizer]
    return cls(head.parameters(), lr=cfg.dense_lr)


class SparseModel:
    """A model = config + PS tables + torch head. ``forward`` for scoring, ``train_step`` to learn."""

    def __init__(self, cfg: ModelConfig, tables: dict[str, EmbeddingTable] | None = None,
                 head: DenseHead | None = None, train: bool = True):
        self.cfg = cfg
        self.tables = tables if tables is not None else make_tables(cfg, serving=not train)
        self.head = head if head is not None else DenseHead(cfg)
        self.optimizer = make_dense_optimizer(cfg, self.head) if train else None
        self._layout = cfg.table_slots()
        self._salts = cfg.salts()
        self._emb_slots = list(cfg.slots)
        self._lin_slots = list(cfg.linear)
        self.timings: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------ forward
    def _packed_ids(self, batch: SparseBatch) -> dict[str, tuple[np.ndarray, list[tuple[str, str, int, int]]]]:
        """table -> (all ids of its slots concatenated, [(role, slot, start, end)])."""
        out = {}
        for table, uses in self._layout.items():
            parts, spans, pos = [], [], 0
            for role, slot in uses:
                ids = batch.ids[slot]
                salt = self._salts[(table, slot)]
                parts.append(ids ^ salt if salt else ids)
                spans.append((role, slot, pos, pos + ids.size))
                pos += ids.size
            out[table] = (np.concatenate(parts) if len(parts) > 1 else parts[0], spans)
        return out

    def forward(self, batch: SparseBatch, *, insert: bool = False, event_time: int | None = None):
        """Logits ``[B]`` and the gathered leaves ``{table: (ids, tensor)}`` (requires_grad when inserting)."""
        t0 = time.perf_counter()
        packed = self._packed_ids(batch)
        leaves = {}
        pooled: dict[tuple[str, str], torch.Tensor] = {}
        for table, (ids, spans) in packed.items():
            w = torch.from_numpy(self.tables[table].gather(ids, insert=insert, event_time=event_time))
            if insert:
                w.requires_grad_(True)
            leaves[table] = (ids, w)
        t1 = time.perf_counter()
        for table, (ids, spans) in packed.items():
            w = leaves[table][1]
            for role, slot, a, b in spans:
                offs = torch.from_numpy(batch.offsets[slot])
                mode = self.cfg.pooling.get(slot, "sum")
                idx = torch.arange(a, b, dtype=torch.int64)
                pooled[(role, slot)] = F.embedding_bag(idx, w, offs[:-1], mode=mode)
                # embedding_bag's last bag runs to the end of idx, which is this slot's span: correct.
        emb = torch.stack([pooled[("emb", s)] for s in self._emb_slots], 1) if self._emb_slots else None
        lin = torch.cat([pooled[("lin", s)] for s in self._lin_slots], 1) if self._lin_slots else None
        dense = torch.from_numpy(batch.dense) if batch.dense is not None and self.cfg.dense_features else None
        logits = self.head(emb, lin, dense)
        self.timings["lookup"] += t1 - t0
        self.timings["forward"] += time.perf_counter() - t1
        return logits, leaves

    @torch.no_grad()
    def predict(self, batch: SparseBatch) -> np.ndarray:
        """Probabilities (no insertion, no learning)."""
        logits, _ = self.forward(batch, insert=False)
        return torch.sigmoid(logits).numpy()

    # ------------------------------------------------------------------ training
    def train_step(self, batch: SparseBatch, scores_out: bool = False):
        """One step on ``batch``: returns ``(mean loss, probabilities before the update)``."""
        assert self.optimizer is not None, "not a training model"
        t = batch.max_event_time
        logits, leaves = self.forward(batch, insert=True, event_time=t)
        labels = torch.from_numpy(batch.labels)
        t1 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        t2 = time.perf_counter()
        for table, (ids, w) in leaves.items():
            if w.grad is not None:
                self.tables[table].apply_gradients(ids, w.grad.numpy(), t)
        self.timings["backward"] += t2 - t1
        self.timings["update"] += time.perf_counter() - t2
        return float(loss.detach()), torch.sigmoid(logits.detach()).numpy()
