"""What a training step checks before it applies anything: its loss and its dense gradients are
finite. Both steps use it: the mini-batch step (:mod:`trainer.model`) and the sequential one
(:mod:`trainer.sequential`).

>>> import torch
>>> m = torch.nn.Linear(2, 1)
>>> m(torch.ones(1, 2)).sum().backward()
>>> finite_grads(m)
True
>>> m.weight.grad[0, 0] = float("nan")
>>> finite_grads(m)
False
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["NonFiniteStepError", "finite_grads"]


class NonFiniteStepError(ValueError):
    """A training step's loss or dense gradients are NaN or infinite; nothing was applied."""


def finite_grads(module: nn.Module) -> bool:
    """Whether every gradient of ``module``'s parameters is finite (one reduction per tensor)."""
    return all(bool(torch.isfinite(p.grad).all()) for p in module.parameters() if p.grad is not None)
