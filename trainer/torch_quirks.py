"""Every torch (2.13) behaviour driftline works around, here only, numbered like
:mod:`services.tansu_quirks`.

1. **torch.optim imports torch.compile's tracer for nothing.** An optimizer's constructor,
   ``zero_grad``, ``state_dict`` and ``load_state_dict`` carry ``torch._disable_dynamo`` (it
   imports ``torch._dynamo`` on its first call, to mark the method as not to be traced), and
   ``step`` imports it on every call (``_use_grad_for_differentiable``, for a graph break).
   Nothing in driftline runs under ``torch.compile``, so the marks do nothing, but the import
   costs ~2.5 s of CPU in every process that builds an optimizer: measured with py-spy on a
   rank of ``trainer online --nproc 2``, 2.6 s of its 9 s start, and a rank group restarts all
   its ranks after a failure. :func:`optimizer_class` returns the torch class with ``step``'s
   own body (gradients off unless ``differentiable``, as torch's wrapper sets them), and the
   disable-marks counted as already made. Bit-for-bit the same updates and state
   (tests/trainer/test_torch_quirks.py, which also fails when a torch upgrade brings the
   import back). Where torch's internals differ (another version), the marks are skipped and
   the optimizer is torch's own: slower to start, same results.
2. **A backward pass from a given gradient imports sympy.** ``t.backward(grad)`` (and
   ``torch.autograd.backward(t, grad)``) checks the gradient's shape with
   ``torch.fx.experimental.symbolic_shapes``, imported on the first call: sympy and torch.fx,
   ~0.9 s of CPU in every trainer process (py-spy, a rank of the same run as quirk 1), for a
   check of symbolic shapes that eager tensors never have. :func:`backward` steps back from
   ``sum(t * grad)`` instead (no explicit gradient: ``t`` receives ``1 * grad``, bit for bit
   ``grad``).

>>> Adam = optimizer_class(torch.optim.Adam)
>>> issubclass(Adam, torch.optim.Adam), Adam.__name__
(True, 'Adam')
>>> model = torch.nn.Linear(3, 1)
>>> opt = Adam(model.parameters(), lr=0.1)
>>> model(torch.ones(2, 3)).sum().backward(); opt.step(); opt.zero_grad()
>>> model.weight.grad is None and opt.state_dict()["state"][0]["step"].item()
1.0
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

__all__ = ["backward", "optimizer_class"]

# torch._compile._disable_dynamo's per-function cache: set, it calls the function as it is
_DISABLED = "__dynamo_disable"
# the functional update each optimizer's step calls (Adam's under torch._disable_dynamo too)
_FUNCTIONAL = {"Adam": ("adam", "adam"), "Adagrad": ("adagrad", "adagrad"), "SGD": ("sgd", "sgd")}


def _mark(fn: Callable[..., Any]) -> bool:
    raw = getattr(fn, "__wrapped__", None)
    if raw is None:
        return False
    if not hasattr(raw, _DISABLED):
        setattr(raw, _DISABLED, raw)
    return True


def _mark_all() -> bool:
    """Whether the four methods carried the marks (torch's version as this module knows it)."""
    for module, name in _FUNCTIONAL.values():
        fn = getattr(importlib.import_module(f"torch.optim.{module}"), name, None)
        if fn is not None:
            _mark(fn)
    methods = (Optimizer.add_param_group, Optimizer.zero_grad, Optimizer.state_dict, Optimizer.load_state_dict)
    return all([_mark(fn) for fn in methods])


_marked = _mark_all()


@functools.cache
def optimizer_class(base: type[Optimizer]) -> type[Optimizer]:
    """``base`` (``torch.optim.Adam``, ``Adagrad`` or ``SGD``) without quirk 1's import."""
    raw_step = inspect.unwrap(base.step)
    if not _marked or base.__name__ not in _FUNCTIONAL or raw_step is base.step:
        return base

    class WithoutTracer(base):
        def step(self, closure: Callable[[], float] | None = None) -> Any:
            with torch.set_grad_enabled(self.defaults["differentiable"]):  # as torch's step does
                return raw_step(self, closure)

    WithoutTracer.__name__ = WithoutTracer.__qualname__ = base.__name__
    return WithoutTracer


def backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``out.backward(grad)`` (``grad`` of ``out``'s shape) without quirk 2's import.

    >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> backward(x * 3, torch.tensor([0.5, -1.0])); x.grad.tolist()
    [1.5, -3.0]
    """
    if grad.shape != out.shape:
        raise ValueError(f"a gradient of shape {tuple(grad.shape)} for an output of shape {tuple(out.shape)}")
    (out * grad).sum().backward()
