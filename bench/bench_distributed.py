"""Distributed training (:mod:`trainer.dist.model`): 2 gloo ranks vs 1 process. ``QUICK=1`` for a
< 1 min run. Last line: JSON.

* model: DeepFM (8 slots, dim 16, MLP 256-128) on ml-1m in time order, as bench_trainer.
* ``ex_per_s_1rank_1thread``: one process, one torch thread, plain ``SparseModel.train_step`` on
  batches of ``BATCH`` (no collectives at all: the honest baseline).
* ``BATCH`` (environment, default 1024, the trainer's ``batch_size``): examples per rank and step.
  A step's collectives cost about the same at any batch, so larger batches scale better
  (docs/scale-out.md: 2048 and 4096). ml-1m holds enough for 2300 without ``QUICK=1``.
* ``ex_per_s_2rank_{sync,hybrid}``: 2 spawned ranks, 1 torch thread each, each pinned to its own
  core (``trainer.pin_cores``; ``PIN=0``: not pinned), each on its own ``BATCH`` examples per step (global batch ``2 * BATCH``); examples of all ranks over the slowest
  rank's wall time, after ``WARMUP`` steps. ``scaling_*``: that over the 1-rank rate (targets on 2
  cores: sync >= 1.6, hybrid >= 1.8).
* ``alltoall_bytes_per_example``: bytes sent rank-to-rank through ``all_to_all`` (ids, rows,
  gradients, headers), all ranks, per example; ``allreduce_bytes_per_step``: the dense gradients.
* ``cpu_ms_per_step_1rank``, ``cpu_ms_per_step_2rank_{sync,hybrid}``: CPU time (user + system,
  every thread: gloo's too) per step of one process / of one rank. What 2 ranks can reach on 2
  cores is bounded by ``2 * cpu_1rank / cpu_2rank``, whatever the overlap; the wall time above
  that bound is waiting (collectives, the other rank, the scheduler). Less noisy than the rates.
  ``scaling_bound_{sync,hybrid}`` is that bound, ``2 * cpu_1rank / cpu_2rank``: the scaling the
  run could have reached on 2 cores had no rank ever waited.
* ``comm_ms_per_step_p50``: rank 0's median time inside collectives per step (sync run).
* ``auc_*``: progressive validation AUC (each example scored before it is learned) over every
  step; ``auc_1rank`` on the 1-rank stream (batches of ``BATCH``) for reference. ``hybrid`` scores
  with rows that miss the previous step's update (staleness 1): on this stream every item row
  and user-attribute row is in every step, so that costs progressive AUC (about 0.018 in QUICK,
  0.009 over 200 steps; the same as a 1-process run applying each update one step late:
  tests/trainer/distributed/test_distributed.py, docs/scale-out.md).
* ``auc_holdout_*``: the trained model (every update applied) scoring the ``HOLDOUT`` examples
  that follow the stream, learning none: what staleness costs the model itself.
* ``auc_hybrid_1proc_late``: one process on the same global batches applying each sparse update
  one step late (``bench/hybrid_reference.py``): equal to ``auc_hybrid`` when the engine keeps
  its staleness promise, whatever the gap to ``auc_sync``.

The machine's 2 cores are shared with whatever else runs: rates are noisy, read them as such.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer  # noqa: F401  - before torch: OMP_WAIT_POLICY=PASSIVE (see trainer/__init__.py)

# isort: split
import numpy as np
import torch
import torch.distributed as dist

from tests.trainer.distributed.rank_local import run_local
from trainer.config import deepfm_config
from trainer.data import MovieLensData
from trainer.dist.model import DistributedModel
from trainer.metrics import auc
from trainer.model import SparseModel

QUICK = os.environ.get("QUICK") == "1"
PIN = os.environ.get("PIN", "1") == "1"   # trainer.pin_cores: each rank on its own core (PIN=0: not)
BATCH = int(os.environ.get("BATCH", "1024"))  # examples per rank per step (and per step of the 1-rank run)
WARMUP = 3
STEPS = 24 if QUICK else 200      # measured global steps (each 2 * BATCH examples)
HOLDOUT = 20 * BATCH               # examples after the stream, scored by the trained model
LIMIT = (WARMUP + STEPS) * 2 * BATCH


def _cfg():
    # the engine's owner path for every table (issue 14's numbers); a sequential model's
    # first-order pass on rank 0 (trainer.dist.sequential) is not what this measures
    return deepfm_config(dim=16, mlp=[256, 128], recent_items=False, sequential=False, linear_lr=0.05)


def _data():
    return MovieLensData(limit=LIMIT + HOLDOUT)


def _cpu_s() -> float:
    """CPU seconds of this process, every thread (gloo's included), user + system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank: int, world: int, mode: str) -> dict:
    data = _data()
    # global step s is rows [s * world * BATCH, (s + 1) * world * BATCH): rank r takes its r-th slice
    batches = [data.batch(np.arange((s * world + rank) * BATCH, (s * world + rank + 1) * BATCH))
               for s in range(WARMUP + STEPS)]
    dm = DistributedModel(_cfg(), mode=mode)
    probs = []
    it = dm.train(batches)
    for _ in range(WARMUP):  # numba compile, allocator, optimizer state
        probs.append(next(it)[1])
    dist.barrier()
    a2a0, comm0, steps0 = dm.alltoall_bytes, len(dm.comm_s), dm.steps
    dm.model.timings.clear()  # per-step stage times of the measured steps only
    t0, cpu0 = time.perf_counter(), _cpu_s()
    for _, p in it:
        probs.append(p)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    out = {"wall": wall, "cpu": cpu, "examples": STEPS * BATCH, "a2a": dm.alltoall_bytes - a2a0,
           "allreduce_per_step": dm.allreduce_bytes / max(1, dm.steps), "comm_s": dm.comm_s[comm0:],
           "probs": np.concatenate(probs), "labels": np.concatenate([b.labels for b in batches]),
           "timings": {k: round(v / (dm.steps - steps0) * 1000, 2) for k, v in dm.model.timings.items()}}
    share = HOLDOUT // world  # this rank's slice of the holdout, scored after the measurements
    hold = data.batch(np.arange(LIMIT + rank * share, LIMIT + (rank + 1) * share))
    out.update(hold_probs=dm.predict(hold), hold_labels=hold.labels)
    dm.close()
    return out


def one_rank(data) -> tuple[float, float, float, float]:
    torch.set_num_threads(1)
    m = SparseModel(_cfg())
    batches = list(data.batches(BATCH, np.arange(LIMIT)))
    probs = [m.train_step(b)[1] for b in batches[:WARMUP]]
    t0, cpu0 = time.perf_counter(), _cpu_s()
    probs += [m.train_step(b)[1] for b in batches[WARMUP:]]
    rate = sum(b.size for b in batches[WARMUP:]) / (time.perf_counter() - t0)
    cpu_ms = (_cpu_s() - cpu0) / len(batches[WARMUP:]) * 1000
    hold = data.batch(np.arange(LIMIT, LIMIT + HOLDOUT))
    return (rate, cpu_ms, auc(np.concatenate(probs), np.concatenate([b.labels for b in batches])),
            auc(m.predict(hold), hold.labels))


def main():
    t_start = time.time()
    data = _data()
    if len(data) < LIMIT + HOLDOUT:  # (a large BATCH without QUICK=1)
        raise SystemExit(f"BATCH={BATCH} needs {LIMIT + HOLDOUT:,} examples, ml-1m has {len(data):,}: "
                         "use QUICK=1 or a smaller BATCH")
    rate1, cpu1, auc1, hold1 = one_rank(data)
    print(f"1 rank, 1 thread: {rate1:,.0f} ex/s  cpu {cpu1:.2f} ms/step  auc {auc1:.4f}  holdout {hold1:.4f}", flush=True)
    out = {"ex_per_s_1rank_1thread": round(rate1), "auc_1rank": round(auc1, 4), "auc_holdout_1rank": round(hold1, 4),
           "cpu_ms_per_step_1rank": round(cpu1, 2)}
    for mode in ("sync", "hybrid"):
        res = run_local(_rank, 2, mode, timeout_s=120, pin=PIN)
        rate = sum(r["examples"] for r in res) / max(r["wall"] for r in res)
        a = auc(np.concatenate([r["probs"] for r in res]), np.concatenate([r["labels"] for r in res]))
        hold = auc(np.concatenate([r["hold_probs"] for r in res]), np.concatenate([r["hold_labels"] for r in res]))
        comm = float(np.median(res[0]["comm_s"])) * 1000
        cpu = float(np.mean([r["cpu"] for r in res])) / STEPS * 1000  # per rank and step
        a2a = sum(r["a2a"] for r in res) / sum(r["examples"] for r in res)
        print(f"2 ranks {mode}: {rate:,.0f} ex/s (scaling {rate / rate1:.2f})  cpu {cpu:.2f} ms/step/rank  auc {a:.4f}  holdout {hold:.4f}  "
              f"all_to_all {a2a:.0f} B/example  comm p50 {comm:.2f} ms/step  "
              f"rank 0 ms/step {json.dumps(res[0]['timings'])}", flush=True)
        out.update({f"ex_per_s_2rank_{mode}": round(rate), f"scaling_{mode}": round(rate / rate1, 3),
                    f"auc_{mode}": round(a, 4), f"auc_holdout_{mode}": round(hold, 4),
                    f"cpu_ms_per_step_2rank_{mode}": round(cpu, 2), f"scaling_bound_{mode}": round(2 * cpu1 / cpu, 3)})
        if mode == "sync":
            out.update({"alltoall_bytes_per_example": round(a2a, 1), "comm_ms_per_step_p50": round(comm, 3),
                        "allreduce_bytes_per_step": round(res[0]["allreduce_per_step"])})
    from hybrid_reference import run as reference  # imports this module's constants
    out["auc_hybrid_1proc_late"] = reference(WARMUP + STEPS, late=True, seed=None)["auc"]
    out["auc_gap"] = round(out["auc_sync"] - out["auc_hybrid"], 4)
    out["auc_holdout_gap"] = round(out["auc_holdout_sync"] - out["auc_holdout_hybrid"], 4)
    out.update({"pin_cores": PIN, "batch_per_rank": BATCH, "holdout": HOLDOUT, "steps": STEPS, "quick": QUICK,
                "wall_s": round(time.time() - t_start, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
