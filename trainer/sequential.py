"""``SparseModel.train_step`` of a ``sequential`` model (see :mod:`ps.sequential`).

The first-order (linear) weights learn example by example inside the numba kernel: each example
is scored with the weights its predecessors in the batch left, then its own rows are stepped.
With ``sequential_embeddings`` (a DeepFM; the served model) the embedding rows do too
(:mod:`ps.sequential_fm`): the FM term is computed from fresh rows, and each row's MLP gradient
is the batch-start MLP's slope at its example; only the dense head steps once per batch, from
the residuals. Otherwise everything but the first-order weights takes one step per batch from
the batch's start:

* an LR's bias and dense weights, from the mean residual (their exact mean-log-loss gradient);
* a DeepFM's embedding fields and dense head (FM + MLP + bias): their logits are computed once at
  the batch's start and enter the kernel as each example's fixed ``offset``; the residuals the
  kernel returns (``p - y`` with the fresh first-order part) are then back-propagated through them
  as the gradient of the mean log loss, and the embeddings and head step once.

Users and items act in bursts: in a batch of 1024 a user's later examples would otherwise be
scored before the model has learned anything from the earlier ones (``docs/results.md``,
section 4, measures what that costs and what this gains).

What else was measured for the served DeepFM (then dim 16, MLP 128-64; progressive AUC, seed 0,
batch 2048; ml-1m's tuning stream / the whole ml-100k; first-order sequential alone: 0.7854 /
0.7633, with ``sequential_embeddings``: 0.7883 / 0.7678) and why it is not here:

* the embeddings' FM gradient per example but their MLP gradient once per batch (two Adagrad
  steps per row and batch): 0.7879 / 0.7671, below the single per-example step;
* FTRL for the first-order tables (lr 0.2-0.5, l1 0-0.1, l2 0-1, beta 0.1-1): 0.7815-0.7857 /
  0.7577-0.7636, nowhere better than Adagrad 0.3 beyond noise;
* Adagrad's ``initial_accumulator_value`` 0.1 on the first-order tables: +0.0004 on both, and the
  sequential LR gains as much (0.7846 / 0.7640): not a difference between the two (adopted later,
  at 0.3, for new users: :data:`trainer.config.LINEAR_ACC`);
* a global bias learned per example (a first-order field every example holds): no change;
* the dense head's lr from 1e-5 to 1e-2: no change in the 4th decimal (the first-order part
  carries these streams).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ps.sequential import train_linear_sequential
from ps.sequential_fm import train_fm_sequential

from .batch import SparseBatch
from .content import content_field, content_slopes
from .step_checks import NonFiniteStepError, finite_grads
from .torch_quirks import backward


def sequential_train_step(model, batch: SparseBatch) -> tuple[float, np.ndarray]:
    """``(mean loss, probabilities before each example's update)`` for ``model`` (a SparseModel)."""
    if model.cfg.sequential_embeddings:
        return _embeddings_sequential_step(model, batch)
    t0 = time.perf_counter()
    batch = model.complete(batch)
    n, t = batch.size, batch.max_event_time
    blk = model._lin_block
    bags = np.stack([batch.offsets[s] for s in blk.slots])
    mean = np.array([m == "mean" for m in blk.modes], np.bool_)
    head = model.head
    deep = model._emb_block is not None
    dense = model.dense_input(batch) if head.dense_linear is not None else None
    if deep:
        # one gather inserts every table's ids, as the plain step's does; the kernel reads the
        # first-order block's rows itself
        full = model.pack(batch)
        buf = model.ps.gather_packed(full, insert=True, event_time=t)
        k = len(model._emb_block.keys)
        pe, pb = full.segments(0, k), full.segments(k, len(full.slots))
        logits, leaves = model.forward_packed(batch, pe, buf, requires_grad=True, linear=False)
        fixed = logits.detach().double()
    else:
        pb = model.pack(batch, blk)
        with torch.no_grad():
            fixed = head.bias.detach().double().expand(n)
            if dense is not None:
                fixed = fixed + head.dense_linear(dense).squeeze(1).double()
    # the kernel writes rows as it goes: nothing may enter it that is not finite
    if not bool(torch.isfinite(fixed).all()):
        raise NonFiniteStepError("the step's dense logits are not finite; nothing applied")
    t1 = time.perf_counter()
    scale, pooled = _scale(head, n, len(pb.slots), 0)
    probs, loss, resid = train_linear_sequential(model.ps, pb, bags, mean, batch.labels,
                                                 model.io.to_host(fixed), t, insert=not deep,
                                                 scale=scale, pooled=pooled)
    t2 = time.perf_counter()
    r = model.io.to_device(resid.astype(np.float32))
    model.optimizer.zero_grad(set_to_none=True)
    if deep:
        backward(logits, r / max(n, 1))
        if not finite_grads(head) or not math.isfinite(loss):
            raise NonFiniteStepError(f"the step's loss ({loss}) or dense gradients are not finite; "
                                     "the first-order rows were stepped, nothing else applied")
        w = leaves[0][1]
        g = model.io.to_host(w.grad).reshape(-1) if w.grad is not None else np.zeros(w.numel(), np.float32)
        model.ps.apply_packed_gradients(pe, g, t)
    else:
        head.bias.grad = r.mean().reshape(1)
        if dense is not None:
            head.dense_linear.weight.grad = (r.unsqueeze(1) * dense).mean(0, keepdim=True)
    _scale_grad(model, resid, pooled, 0)
    head.stage_moments()
    head.hold_bias()
    model.optimizer.step()
    model.timings["forward"] += t1 - t0
    model.timings["update"] += t2 - t1
    model.timings["backward"] += time.perf_counter() - t2
    return float(loss), probs


def _embeddings_sequential_step(model, batch: SparseBatch) -> tuple[float, np.ndarray]:
    """A ``sequential_embeddings`` DeepFM: every sparse row learns example by example
    (:func:`ps.sequential_fm.train_fm_sequential`, fed the batch-start MLP's logits and slopes);
    the head then steps once from the residuals, and the embeddings take no per-batch step."""
    t0 = time.perf_counter()
    batch = model.complete(batch)
    n, t = batch.size, batch.max_event_time
    eb, lb = model._emb_block, model._lin_block
    full = model.pack(batch)
    buf = model.ps.gather_packed(full, insert=True, event_time=t)
    model.timings["forward"] += time.perf_counter() - t0  # mlp_part adds its own
    k = len(eb.keys)
    c = content_field(model, batch) if model.cfg.content is not None else None
    slopes = model.mlp_part(batch, full.segments(0, k), buf, c)
    fixed, jac, cs = slopes.logits.double(), slopes.jac, None
    if c is not None:  # the content field: its FM terms and slopes at the batch's start (trainer.content)
        cs = content_slopes(model.cfg, c, slopes, len(eb.slots))
        fixed, jac = fixed + cs.cross.double(), cs.jac
    # the kernel writes rows as it goes: nothing may enter it that is not finite
    if not (bool(torch.isfinite(fixed).all()) and np.isfinite(jac).all()):
        raise NonFiniteStepError("the step's dense logits or MLP slopes are not finite; nothing applied")
    bags = np.stack([batch.offsets[s] for s in eb.slots + lb.slots])
    mean = np.array([m == "mean" for m in eb.modes + lb.modes], np.bool_)
    t1 = time.perf_counter()
    scale, pooled = _scale(model.head, n, len(full.slots), k)
    probs, loss, resid = train_fm_sequential(model.ps, full, k, bags, mean, batch.labels, model.io.to_host(fixed), jac,
                                             t, insert=False, scale=scale, pooled=pooled)
    t2 = time.perf_counter()
    seed = model.io.to_device((resid / max(n, 1)).astype(np.float32))
    slopes.backward(seed)  # sets the head's MLP gradients (the encoder's, if any, are set next)
    if cs is not None:
        for p in model.head.content.parameters():
            p.grad = None
        cs.backward(seed)
    _scale_grad(model, resid, pooled, k)
    model.head.stage_moments()
    if not finite_grads(model.head) or not math.isfinite(loss):
        raise NonFiniteStepError(f"the step's loss ({loss}) or dense gradients are not finite; "
                                 "the sparse rows were stepped, nothing else applied")
    model.head.hold_bias()
    model.optimizer.step()
    model.timings["update"] += t2 - t1
    model.timings["backward"] += time.perf_counter() - t2
    return float(loss), probs


def _scale(head, n: int, n_seg: int, k: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """:func:`factor_buffers` of the head's :attr:`DenseHead.linear_scale`."""
    f = head.linear_scale
    return factor_buffers(None if f is None else f.detach().cpu().double().numpy(), n, n_seg, k)


def factor_buffers(factors: np.ndarray | None, n: int, n_seg: int, k: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The sequential kernels' per-segment ``scale`` (the first ``k`` segments, embeddings, 1; the
    first-order ones ``factors``) and a ``pooled`` buffer for ``n`` examples; ``(None, None)``
    without factors. The factors' gradient is then ``resid @ pooled[:, k:]`` over the examples."""
    if factors is None:
        return None, None
    scale = np.ones(n_seg)
    scale[k:] = factors
    return scale, np.empty((n, n_seg))


def _scale_grad(model, resid: np.ndarray, pooled: np.ndarray | None, k: int) -> None:
    """``linear_scale``'s gradient of the mean log loss: each field's pooled sums (as each example
    was scored with them) times the residuals."""
    if pooled is None or not model.head.linear_scale.requires_grad:  # (held where it is)
        return
    g = resid @ pooled[:, k:] / max(resid.size, 1)
    model.head.linear_scale.grad = model.io.to_device(g.astype(np.float32))
