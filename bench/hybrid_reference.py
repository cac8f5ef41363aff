"""What ``hybrid``'s staleness costs, without torch.distributed: one process on the bench's global
batches (``bench_distributed``'s model and stream), sparse updates applied at once (``sync``) or
one step late, after the next step's lookup (``hybrid`` with staleness 1:
tests/trainer/distributed/test_distributed.py checks the engine equals this). Deterministic.

    python bench/hybrid_reference.py [STEPS [SEED ...]]    # defaults: 27 (bench QUICK), seed None

One JSON line per (seed, delay): progressive AUC (each example scored before it is learned), of
the second half of the stream, and ``holdout`` (the trained model, every update applied, on the
``bench_distributed.HOLDOUT`` examples after the stream). Used for docs/scale-out.md.

``LATE_TABLES=user_id,user_id_w,item_id,item_id_w`` (environment): only these tables' updates come
one step late, the others' at once: what hybrid would cost if the small tables (a handful of
rows that every batch touches) were replicated on every rank and updated synchronously, as the
dense head is (not built: docs/scale-out.md).
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_distributed as B
import numpy as np
import torch
import torch.nn.functional as F

from trainer.config import deepfm_config
from trainer.data import MovieLensData
from trainer.metrics import auc
from trainer.model import SparseModel

GLOBAL = 2 * B.BATCH  # the 2-rank bench's global batch
LATE_TABLES = set(os.environ["LATE_TABLES"].split(",")) if os.environ.get("LATE_TABLES") else None


def _split(m: SparseModel, pb, grads: np.ndarray, late: set[str]):
    """A packed update split by table: ``(({slot: ids}, grads) of the other tables, the same of
    the ``late`` tables)``, each in packed order."""
    ps = m.ps
    out = ps._out_offsets(pb)  # slot k's gradients: grads[out[k]:out[k + 1]]
    parts: tuple = (({}, []), ({}, []))
    for k, slot in enumerate(pb.slots):
        ids, gs = parts[ps.table_names[pb.slot_table[k]] in late]
        ids[slot] = pb.slot_ids(k)
        gs.append(grads[out[k]:out[k + 1]])
    return tuple((ids, np.concatenate(gs) if gs else np.zeros(0, np.float32)) for ids, gs in parts)


def run(steps: int, late: bool, seed: int | None) -> dict:
    torch.set_num_threads(1)
    m = SparseModel(deepfm_config(dim=16, mlp=[256, 128], recent_items=False, seed=seed, sequential=False,
                                  linear_lr=0.05))
    data = MovieLensData(limit=steps * GLOBAL + B.HOLDOUT)
    pending: deque = deque()
    probs, labels = [], []
    for s in range(steps):
        b = data.batch(np.arange(s * GLOBAL, (s + 1) * GLOBAL))
        m.head.start_bias(float(b.labels.sum()), b.size)  # (before the batch is scored, as the engines)
        logits, (pb, leaves) = m.forward(b, insert=True, event_time=b.max_event_time)
        while pending:  # the previous step's update lands after this step's lookup
            m.ps.apply_packed_gradients(*pending.popleft())
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(b.labels))
        m.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = np.concatenate([w.grad.numpy().reshape(-1) for _, w in leaves])
        if late and LATE_TABLES is not None:
            now, later = _split(m, pb, grads, LATE_TABLES)
            if now[0]:
                m.ps.apply_packed_gradients(*now, b.max_event_time)
            if later[0]:
                pending.append((*later, b.max_event_time))
        else:
            pending.append((pb, grads, b.max_event_time))
        if not late:
            m.ps.apply_packed_gradients(*pending.popleft())
        m.head.hold_bias()
        m.optimizer.step()
        probs.append(torch.sigmoid(logits.detach()).numpy())
        labels.append(b.labels)
    while pending:
        m.ps.apply_packed_gradients(*pending.popleft())
    p, y = np.concatenate(probs), np.concatenate(labels)
    hold = data.batch(np.arange(steps * GLOBAL, steps * GLOBAL + B.HOLDOUT))
    return {"steps": steps, "seed": seed, "late": late, "late_tables": sorted(LATE_TABLES) if late and LATE_TABLES else None,
            "auc": round(auc(p, y), 4),
            "auc_2nd_half": round(auc(p[p.size // 2:], y[y.size // 2:]), 4),
            "holdout": round(auc(m.predict(hold), hold.labels), 4)}


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else B.WARMUP + 24
    for seed in [int(x) for x in sys.argv[2:]] or [None]:
        for late in (False, True):
            print(json.dumps(run(steps, late, seed)), flush=True)


if __name__ == "__main__":
    main()
