"""Where a 2-rank ``sync`` step's communication time goes, per collective: how far apart the two
ranks arrive (the earlier one waits: imbalance) and how long the collective takes once both are
there (the collective itself). Same model, data and batches as ``bench_distributed.py``.

    QUICK=1 PIN=1 .venv/bin/python bench/profile_distributed.py

Both ranks time every collective with ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every
process on the machine), so arrivals compare across the ranks. Last line: JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_distributed as bd
import numpy as np

from tests.trainer.distributed.rank_local import run_local

# a sync step without count admission: header, ids, rows, then the dense sum and the gradients
# (issued together, the sum first)
NAMES = ("header", "ids", "rows", "dense_sum", "gradients")


class _Waited:
    """An async collective's work whose span ends when it is waited for."""

    def __init__(self, work, calls: list, t0: float):
        self.work, self.calls, self.t0, self.i = work, calls, t0, len(calls)
        calls.append(None)  # its place in issue order

    def wait(self, *args):
        done = self.work.wait(*args)
        self.calls[self.i] = (self.t0, time.perf_counter())
        return done


def _timed_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist
    calls: list = []
    for name in ("all_to_all_single", "all_reduce"):
        def timed(*a, _orig=getattr(dist, name), **k):  # noqa: B008 - bound now: each wrapper its own function
            t0 = time.perf_counter()
            work = _orig(*a, **k)
            if k.get("async_op"):
                return _Waited(work, calls, t0)
            calls.append((t0, time.perf_counter()))
            return work
        setattr(dist, name, timed)
    out = bd._rank(rank, world, "sync")
    out["calls"] = calls
    return out


def main() -> None:
    res = run_local(_timed_rank, 2, timeout_s=120, pin=bd.PIN)
    k = len(NAMES)
    # the measured steps: after the warm-up's, before the holdout's lookups
    spans = [np.array(r["calls"][k * bd.WARMUP:k * (bd.WARMUP + bd.STEPS)], float).reshape(bd.STEPS, k, 2) * 1000
             for r in res]
    a, b = spans
    skew = np.abs(a[:, :, 0] - b[:, :, 0])
    cost = np.maximum(a[:, :, 1], b[:, :, 1]) - np.maximum(a[:, :, 0], b[:, :, 0])
    step = float(np.median(np.diff(a[:, 0, 0])))
    out = {"pin_cores": bd.PIN, "step_ms_p50": round(step, 2)}
    for i, n in enumerate(NAMES):
        out[f"{n}_skew_ms_p50"] = round(float(np.median(skew[:, i])), 3)
        out[f"{n}_cost_ms_p50"] = round(float(np.median(cost[:, i])), 3)
        print(f"{n:>10}: arrival skew p50 {np.median(skew[:, i]):.2f} ms (mean {skew[:, i].mean():.2f}),"
              f" cost once both are there p50 {np.median(cost[:, i]):.2f} ms (mean {cost[:, i].mean():.2f})")
    print(f"step p50 {step:.2f} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
