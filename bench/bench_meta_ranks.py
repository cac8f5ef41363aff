"""Meta-learned starting points on N ranks (:mod:`trainer.dist.meta`): ``driftline eval
coldstart``'s stream and served model (:mod:`evaluation.coldstart`), trained by 2 gloo ranks in
``sync`` with and without ``model.meta``, each rank taking the users of its shard (the joiner keys
the examples topic by user id, so a user's examples stay on one rank). Last line: JSON.

* every global step takes the stream's next ``served_batch()`` examples; rank ``r`` steps those
  whose user is in its shard (progressive validation: each example scored before it is learned);
* ``auc_users_first_10_{served,meta}``, ``auc_overall_{served,meta}``: the online part's AUCs
  (the eval's buckets), mean over ``SEEDS`` (default 0,1,2; ``QUICK=1``: 0), and
  ``gain_users_first_10`` (paired, with its std over seeds) and ``gain_overall``;
* ``ex_per_s_{served,meta}`` (median over seeds): the stream's examples over the slower rank's
  seconds; ``meta_vs_served``: their ratio.
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

from evaluation.coldstart import _split
from evaluation.common import served_batch, served_model_config
from services.settings import EvalSettings
from tests.trainer.distributed.rank_local import run_local
from trainer.config import MetaConfig
from trainer.dist.model import DistributedModel
from trainer.metrics import auc
from trainer.model import SparseModel
from trainer.sharding import shard_of

QUICK = os.environ.get("QUICK") == "1"
SEEDS = tuple(int(x) for x in os.environ.get("SEEDS", "0" if QUICK else "0,1,2").split(","))
RANKS = 2


def _rank(rank: int, world: int, arm: str, seed: int) -> dict:
    s = EvalSettings()
    d, _, _ = _split(s)
    cfg = served_model_config(s, seed, f"ranks-{arm}")
    if arm == "meta":
        cfg = cfg.model_copy(update={"meta": MetaConfig(task_slot="user_id")})
    dm = DistributedModel(cfg)
    mine = shard_of(d.user_id, world) == rank
    bs, n = served_batch(), d.label.size
    steps = [np.flatnonzero(mine[a:a + bs]) + a for a in range(0, n, bs)]
    # every kernel's first call in this process (numba's cache load), outside the timing
    SparseModel(cfg).train_step(d.batch(np.arange(bs)))
    dist.barrier()
    probs, t0 = {}, time.perf_counter()
    for rows in steps:
        probs[int(rows[0]) if rows.size else -1] = (rows, dm.train_step(d.batch(rows))[1])
    seconds = time.perf_counter() - t0
    dm.close()
    return {"rows": np.concatenate([r for r, _ in probs.values()]),
            "probs": np.concatenate([p for _, p in probs.values()]), "seconds": seconds}


def main() -> None:
    s = EvalSettings()
    d, cut, masks = _split(s)
    y = d.label[cut:]
    res: dict = {}
    for seed in SEEDS:
        for arm in ("served", "meta"):
            parts = run_local(_rank, RANKS, arm, seed, timeout_s=900)
            p = np.empty(d.label.size, np.float32)
            for part in parts:
                p[part["rows"]] = part["probs"]
            q = p[cut:]
            res[(arm, seed)] = {"users": auc(q[masks["users_first_10"]], y[masks["users_first_10"]]),
                                "overall": auc(q, y), "ex_per_s": d.label.size / max(x["seconds"] for x in parts)}
            print(arm, seed, res[(arm, seed)], flush=True)
    out: dict = {}
    for arm in ("served", "meta"):
        out[f"auc_users_first_10_{arm}"] = round(float(np.mean([res[(arm, k)]["users"] for k in SEEDS])), 4)
        out[f"auc_overall_{arm}"] = round(float(np.mean([res[(arm, k)]["overall"] for k in SEEDS])), 4)
        out[f"ex_per_s_{arm}"] = round(float(np.median([res[(arm, k)]["ex_per_s"] for k in SEEDS])))
    for key, name in (("users", "gain_users_first_10"), ("overall", "gain_overall")):
        g = [res[("meta", k)][key] - res[("served", k)][key] for k in SEEDS]
        out[name] = round(float(np.mean(g)), 4)
        out[f"{name}_std"] = round(float(np.std(g, ddof=1)), 4) if len(g) > 1 else None
    out["meta_vs_served"] = round(out["ex_per_s_meta"] / out["ex_per_s_served"], 3)
    out.update(ranks=RANKS, seeds=list(SEEDS), quick=QUICK)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
