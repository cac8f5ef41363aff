"""Dense features on one scale, whatever their unit: :class:`DenseScaler` standardizes each dense
input by running statistics of the stream (after a signed ``log1p`` by default), so a price in
cents or a view count in the millions reaches the head as it would in dollars or thousands.

Why: the head takes its dense inputs as they come, and a unit nobody tuned to ruins it. Measured on
a synthetic click log whose clicks depend on a per-request amount (log-normal) and a rate in
[0, 1] (60,000 examples; ``tests/trainer/test_dense_scaling.py`` keeps a smaller copy): progressive
AUC 0.720 in the natural unit, 0.638 x100, 0.528 x10,000 (the dense inputs left out: 0.618);
standardized (``standard``) 0.724-0.728 in every unit; after a signed log (``log``, the default: the
amount's effect is logarithmic, as a price's or a count's often is) 0.741-0.750.

The statistics are the head's own parameters (``count``, ``mean``, ``var``, per feature), so
snapshots, dense deltas, N-rank replicas and serving carry them as they carry the weights. They are
not learned by the optimizer: a training forward records its batch's moments (count, sum, sum of
squares) as those parameters' gradients (:meth:`DenseScaler.stage`), every engine reduces them as
it reduces the head's gradients (summed over ranks in sync, aggregated per token in GBA), and the
optimizer's step merges the reduced moments in first (:func:`merge_moments_before_step`) and
leaves them out of its own update. So every replica merges the same global moments, and a batch is
scored with the statistics of the batches before it.

The window is :data:`WINDOW` examples: older batches weigh less once it is full, so the statistics
follow a stream whose scale drifts. A standardized value is clipped to +-:data:`CLIP` standard
deviations: one wild value (a price of 1e30) cannot drive the head's activations to overflow.

>>> s = DenseScaler(2, "log")
>>> x = torch.tensor([[9.0, -1.0], [99.0, 3.0]])
>>> z = s(x); s.stage(); merge(s); s.count.item()  # (a module trains until told otherwise)
2.0
>>> [round(v, 3) for v in s.mean.tolist()], s.count.grad is None
([3.454, 0.347], True)
>>> torch.allclose(s(x), torch.tensor([[-1.0, -1.0], [1.0, 1.0]]), atol=1e-3)
True
>>> bool(np.allclose(scale_numpy(s, x.numpy()), s(x).numpy(), atol=1e-6))
True
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import nn

__all__ = ["CLIP", "WINDOW", "DenseScaler", "merge", "merge_moments_before_step", "scale_numpy"]

#: examples the running statistics weigh at most (older ones fade: the stream's scale may drift)
WINDOW = 100_000
#: a standardized input is clipped to this many standard deviations
CLIP = 8.0
#: below this variance a feature counts as constant: it is centred, not divided
_EPS = 1e-8


class DenseScaler(nn.Module):
    """``forward(x [B, K]) -> [B, K]``: ``(t - mean) / std`` clipped, ``t`` = ``sign(x) log1p(|x|)``
    (``kind="log"``) or ``x`` (``"standard"``). Before any statistics: ``mean`` 0, ``var`` 1."""

    def __init__(self, features: int, kind: Literal["log", "standard"]):
        super().__init__()
        self.log = kind == "log"
        # parameters, not buffers: every engine's gradient plumbing carries their moments (module docstring)
        self.count = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.mean = nn.Parameter(torch.zeros(features), requires_grad=False)
        self.var = nn.Parameter(torch.ones(features), requires_grad=False)
        self._pending: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.log1p(x.abs()).copysign_(x) if self.log else x
        if self.training and torch.is_grad_enabled():  # a training forward: its batch's moments
            d = t.detach()
            self._pending = (t.shape[0], d.sum(0), (d * d).sum(0))
        z = (t - self.mean.detach()).mul_(torch.rsqrt(self.var.detach() + _EPS))
        return z.clamp_(-CLIP, CLIP)

    def stage(self) -> None:
        """The last training forward's moments as the parameters' gradients (count, sums, sums of
        squares), for the engine to reduce with the head's own; nothing when there was none."""
        if self._pending is not None:
            n, total, squares = self._pending
            self.count.grad = torch.full((1,), float(n), device=total.device)
            self.mean.grad, self.var.grad = total, squares
            self._pending = None


def merge(s: DenseScaler) -> None:
    """Merge the moments in ``s``'s gradients (reduced by the engine) into its statistics, and
    clear them (Chan et al.'s pairwise update; the old part weighs at most ``WINDOW - n``)."""
    if s.count.grad is None:
        return
    # in numpy, float64: a handful of numbers, where torch's per-op overhead would cost a tenth of a step
    n, total, squares = (g.detach().cpu().numpy().astype(np.float64) for g in (s.count.grad, s.mean.grad, s.var.grad))
    s.count.grad = s.mean.grad = s.var.grad = None
    n = float(n[0])
    if n <= 0:
        return
    old = min(float(s.count.detach()[0]), max(WINDOW - n, 0.0))
    mean, var = (p.detach().cpu().numpy().astype(np.float64) for p in (s.mean, s.var))
    b_mean = total / n
    b_var = np.maximum(squares / n - b_mean * b_mean, 0.0)
    both = old + n
    new_mean = (old * mean + n * b_mean) / both
    new_var = (old * (var + (mean - new_mean) ** 2) + n * (b_var + (b_mean - new_mean) ** 2)) / both
    with torch.no_grad():
        s.count.fill_(both)
        s.mean.copy_(torch.from_numpy(new_mean.astype(np.float32)))
        s.var.copy_(torch.from_numpy(new_var.astype(np.float32)))


def merge_moments_before_step(head: nn.Module):
    """An optimizer step pre-hook: merge the moments of every :class:`DenseScaler` in ``head`` (so
    the optimizer itself skips those parameters: their gradients are cleared)."""
    scalers = [m for m in head.modules() if isinstance(m, DenseScaler)]

    def hook(optimizer, args, kwargs) -> None:
        for s in scalers:
            merge(s)

    return hook


def scale_numpy(s: DenseScaler, x: np.ndarray) -> np.ndarray:
    """:meth:`DenseScaler.forward` in numpy (serving's split head), float32."""
    x = np.asarray(x, np.float32)
    t = np.sign(x) * np.log1p(np.abs(x)) if s.log else x
    mean = s.mean.detach().cpu().numpy()
    std = np.sqrt(s.var.detach().cpu().numpy() + np.float32(_EPS))
    return np.clip((t - mean) / std, -CLIP, CLIP).astype(np.float32)
