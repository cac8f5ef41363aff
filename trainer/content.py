"""A content encoder (``ModelConfig.content``): an item's content (a bag of token ids: title words,
genres, ...) becomes one more embedding field of the DeepFM.

:class:`ContentEncoder` mean-pools the tokens' embeddings (a torch ``EmbeddingBag`` over
``buckets`` rows, token ids taken modulo ``buckets``) and runs a small MLP to the model's ``dim``.
It lives in the :class:`trainer.head.DenseHead` (``head.content``), so its parameters are dense
parameters: the head's optimizer steps them, and snapshots, dense deltas and the N-rank engine's
all-reduce of the head's gradients carry them with no path of their own.

Why a field of its own and not added to the item's id row: an item the PS has never seen starts
with a near-zero random row and a zero first-order weight; its content field is informative from
the item's first request, and as a separate field the FM pairs it with every user field (and the
MLP reads it) while the id row learns what the content does not say. (Added to the id row the
two would share one FM slot: the id row's Adagrad steps then chase what the encoder already
gives, and the sequential kernel would need the encoder's part of every row.)

Sequential embeddings (:mod:`ps.sequential_fm`): the kernel learns the PS rows example by
example with the FM among the PS fields from fresh rows. The content field is constant within a
batch (the encoder steps once per batch, like the head), so its FM terms with the other fields,
``c . S`` (``S`` the sum of the PS fields), are taken at the batch's start like the MLP: they
enter the kernel's fixed offset, and ``c`` joins every PS field's MLP slope (``d(c . S)/d x_f =
c``). The encoder's gradient is then ``seed * (MLP slope at c + S)`` (:func:`content_slopes`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .config import ContentConfig

__all__ = ["ContentEncoder", "ContentSlopes", "content_slopes", "content_field", "join_content"]


class ContentEncoder(nn.Module):
    """``forward(ids int64 [n], starts int64 [B]) -> [B, dim]``: the bags ``ids[starts[i]:starts[i+1]]``
    (``EmbeddingBag``'s layout), mean-pooled token embeddings through the MLP. An empty bag pools
    to zeros (the MLP's output at zero: what an item without content gets)."""

    def __init__(self, cfg: ContentConfig, dim: int):
        super().__init__()
        self.buckets = cfg.buckets
        self.tokens = nn.EmbeddingBag(cfg.buckets, cfg.token_dim, mode="mean")
        # small tokens: the field starts near the scale of the PS rows (0.01), not at N(0, 1)
        nn.init.normal_(self.tokens.weight, std=0.1)
        layers: list[nn.Module] = []
        width = cfg.token_dim
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, dim))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.tokens(torch.remainder(ids, self.buckets), starts))


def content_field(model, batch) -> torch.Tensor:
    """``[B, dim]``: the encoder's output for each example of ``batch`` (a completed batch: its
    content slot present, empty bags where an example has none) on ``model``'s device."""
    if model.content_source is not None:  # N ranks: the owners' encoder (trainer.dist.content)
        return model.content_source(batch)
    slot = model.cfg.content.slot
    ids, offsets = batch.ids[slot], batch.offsets[slot]
    return model.head.content(model.io.to_device(ids), model.io.to_device(np.ascontiguousarray(offsets[:-1])))


def join_content(cfg, emb: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The pooled fields ``emb`` ``[B, F, D]`` with the encoder's output ``c`` ``[B, D]`` joined as
    ``cfg.content.join`` says: one more (last) field, or added to the item slot's field."""
    if cfg.content.join == "field":
        return torch.cat([emb, c.unsqueeze(1)], 1)
    i = list(cfg.slots).index(cfg.content.item_slot)
    return torch.cat([emb[:, :i], (emb[:, i] + c).unsqueeze(1), emb[:, i + 1:]], 1)


class ContentSlopes:
    """What a sequential-embeddings step needs of the encoder's output ``c`` ``[B, D]`` (with its
    graph), given the batch-start MLP slopes over the ``nf`` PS fields with ``c`` joined:

    * ``cross`` ``[B]``: the FM terms with ``c`` at the batch's start, ``c . S`` (``S`` the PS
      fields' sum) joined as a field, ``c . (S - x_item)`` added to the item's field (into the
      kernel's fixed offset);
    * ``jac`` float32 ``[B, nf, D]``: the PS fields' slopes, each plus ``c`` (the item's own
      field excepted when ``c`` is added to it: its FM term with ``c`` is not there);
    * :meth:`backward` (``seed`` ``[B]``): the encoder's gradient of ``sum(seed * logits)``."""

    def __init__(self, c: torch.Tensor, cross: torch.Tensor, jac: np.ndarray, slope: torch.Tensor):
        self.c, self.cross, self.jac, self.slope = c, cross, jac, slope

    def backward(self, seed: torch.Tensor) -> None:
        if self.c.requires_grad:
            self.c.backward(seed.reshape(-1, 1) * self.slope)


def content_slopes(cfg, c: torch.Tensor, slopes, nf: int) -> ContentSlopes:
    """:class:`ContentSlopes` from ``slopes`` (:class:`trainer.head.HeadSlopes` of the head whose
    MLP input is the ``nf`` PS fields with ``c`` joined (:func:`join_content`), then the dense
    features)."""
    b, d = c.shape
    cd = c.detach()
    x0 = slopes.inputs[0][:, :nf * d].reshape(b, nf, d)  # the fields at the batch's start
    add = np.broadcast_to(cd.cpu().numpy()[:, None, :], (b, nf, d)).copy()
    if cfg.content.join == "field":
        other = x0.sum(1)  # what c meets in the FM: every PS field
        slope = torch.from_numpy(np.ascontiguousarray(slopes.jac[:, nf])).to(c.device) + other
    else:
        i = list(cfg.slots).index(cfg.content.item_slot)
        other = x0.sum(1) - x0[:, i]  # every field but the item's (x0's item field holds c too)
        add[:, i] = 0.0
        slope = torch.from_numpy(np.ascontiguousarray(slopes.jac[:, i])).to(c.device) + other
    jac = np.ascontiguousarray(slopes.jac[:, :nf] + add, np.float32)
    return ContentSlopes(c, (cd * other).sum(1), jac, slope)
