"""The trainer's dense head (:class:`trainer.head.DenseHead`) applied to one ``/rank`` request with
the user's part computed once, not once per candidate, in numpy.

:meth:`serving.model.TrainerModel.score` pools one batch whose row 0 holds the user's fields and
whose rows 1..n hold the candidates' (each field belongs to one side: the other side's bag is
empty and pools to zero). The head's input for candidate ``i`` is ``row 0 + row i``, and every
term of the head but the MLP's hidden layers is a sum over fields, so it splits:

* first order: ``sum(a * lin[0]) + sum(a * lin[i])`` (``a`` the head's learned factor per
  first-order field, :attr:`trainer.head.DenseHead.linear_scale`; 1 without);
* FM: with ``s = sum_f e_f`` and ``q = sum_f e_f * e_f``, a field is zero on one side, so
  ``s_i' = s_0 + s_i`` and ``q_i' = q_0 + q_i``;
* MLP first layer: ``W x' + b = (W_user x_0 + b) + W_items x_i``: the user's columns once per
  request, each candidate only through its own fields' columns (for ml-1m's DeepFM, 3 of 9
  fields: the widest matrix product shrinks 3x).

Why numpy for the small operations: at batch 100 the head is a dozen of them, and torch's
dispatch costs several microseconds more per operation than numpy's. The matrix products stay in
torch (on the same memory, no copy): numpy's OpenBLAS would start its own threads (one per core)
and, on a busy machine, spend 5x the CPU time waiting for them; serving runs torch on one thread.
The weights are laid out once per dense version and field split (:class:`SplitHead`, cached by
the model).

The result equals the merged rows' logits up to float32 rounding (the additions happen in another
order): relative differences of ~1e-7, checked against the trainer's ``predict``
(``tests/serving/test_trainer_model.py``, ``tests/serving/test_split_head.py``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from trainer.dense_scaling import scale_numpy
from trainer.head import DenseHead


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float32, copy=True)


def _mm(a: np.ndarray, b: torch.Tensor) -> np.ndarray:
    """``a @ b`` by torch (one thread), as numpy."""
    return torch.mm(torch.from_numpy(np.ascontiguousarray(a)), b).numpy()


class SplitHead:
    """``head``'s weights laid out for a split forward: the user fields ``user_fields`` of a head
    over the embedding fields ``fields`` (in the head's input order) of dimension ``dim``."""

    def __init__(self, head: DenseHead, fields: list[str], user_fields: frozenset[str], dim: int) -> None:
        self.bias = float(head.bias.detach()[0])
        self.dense_w = None if head.dense_linear is None else torch.from_numpy(_np(head.dense_linear.weight).T.copy())
        self.lin_scale = None if head.linear_scale is None else _np(head.linear_scale)
        # the dense features' scale as of this dense version (trainer.dense_scaling): a copy, as the weights
        self.scaler = copy.deepcopy(head.scaler) if head.scaler is not None else None
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.user_w: torch.Tensor | None = None
        self.item_w: torch.Tensor | None = None
        self.dense_first: torch.Tensor | None = None
        self.first_b: torch.Tensor | None = None
        self.item_fields: list[int] = [i for i, f in enumerate(fields) if f not in user_fields]
        if head.mlp is None:
            return
        linears = [m for m in head.mlp if isinstance(m, nn.Linear)]
        assert all(isinstance(m, (nn.Linear, nn.ReLU)) for m in head.mlp), "a DenseHead MLP: Linear and ReLU"
        first = linears[0]
        width = len(fields) * dim
        w = _np(first.weight)
        self.user_w = torch.from_numpy(np.ascontiguousarray(w[:, :width].T))
        cols = [i * dim + d for i in self.item_fields for d in range(dim)]
        #: [item columns, hidden]: the candidates' rows times this, one matrix product
        self.item_w = torch.from_numpy(np.ascontiguousarray(w[:, cols].T))
        self.dense_first = torch.from_numpy(np.ascontiguousarray(w[:, width:].T)) if w.shape[1] > width else None
        self.first_b = torch.from_numpy(_np(first.bias))
        self.layers = [(torch.from_numpy(np.ascontiguousarray(_np(m.weight).T)), torch.from_numpy(_np(m.bias)))
                       for m in linears[1:]]

    def logits(self, emb: np.ndarray | None, lin: np.ndarray | None, dense: np.ndarray | None) -> np.ndarray:
        """Logits ``[n]`` (float32) of candidates ``1..n`` of the pooled ``emb [n+1, F, D]`` and
        ``lin [n+1, L]`` (row 0: the user's fields), ``dense [n, K]``."""
        n = (emb if emb is not None else lin).shape[0] - 1 if emb is not None or lin is not None else len(dense)
        out = np.full(n, self.bias, np.float32)
        if dense is not None and self.scaler is not None:
            dense = scale_numpy(self.scaler, dense)
        if lin is not None:
            if self.lin_scale is not None:
                lin = lin * self.lin_scale
            out += lin[1:].sum(1)
            out += lin[0].sum()
        if dense is not None and self.dense_w is not None:
            out += _mm(dense, self.dense_w)[:, 0]
        if self.user_w is None or emb is None:
            return out
        user, items = emb[0], emb[1:][:, self.item_fields]  # [F, D], [n, F_items, D]
        s = items.sum(1)
        s += user.sum(0)
        q = np.einsum("nfd,nfd->n", items, items)
        out += 0.5 * (np.einsum("nd,nd->n", s, s) - q - float(np.vdot(user, user)))
        # The MLP in torch, in place: a bias added by the product itself (addmm) and relu_ save a
        # temporary and a numpy <-> torch round trip per layer (~30 us of ~250 per request).
        bias = torch.addmm(self.first_b, torch.from_numpy(user.reshape(1, -1)), self.user_w)  # the user's part, once
        h = torch.addmm(bias, torch.from_numpy(np.ascontiguousarray(items.reshape(n, -1))), self.item_w)
        if dense is not None and self.dense_first is not None:
            h.addmm_(torch.from_numpy(dense), self.dense_first)
        for w, b in self.layers:
            h = torch.addmm(b, h.relu_(), w)
        out += h.numpy()[:, 0]
        return out
