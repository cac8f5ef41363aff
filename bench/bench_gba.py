"""GBA (``trainer.dist_mode = "gba"``, :mod:`trainer.dist.gba_model`) against sync, hybrid and
async on bench_distributed's stream and model (ml-1m in time order, DeepFM 8 slots dim 16, MLP
256-128; ``BATCH`` examples per rank and step), 2 ranks, one torch thread each, pinned
(``PIN=0``: not). ``QUICK=1``: a run under 2 minutes. Last line: JSON.

* ``ex_per_s_{sync,hybrid,gba,async}``: examples of both ranks over the slowest rank's wall time
  after ``WARMUP`` steps; ``_slow2``, ``_slow4``: rank 1 a straggler (``trainer.debug_slow_rank =
  "1:2"`` / ``"1:4"``: it sleeps (FACTOR - 1) x its own step time after each step).
  sync and hybrid step in lockstep (rank r takes global step s's r-th slice, as
  bench_distributed); gba and async take the next batch of the same sequence of batches from a
  counter the ranks share (:meth:`GBAModel.ticket`): a fast rank takes more of the stream, as
  the paper's workers do.
* ``auc_holdout_*``: the trained model (every update applied, GBA's partial buffers flushed)
  scoring the ``HOLDOUT`` examples after the stream; ``auc_*``: progressive AUC (each batch scored
  before it is learned), no straggler; ``*_slow4`` of both for rank 1 slowed 4x.
* gba: ``global_batch`` = 2 x ``BATCH`` (sync's), ``max_staleness`` ``MAX_STALENESS`` (default
  8), ``fresh_wait`` ``FRESH_WAIT`` (default 1.5; 0: the paper's free-running GBA); async: every
  push applied on arrival, as the mean over its own batch, no decay. ``MODES``, ``SLOW``: a subset.
  Each gba/async line also prints per rank (waits, timed out, ms per step in each phase).
* ``staleness_mean_gba``, ``dropped_gradients_gba`` (and ``_slow4``): over every owner's buffer.
* ``RANKS`` (default 2): more ranks over the same stream and global batch (each rank's batch
  ``2 x BATCH / RANKS``), unpinned unless ``PIN=1``: the paper's regime, where async's pushes
  are several steps stale (on 2 cores the rates then say nothing; the AUCs do).
* ``LR_SCALE``: every learning rate times this, in every mode (default 1). Sync's holdout AUC by
  scale, QUICK (sync is lockstep: the same every run): 0.5 0.6811, 0.7 0.6857, 1 0.6878, 1.4
  0.6890, 2 0.6864, 4 0.6563; async's holdout was above sync's at 1 and 1.4 (0.6897, 0.6902) and
  below at 2 (0.6831).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer  # noqa: F401  - before torch: OMP_WAIT_POLICY=PASSIVE (see trainer/__init__.py)

# isort: split
import numpy as np
import torch.distributed as dist
from bench_distributed import BATCH, HOLDOUT, LIMIT, STEPS, WARMUP, _data
from bench_distributed import _cfg as _base_cfg

from tests.trainer.distributed.rank_local import run_local
from trainer.dist.gba_model import GBAModel
from trainer.dist.model import DistributedModel
from trainer.dist.straggler import Straggler
from trainer.metrics import auc

RANKS = int(os.environ.get("RANKS", "2"))
PIN = os.environ.get("PIN", "1" if RANKS == 2 else "0") == "1"
RANK_BATCH = 2 * BATCH // RANKS  # the same global batch and stream as 2 ranks of BATCH
MAX_STALENESS = int(os.environ.get("MAX_STALENESS", "8"))
FRESH_WAIT = float(os.environ.get("FRESH_WAIT", "1.5"))  # trainer.gba.fresh_wait (0: free-running GBA)
# (a subset for experiments: e.g. MODES=sync,gba SLOW=1,4; the JSON then lacks the others' keys)
SLOW = tuple(int(x) for x in os.environ.get("SLOW", "1,2,4").split(","))
MODES = tuple(os.environ.get("MODES", "sync,hybrid,gba,async").split(","))
#: every learning rate (the tables' Adagrad and the head's Adam) times this (every mode the same)
LR_SCALE = float(os.environ.get("LR_SCALE", "1"))


def _cfg():
    cfg = _base_cfg()
    if LR_SCALE == 1:
        return cfg
    tables = [t.model_copy(update={"optimizer": t.optimizer.model_copy(update={"lr": t.optimizer.lr * LR_SCALE})})
              for t in cfg.tables]
    return cfg.model_copy(update={"tables": tables, "dense_lr": cfg.dense_lr * LR_SCALE})


def _run(rank: int, world: int, mode: str, factor: float, batches: list, hold) -> dict:
    slow = Straggler(factor if rank == 1 else 1.0)
    n_warm = WARMUP * world
    got: dict[int, np.ndarray] = {}
    if mode in ("sync", "hybrid"):
        dm = DistributedModel(_cfg(), mode=mode)
        it = dm.train(batches[s * world + rank] for s in range(WARMUP + STEPS))
        for s in range(WARMUP):
            got[s * world + rank] = next(it)[1]
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(WARMUP, WARMUP + STEPS):
            t = time.perf_counter()
            got[s * world + rank] = next(it)[1]
            slow.after(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        hold_probs, stats, waits = dm.predict(hold), None, (0, 0)
    else:
        dm = GBAModel(_cfg(), mode=mode, global_batch=world * RANK_BATCH, max_staleness=MAX_STALENESS,
                      fresh_wait=FRESH_WAIT)
        for s in range(WARMUP):  # numba compile, allocator, optimizer state: the lockstep slices
            got[s * world + rank] = dm.step(batches[s * world + rank])[1]
        dm.wait()
        # the first tickets in rank order (rank r takes r); then each rank reserves its next one
        # while a step runs. With no straggler a global batch is then two adjacent batches, as
        # sync's. Racing for the first ticket instead, rank 0 took 0 and reserved 1 before rank 1
        # asked: every global batch joined batches two apart ({0, 2}, {1, 4}, ...), which let a
        # later batch teach the model before an earlier one was scored (progressive AUC +0.0016
        # over sync) and left the holdout 0.0014 below sync's, with no gradient stale.
        first = 0
        for r in range(world):
            if r == rank:
                first = dm.ticket()
            dist.barrier()
        t0 = time.perf_counter()
        k = n_warm + first
        while k < len(batches):
            t = time.perf_counter()
            nxt = dm.ticket_later()  # the next ticket travels while the step runs
            got[k] = dm.step(batches[k])[1]
            slow.after(time.perf_counter() - t)
            k = n_warm + nxt.wait()
        wall = time.perf_counter() - t0
        dm.finish()
        hold_probs, stats = dm.predict(hold), dm.stats
        waits = (dm.waits, dm.waits_timed_out, {k: round(v / max(1, dm.steps) * 1000, 2) for k, v in dm.timings.items()})
    dm.close()
    examples = sum(batches[k].size for k in got if k >= n_warm)
    return {"wall": wall, "examples": examples, "probs": got, "hold_probs": hold_probs, "stats": stats,
            "waits": waits}


def _rank(rank: int, world: int) -> dict:
    data = _data()
    batches = [data.batch(np.arange(k * RANK_BATCH, (k + 1) * RANK_BATCH)) for k in range((WARMUP + STEPS) * world)]
    share = HOLDOUT // world
    hold = data.batch(np.arange(LIMIT + rank * share, LIMIT + (rank + 1) * share))
    out = {"hold_labels": hold.labels, "labels": [b.labels for b in batches]}
    for factor in SLOW:
        for mode in MODES:
            out[(mode, factor)] = _run(rank, world, mode, factor, batches, hold)
    return out


def main() -> None:
    t_start = time.time()
    res = run_local(_rank, RANKS, timeout_s=300, pin=PIN)
    labels, hold_labels = res[0]["labels"], np.concatenate([r["hold_labels"] for r in res])
    out: dict = {}
    for factor in SLOW:
        sfx = "" if factor == 1 else f"_slow{factor}"
        for mode in MODES:
            parts = [r[(mode, factor)] for r in res]
            rate = sum(p["examples"] for p in parts) / max(p["wall"] for p in parts)
            probs = {k: v for p in parts for k, v in p["probs"].items()}
            ks = sorted(probs)
            a = auc(np.concatenate([probs[k] for k in ks]), np.concatenate([labels[k] for k in ks]))
            h = auc(np.concatenate([p["hold_probs"] for p in parts]), hold_labels)
            out[f"ex_per_s_{mode}{sfx}"] = round(rate)
            if factor in (1, 4):
                out[f"auc_{mode}{sfx}"], out[f"auc_holdout_{mode}{sfx}"] = round(a, 4), round(h, 4)
            taken = [sum(1 for k in p["probs"] if k >= WARMUP * RANKS) for p in parts]
            line = f"{mode:6s} rank 1 x{factor}: {rate:9,.0f} ex/s  auc {a:.4f}  holdout {h:.4f}  batches/rank {taken}"
            if parts[0]["stats"] is not None:
                st = parts[0]["stats"]
                for q in parts[1:]:
                    st = st.add(q["stats"])
                line += (f"  applied {st.applied} decayed {st.decayed} dropped {st.dropped} "
                         f"staleness {st.mean_staleness:.2f}  waits/timed out {[p['waits'] for p in parts]}")
                if mode == "gba" and factor in (1, 4):
                    out[f"staleness_mean_gba{sfx}"] = round(st.mean_staleness, 3)
                    out[f"dropped_gradients_gba{sfx}"] = st.dropped
            print(line, flush=True)
    for key, a, b, op in (("speedup_gba_vs_sync_slow4", "ex_per_s_gba_slow4", "ex_per_s_sync_slow4", "/"),
                          ("gba_vs_sync_no_straggler", "ex_per_s_gba", "ex_per_s_sync", "/"),
                          ("auc_holdout_gap_gba_sync", "auc_holdout_gba", "auc_holdout_sync", "-"),
                          ("auc_holdout_gap_gba_async", "auc_holdout_gba", "auc_holdout_async", "-")):
        if a in out and b in out:
            out[key] = round(out[a] / out[b], 3) if op == "/" else round(out[a] - out[b], 4)
    out.update({"pin_cores": PIN, "ranks": RANKS, "batch_per_rank": RANK_BATCH, "max_staleness": MAX_STALENESS,
                "fresh_wait": FRESH_WAIT, "steps": STEPS, "lr_scale": LR_SCALE,
                "quick": os.environ.get("QUICK") == "1", "wall_s": round(time.time() - t_start, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
