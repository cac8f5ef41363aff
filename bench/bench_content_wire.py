"""The content encoder's traffic on N ranks (:mod:`trainer.dist.content`): bytes per example through
the all-to-all with the encoder on the items' owners (its output in the item rows they send, or in
an exchange of its own) vs the owners sending the raw content (title word and genre tokens, int32
rows of the encoder's token table) to the requesting rank. Last line: JSON.

* stream: ml-1m's first ``LIMIT`` ratings (default 100,000) in time order, ``BATCH`` examples per
  rank and step (default 1024), 2 gloo ranks (``RANKS``); the served model's size (dim 8, MLP
  32-16) stepped once per batch (N ranks refuse ``sequential_embeddings`` with content);
* ``content_bytes_per_example_{row,owners,raw}``: what the encoder's own exchanges sent rank to
  rank (``owners``: counts, item ids, then rows and their gradients; ``raw``: token lengths and
  tokens; ``row``: nothing, its output rides in the item's row), all ranks, per example;
* ``bytes_per_example_{row,owners,raw}``: everything through the all-to-all (the engine's ids,
  rows, gradients and headers, plus the above); ``ratio_row_vs_raw`` and ``ratio_owners_vs_raw``
  of those totals; ``content_ratio_owners_vs_raw`` of the encoder's own bytes;
* ``tokens_per_item``: the mean content length of the stream's items;
* ``ex_per_s_{row,owners,raw}``: examples of both ranks per second, after a first step (``row``
  gives up overlapping the rows' gradients with the dense sum: step 8 runs before it).

Both directions count for ``owners`` (``dim`` float32 rows forward, as many gradients back); raw
content travels forward only. A token list shorter than ``2 * dim`` floats' worth of int32 is
cheaper to send raw than in an exchange of its own; a precomputed vector of ``V`` floats costs
``4 V`` bytes raw per item. In the rows it costs nothing at any size.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer  # noqa: F401  - before torch: OMP_WAIT_POLICY=PASSIVE (see trainer/__init__.py)

# isort: split
import numpy as np
import torch.distributed as dist

from movielens.features import ITEM_CONTENT
from tests.trainer.distributed.rank_local import run_local
from trainer.config import ContentConfig, ModelConfig, deepfm_config
from trainer.data import MovieLensData
from trainer.dist.content import ContentStore
from trainer.dist.model import DistributedModel

LIMIT, BATCH, RANKS = int(os.environ.get("LIMIT", 100_000)), int(os.environ.get("BATCH", 1024)), int(os.environ.get("RANKS", 2))


def _cfg() -> ModelConfig:
    cfg = deepfm_config(model_id="wire", recent_items=False, sequential=False)
    return ModelConfig.model_validate({**cfg.model_dump(), "content": ContentConfig(slot=ITEM_CONTENT,
                                                                                    item_slot="item_id").model_dump()})


def _rank(rank: int, world: int, mode: str) -> dict:
    d = MovieLensData(limit=LIMIT)
    store = ContentStore({i: d.features.item_content(i) for i in d.features.item_ids})
    dm = DistributedModel(_cfg(), content=store, content_mode=mode)
    step = BATCH * world
    batches = [d.batch(np.arange(a + rank * BATCH, a + (rank + 1) * BATCH)) for a in range(0, len(d) - step + 1, step)]
    dm.train_step(batches[0])  # kernels and allocator outside the timing
    dist.barrier()
    t0 = time.perf_counter()
    for b in batches[1:]:
        dm.train_step(b)
    out = {"bytes": dm._content.bytes, "examples": dm._content.examples, "engine": dm.alltoall_bytes,
           "seconds": time.perf_counter() - t0, "timed": sum(b.size for b in batches[1:])}
    dm.close()
    return out


def main() -> None:
    res = {}
    for mode in ("row", "owners", "raw"):
        parts = run_local(_rank, RANKS, mode, timeout_s=600)
        # (predict is never called: every encoded example is a trained one)
        res[mode] = {k: sum(p[k] for p in parts) for k in parts[0]}
    d = MovieLensData(limit=LIMIT)
    items = np.unique(d.item_id)
    out = {f"content_bytes_per_example_{m}": r["bytes"] / r["examples"] for m, r in res.items()}
    # examples of both ranks over the slower rank's seconds (the ranks step together)
    out.update({f"ex_per_s_{m}": round(r["timed"] / (r["seconds"] / RANKS)) for m, r in res.items()})
    out.update({f"bytes_per_example_{m}": (r["bytes"] + r["engine"]) / r["examples"] for m, r in res.items()})
    for m in ("row", "owners"):
        out[f"ratio_{m}_vs_raw"] = out[f"bytes_per_example_{m}"] / out["bytes_per_example_raw"]
    out["content_ratio_owners_vs_raw"] = out["content_bytes_per_example_owners"] / out["content_bytes_per_example_raw"]
    out["tokens_per_item"] = float(np.mean([len(d.features.item_content(int(i))) for i in items]))
    out.update(limit=LIMIT, batch=BATCH, ranks=RANKS)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
