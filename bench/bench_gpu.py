"""The GPU path against this machine's CPU cores, in one run. ``QUICK=1`` for a < 1 min run. Last line: JSON.

The driftline DeepFM (8 slots, dim 16, MLP 256-128, every table stepped once per batch: the cache
serves a model with ``sequential`` off) trained on the ml-1m stream at batch 1024 and 8192:

* ``cpu``: the host PS and the head on this machine's CPU cores (``torch.set_num_threads`` = all);
* ``gpu_dense``: the head, its optimizer and the pooling on CUDA (``trainer.device``), the PS on
  the host: every looked-up row goes over in one copy a step, its gradient comes back;
* ``gpu_cache``: that, with the MixCache (``trainer.cache_rows`` rows a table on the GPU, stepped
  there: only the misses go over).

The models train in alternating rounds over the same batches, so other load hits all of them;
rates are medians over rounds. Without CUDA: the CPU keys, the cache run on the CPU as its
device (its own cost and its hit rate), and ``"cuda": false``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer  # noqa: F401  - before torch: sets OMP_WAIT_POLICY=PASSIVE (see trainer/__init__.py)

# isort: split
import numpy as np
import torch

from trainer.config import deepfm_config
from trainer.data import MovieLensData
from trainer.model import SparseModel

QUICK = os.environ.get("QUICK") == "1"
ROUNDS = 3 if QUICK else 7
EXAMPLES_PER_ROUND = 20_480 if QUICK else 163_840
CACHE_ROWS = 1 << 16


def _cfg():
    return deepfm_config(dim=16, mlp=[256, 128], recent_items=False, sequential=False, seed=0)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _round(model: SparseModel, batches, device: str) -> float:
    n = sum(b.size for b in batches)
    _sync(device)
    t0 = time.perf_counter()
    for b in batches:
        model.train_step(b)
    _sync(device)
    return n / (time.perf_counter() - t0)


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    cuda = torch.cuda.is_available()
    data = MovieLensData()
    warm = 4 * 8192
    rows = np.arange(warm + ROUNDS * EXAMPLES_PER_ROUND)
    out: dict = {"cuda": cuda, "threads": torch.get_num_threads(), "quick": QUICK, "cache_rows": CACHE_ROWS}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
    for bs in (1024, 8192):
        arms = {"cpu": ("cpu", 0), "cpu_cache": ("cpu", CACHE_ROWS)}
        if cuda:
            arms = {"cpu": ("cpu", 0), "gpu_dense": ("cuda", 0), "gpu_cache": ("cuda", CACHE_ROWS)}
        models = {name: SparseModel(_cfg(), device=dev, cache_rows=c) for name, (dev, c) in arms.items()}
        batches = list(data.batches(bs, rows))
        warm_n = warm // bs
        per_round = EXAMPLES_PER_ROUND // bs
        for name, m in models.items():  # JIT, allocator, the cache's first fill
            _round(m, batches[:warm_n], arms[name][0])
            if m.cache is not None:
                m.cache.stats.__init__()
            m.io.h2d_bytes = 0
        rates: dict[str, list[float]] = {name: [] for name in models}
        for r in range(ROUNDS):
            chunk = batches[warm_n + r * per_round: warm_n + (r + 1) * per_round]
            for name, m in models.items():
                rates[name].append(_round(m, chunk, arms[name][0]))
        trained = ROUNDS * per_round * bs
        for name, m in models.items():
            out[f"ex_per_s_{name}_{bs}"] = round(float(np.median(rates[name])))
            if m.cache is not None:
                out[f"cache_hit_rate_{bs}"] = round(m.cache.stats.hit_rate, 4)
            if arms[name][0] == "cuda":
                out[f"h2d_bytes_per_example_{name}_{bs}"] = round(m.io.h2d_bytes / trained, 1)
        base = out[f"ex_per_s_cpu_{bs}"]
        for name in models:
            if name != "cpu":
                out[f"{name}_vs_cpu_{bs}"] = round(out[f"ex_per_s_{name}_{bs}"] / base, 3)
        print(json.dumps({k: v for k, v in out.items() if k.endswith(str(bs))}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
