"""A content encoder (``ModelConfig.content``): an item's content (a bag of token ids: title words,
genres, ...) becomes a vector of the model's dim, joined to the DeepFM's embedding fields.

:class:`ContentEncoder` mean-pools the tokens' embeddings (a torch ``EmbeddingBag`` over
``buckets`` rows, token ids taken modulo ``buckets``) and runs a small MLP to the model's ``dim``.
It lives in the :class:`trainer.head.DenseHead` (``head.content``), so its parameters are dense
parameters: the head's optimizer steps them, and snapshots, dense deltas and the N-rank engine's
all-reduce of the head's gradients carry them with no path of their own.

How it joins (``join``): ``item`` (the default) adds the output to the item slot's pooled field,
so a new item's representation is its near-zero fresh row plus what its content says, and the row
learns what the content does not; ``field`` makes it one more field (the FM pairs it with every
other field, the MLP reads it). Measured on ``driftline eval coldstart``'s stream (ml-1m's first
300k ratings, the served model, 5 seeds; paired difference with ``served`` on cold items' first 10
examples, mean +- std over seeds):

==========================================  ==================  ==================
encoder (token_dim 16, buckets 2^14)        ``join = "field"``  ``join = "item"``
==========================================  ==================  ==================
MLP [32], the head's Adam rate 1e-3         -0.0019 +- 0.0017   +0.0004 +- 0.0025
MLP [32], rate 1e-2                         -0.0009 +- 0.0023   -0.0002 +- 0.0025
linear (``hidden = []``)                    -0.0009 +- 0.0017   +0.0021 +- 0.0014
==========================================  ==================  ==================

(``item`` with a linear encoder also: rate 1e-2 +0.0006 +- 0.0014, 3e-3 with [32] -0.0006 +-
0.0021, token_dim 8 +0.0014 +- 0.0020, 4096 buckets of 8 with [32] -0.0002 +- 0.0015; token
initial std 0 or 0.01 instead of 0.1: +0.0022, +0.0023; with [32] and std 0: +0.0004.) ``item`` was as good or better in
every pair and a linear encoder the best: the defaults. None is 3 std above ``served``: ml-1m's
titles say little that genres (a slot already) do not, as a mean-pooled title-word slot found
before. These were chosen on the very stream they are reported on (thirteen variants): the best
figure is an optimistic one. Every variant scores a cold item's *first* example a little worse
(-0.004 to -0.007 over 196 examples).

Sequential embeddings (:mod:`ps.sequential_fm`): the kernel learns the PS rows example by
example with the FM among the PS fields from fresh rows. The encoder's output ``c`` is constant
within a batch (the encoder steps once per batch, like the head), so its FM terms with the PS
fields are taken at the batch's start like the MLP: ``c . S`` as a field (``S`` the PS fields'
sum), ``c . (S - x_item)`` added to the item's field; they enter the kernel's fixed offset, and
``c`` joins the MLP slope of every PS field it meets (``d(c . S)/d x_f = c``). The encoder's
gradient is ``seed * (the MLP's slope at c + what c meets)`` (:func:`content_slopes`). At batch 1
that is the plain DeepFM's step exactly (tests/trainer/test_content.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .config import ContentConfig
from .torch_quirks import backward

__all__ = ["ContentEncoder", "ContentSlopes", "content_slopes", "content_field", "join_content"]


class ContentEncoder(nn.Module):
    """``forward(ids int64 [n], starts int64 [B]) -> [B, dim]``: the bags ``ids[starts[i]:starts[i+1]]``
    (``EmbeddingBag``'s layout), mean-pooled token embeddings through the MLP. An empty bag pools
    to zeros (the MLP's output at zero: what an item without content gets)."""

    def __init__(self, cfg: ContentConfig, dim: int):
        super().__init__()
        self.buckets = cfg.buckets
        self.tokens = nn.EmbeddingBag(cfg.buckets, cfg.token_dim, mode="mean")
        # small tokens (not EmbeddingBag's N(0, 1)): a new item's never-trained words add little
        # noise (std 0 and 0.01 measured the same as 0.1 on ml-1m's cold items)
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
            backward(self.c, seed.reshape(-1, 1) * self.slope)


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
