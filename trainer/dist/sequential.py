"""The example-by-example pass of a ``sequential`` model on N ranks.

A sequential model (:mod:`trainer.sequential`) steps its first-order weights example by example:
each example is scored with the rows its predecessors in the batch left. One example's rows sit
in several tables, and an N-rank batch is the concatenation of the ranks' batches, so the pass
cannot be split by owner. The first-order tables therefore live **whole on rank 0**
(:func:`trainer.sharding.whole_tables`: dim-1 rows, a small share of a model's memory), and
each step, on :class:`trainer.dist.model.DistributedModel`'s dense group:

1. every rank sends rank 0 its examples' first-order ids (per slot, with each example's bag
   lengths), the logits of its deep part (embedding fields and dense head, computed from the
   step's looked-up rows) and its labels (``all_to_all_single``; the sizes travelled in the
   lookup's header);
2. rank 0 runs :func:`ps.sequential.train_linear_sequential` over the concatenated global
   batch in rank order: the pass a 1-process trainer runs on that batch, insertion, admission
   and row marks for the deltas included;
3. rank 0 sends each rank its examples' residuals (``p - y``), pre-update probabilities and
   their summed log loss; each rank back-propagates the residuals through its deep part.

With ``sequential_embeddings`` the embedding tables live whole on rank 0 as well (every table of
the model then does: the N-rank engine splits the examples and the dense work, not the rows).
The ranks still look their embedding rows up from rank 0 to run the MLP, and send in step 1 their
embedding ids too, and the MLP's slopes per example; rank 0 runs
:func:`ps.sequential_fm.train_fm_sequential`; the residuals step the dense head only.

A rank whose part already failed sends its flag instead of data: rank 0 then runs nothing and
answers every rank :data:`SKIPPED`, so no row is stepped and the step fails on every rank
together (the dense sum names the failed ranks). A pass that raises on rank 0 answers
:data:`FAILED` to every rank.

>>> ids, lens = np.array([4, 5, 6], np.int64), np.array([[1, 2]], np.int64)   # one slot, 2 examples
>>> msg = encode(False, lens, ids, np.array([0.5, -0.5]), np.array([1.0, 0.0]))
>>> size(n_slots=1, n_examples=2, n_ids=3) == msg.size
True
>>> part = decode(msg, n_slots=1, n_examples=2, n_ids=3)
>>> part.failed, part.lens.tolist(), part.ids.tolist(), part.offset.tolist(), part.labels.tolist()
(False, [[1, 2]], [4, 5, 6], [0.5, -0.5], [1.0, 0.0])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ps import PackedBatch
from ps.sequential import train_linear_sequential
from ps.sequential_fm import train_fm_sequential

from ..sequential import factor_buffers

log = logging.getLogger(__name__)

OK, SKIPPED, FAILED = 0.0, 1.0, 2.0


def size(n_slots: int, n_examples: int, n_ids: int, slope_width: int = 0) -> int:
    """int64 values of one rank's message to rank 0 (``slope_width``: MLP slopes per example)."""
    return 1 + n_slots * n_examples + n_ids + (2 + slope_width) * n_examples


def encode(failed: bool, lens: np.ndarray, ids: np.ndarray, offset: np.ndarray, labels: np.ndarray,
           jac: np.ndarray | None = None) -> np.ndarray:
    """One rank's message: flag, bag lengths ``[slots, B]``, ids (slot-major), deep logits,
    labels and (``sequential_embeddings``) the MLP's slopes ``[B, F, dim]`` (float64, carried bit
    for bit as int64)."""
    floats = [offset, labels] + ([] if jac is None else [jac.reshape(-1)])
    return np.concatenate([np.array([int(failed)], np.int64), lens.reshape(-1).astype(np.int64),
                           ids.astype(np.int64)] + [np.ascontiguousarray(x, np.float64).view(np.int64) for x in floats])


@dataclass
class Part:
    failed: bool
    lens: np.ndarray     # int64 [slots, B]
    ids: np.ndarray      # int64, slot-major
    offset: np.ndarray   # float64 [B]
    labels: np.ndarray   # float64 [B]
    jac: np.ndarray      # float64 [B * slope_width]


def decode(msg: np.ndarray, n_slots: int, n_examples: int, n_ids: int) -> Part:
    a = 1 + n_slots * n_examples
    b = a + n_ids
    c = b + 2 * n_examples
    return Part(bool(msg[0]), msg[1:a].reshape(n_slots, n_examples), msg[a:b],
                msg[b:b + n_examples].view(np.float64), msg[b + n_examples:c].view(np.float64), msg[c:].view(np.float64))


def run_pass(ps, slots: tuple, table_of_slot: np.ndarray, mean: np.ndarray, parts: list[Part], event_time: int,
             n_emb: int = 0, linear_scale: np.ndarray | None = None):
    """Rank 0: the kernel over the ranks' parts concatenated in rank order (the first ``n_emb``
    slots embedding fields: :func:`ps.sequential_fm.train_fm_sequential`; none: the first-order
    pass). ``linear_scale``: the head's learned factors of the first-order fields (or None).
    Returns per rank ``(residuals, probabilities, loss sum, the residuals times each first-order
    field's pooled sums, summed over its examples: float64 [first-order fields], empty without
    factors)``."""
    n_slots = len(slots)
    lens = np.concatenate([p.lens for p in parts], axis=1)
    per_rank = [np.split(p.ids, np.cumsum(p.lens.sum(1))[:-1]) for p in parts]
    ids = np.concatenate([a for k in range(n_slots) for a in (r[k] for r in per_rank)]) if n_slots else np.zeros(0, np.int64)
    seg = lens.sum(1)
    offsets = np.zeros(n_slots + 1, np.int64)
    np.cumsum(seg, out=offsets[1:])
    pb = PackedBatch(tuple(slots), ids.astype(np.int64), offsets, table_of_slot)
    bags = np.zeros((n_slots, lens.shape[1] + 1), np.int64)
    np.cumsum(lens, axis=1, out=bags[:, 1:])
    labels = np.concatenate([p.labels for p in parts])
    offset = np.concatenate([p.offset for p in parts])
    scale, pooled = factor_buffers(linear_scale, labels.size, n_slots, n_emb)
    if n_emb:
        # the owners' lookups inserted the embedding ids already (rank 0 owns their tables)
        ps.gather_packed(pb.segments(n_emb, n_slots), insert=True, event_time=event_time)
        jac = np.concatenate([p.jac for p in parts]).reshape(labels.size, n_emb, -1)
        probs, _, resid = train_fm_sequential(ps, pb, n_emb, bags, mean, labels, offset, jac, event_time,
                                              insert=False, scale=scale, pooled=pooled)
    else:
        probs, _, resid = train_linear_sequential(ps, pb, bags, mean, labels, offset, event_time,
                                                  scale=scale, pooled=pooled)
    p64 = resid + labels  # the kernel's float64 probabilities (``probs`` is their float32)
    with np.errstate(divide="ignore"):
        ll = -(labels * np.log(p64) + (1 - labels) * np.log1p(-p64))
    out, a = [], 0
    for p in parts:
        b = a + p.labels.size
        g = resid[a:b] @ pooled[a:b, n_emb:] if pooled is not None else np.zeros(0)
        out.append((resid[a:b], probs[a:b], float(ll[a:b].sum()), g))
        a = b
    return out


def exchange(group, rank: int, world: int, msg: np.ndarray, sizes: list[int], n_examples: list[int],
             run, n_scale: int = 0) -> tuple[float, np.ndarray, np.ndarray, float, np.ndarray, int]:
    """Steps 1-3 (collective on ``group``): ``msg`` this rank's message, ``sizes`` / ``n_examples``
    every rank's message size and batch size; ``run(messages)`` is rank 0's pass (returning
    ``(status, [(resid, probs, loss sum, scale gradient)] per rank)`` as :func:`run_pass`;
    ``n_scale`` the scale gradient's size). Returns this rank's ``(status, residuals,
    probabilities, loss sum, scale gradient, bytes sent to other ranks)``."""
    send = [msg.size if r == 0 else 0 for r in range(world)]
    recv = sizes if rank == 0 else [0] * world
    got = torch.empty(sum(recv), dtype=torch.int64)
    dist.all_to_all_single(got, torch.from_numpy(np.ascontiguousarray(msg)), recv, send, group=group)
    sent = msg.size * 8 if rank != 0 else 0
    reply = [np.zeros(0)] * world
    if rank == 0:
        got_np = got.numpy()
        msgs = np.split(got_np, np.cumsum(sizes)[:-1]) if world > 1 else [got_np]
        status, res = run(msgs)
        for r in range(world):
            b = n_examples[r]
            if status == OK:
                resid, probs, loss, g = res[r]
                reply[r] = np.concatenate([[status, loss], g, resid, probs.astype(np.float64)])
            else:
                reply[r] = np.concatenate([[status, 0.0], np.zeros(n_scale + 2 * b)])
        sent += sum(x.size * 8 for x in reply[1:])
    mine = torch.empty(2 + n_scale + 2 * n_examples[rank], dtype=torch.float64)
    back_send = [x.size for x in reply] if rank == 0 else [0] * world
    back_recv = [mine.numel() if r == 0 else 0 for r in range(world)]
    dist.all_to_all_single(mine, torch.from_numpy(np.concatenate(reply)), back_recv, back_send, group=group)
    m = mine.numpy()
    b, c = n_examples[rank], 2 + n_scale
    return float(m[0]), m[c:c + b], m[c + b:].astype(np.float32), float(m[1]), m[2:c], sent
