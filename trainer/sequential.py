"""``SparseModel.train_step`` of a ``sequential`` LR (see :mod:`ps.sequential`).

The sparse weights learn example by example inside the numba kernel; what torch holds (bias,
dense weights) is global and takes one optimizer step per batch from the mean residual, its
exact mean-log-loss gradient at the batch's start.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ps.sequential import train_linear_sequential

from .batch import SparseBatch


def sequential_train_step(model, batch: SparseBatch) -> tuple[float, np.ndarray]:
    """``(mean loss, probabilities before each example's update)`` for ``model`` (a SparseModel)."""
    t0 = time.perf_counter()
    batch = model.complete(batch)
    pb = model.pack(batch)
    blk = model._lin_block
    n = batch.size
    bags = (np.stack([batch.offsets[s] for s in blk.slots]) if blk is not None
            else np.zeros((0, n + 1), np.int64))
    mean = np.array([m == "mean" for m in blk.modes] if blk is not None else [], np.bool_)
    head = model.head
    dense = (torch.from_numpy(batch.dense) if batch.dense is not None and model.cfg.dense_features
             and head.dense_linear is not None else None)
    with torch.no_grad():
        fixed = head.bias.detach().double().expand(n)
        if dense is not None:
            fixed = fixed + head.dense_linear(dense).squeeze(1).double()
    hook = getattr(model, "before_backward", None)
    if hook is not None:
        hook()
    t1 = time.perf_counter()
    probs, loss, resid = train_linear_sequential(model.ps, pb, bags, mean, batch.labels,
                                                 fixed.numpy(), batch.max_event_time)
    t2 = time.perf_counter()
    r = torch.from_numpy(resid.astype(np.float32))
    head.bias.grad = r.mean().reshape(1)
    if dense is not None:
        head.dense_linear.weight.grad = (r.unsqueeze(1) * dense).mean(0, keepdim=True)
    model.optimizer.step()
    model.timings["forward"] += t1 - t0
    model.timings["update"] += t2 - t1
    model.timings["backward"] += time.perf_counter() - t2
    return float(loss), probs
