"""How the collisions model and the baselines' learning rates were chosen, never on test data.

* **collisions**: the collisionless DeepFM (``coll_*`` settings) is trained for ``coll_epochs``
  on the first 90% of the *train part* of the collisions split (time order) and scored after every
  epoch on the last 10% of it (the validation set; the test part is not read). Each candidate is
  one seed. The criterion is the mean validation AUC over all epochs, which rewards a model that is
  good early *and* does not overfit later (the paper's collisionless model does not overfit).
  Only the collisionless arm is tuned: choosing settings by the collisionless - hashed gap would
  select for the effect being measured.
* **baselines**: on a tuning stream disjoint from the reported one (``tune_base_limit`` ratings
  after the first ``base_limit``), progressive validation from scratch: River's SGD lr,
  driftline LR's Adagrad lr per mini-batch size (and the sequential LR's at its batch), and
  driftline DeepFM's sparse lr per batch size, the served model's (embedding lr, first-order lr)
  pair at its batch, and the counting baseline's smoothing prior;
  per (model, batch) the lr (pair, prior) with the best AUC is chosen. The served model's size
  (embedding dim, MLP) is the best AUC among :data:`SERVED_SIZES` whose examples/s pass the
  plain DeepFM's at batch 1024 by :data:`SPEED_MARGIN` (so it learns better than both of the
  baselines' ends at once).

``driftline eval tune`` writes the ``tuning`` section; the ``full()`` settings hold the choices it
made (the report says if they ever differ).
"""

from __future__ import annotations

import numpy as np

from .common import EvalSettings, pmap, served_batch

#: candidate collisions settings (overrides of ``EvalSettings``), one seed each, on validation
COLL_GRID: tuple[dict, ...] = (
    *({"coll_sparse_lr": lr} for lr in (0.05, 0.02, 0.01, 0.005, 0.003, 0.002)),
    *({"coll_sparse_lr": lr, "coll_dense_lr": 1e-4} for lr in (0.05, 0.02, 0.01, 0.005)),
    *({"coll_sparse_lr": lr, "coll_dim": 8} for lr in (0.005, 0.003)),
    {"coll_sparse_lr": 0.005, "coll_mlp": (64, 32)},
    {"coll_sparse_lr": 0.005, "coll_init_acc": 0.1},
)
COLL_KEYS = ("coll_sparse_lr", "coll_dense_lr", "coll_dim", "coll_mlp", "coll_init_acc", "coll_slots")

RIVER_LRS = (0.01, 0.03, 0.1, 0.3)
LR_BATCHES = (32, 64, 128, 256, 1024, 4096)
LR_LRS = (0.1, 0.2, 0.3, 0.5, 1.0)
#: the sequential LR's Adagrad lr at its batch (spans River's SGD lrs and the mini-batch LR's)
SEQ_LRS = (0.03, 0.1, 0.2, 0.3, 0.5, 1.0)
DEEPFM_BATCHES = (64, 1024)
DEEPFM_LRS = (0.02, 0.05, 0.1, 0.2)
#: the served model's (embedding Adagrad lr, first-order Adagrad lr) at its batch
SERVED_LRS = tuple((e, w) for e in (0.02, 0.05, 0.1) for w in (0.1, 0.2, 0.3, 0.5))
#: the served model's batch sizes (the live trainer's default among them: it is chosen here)
SERVED_BATCHES = (1024, 2048, 4096)
#: the served model's (embedding dim, MLP), at its lrs and batch 1024: the most accurate of those
#: at least SPEED_MARGIN times as fast as the plain DeepFM at batch 1024 is chosen
#: (trainer.config.SERVED_DIM, SERVED_MLP). The margin: examples/s on these shared 2-core machines
#: move by ~10% from run to run, and the choice must hold in the next one.
SERVED_SIZES = ((16, (128, 64)), (16, (64, 32)), (8, (128, 64)), (8, (64, 32)), (8, (32, 16)), (4, (64, 32)))
SIZE_BATCH, SPEED_MARGIN = 1024, 1.1
#: the counting baseline's smoothing prior (in examples)
COUNT_PRIORS = (1.0, 3.0, 10.0, 30.0, 100.0)


def coll_grid(s: EvalSettings) -> list[dict]:
    return list(COLL_GRID) if s.name == "full" else [{"coll_sparse_lr": 0.05}, {"coll_sparse_lr": 0.005}]


def _coll_candidate(s: EvalSettings, ov: dict, seed: int) -> dict:
    from . import collisions

    c = s.model_copy(update=dict(**ov))
    r = collisions.run_one(c, "collisionless", seed, None, validation=True)
    return {"overrides": ov, "seed": seed, "val_auc": r["test_auc"], "criterion": float(np.mean(r["test_auc"]))}


def tuning_stream(s: EvalSettings) -> EvalSettings:
    """EvalSettings whose baselines stream is the tuning stream (right after the reported one)."""
    return s.model_copy(update=dict(base_offset=s.base_offset + (s.base_limit or 0), base_limit=s.tune_base_limit))


def _base_candidate(s: EvalSettings, what: str, batch: int, lr: float) -> dict:
    from . import baselines

    t = tuning_stream(s)
    baselines._warm_up(t)
    if what == "river":
        r = baselines.run_river(t.model_copy(update=dict(river_lr=lr)), "lr")
    elif what == "driftline_lr":
        r = baselines.run_driftline(t.model_copy(update=dict(base_lr_lr=lr)), 0, "lr", batch)
    elif what == "driftline_lr_sequential":
        r = baselines.run_driftline(t.model_copy(update=dict(base_lr_seq_lr=lr)), 0, "lr_sequential", batch)
    elif what == "driftline_served":
        r = baselines.run_driftline(t.model_copy(update=dict(base_sparse_lr=lr[0], base_linear_lr=lr[1])), 0,
                                    "served", batch)
    elif what == "driftline_served_size":
        r = baselines.run_driftline(t, 0, "served", batch, size=lr)
    elif what == "counts":
        r = baselines.run_counts(t.model_copy(update=dict(count_prior=lr)))
    else:
        r = baselines.run_driftline(t.model_copy(update=dict(base_sparse_lr=lr)), 0, "deepfm", batch)
    return {"model": what, "batch_size": batch, "lr": lr, "auc": r["auc"], "ex_per_s": r["ex_per_s"]}


def _best(rows: list[dict], key: str) -> dict:
    return max(rows, key=lambda r: -np.inf if r[key] is None or np.isnan(r[key]) else r[key])


def run(s: EvalSettings) -> dict:
    seed = s.seeds[0]
    grid = coll_grid(s)
    tasks = [(s, ov, seed) for ov in grid]
    lr_b, lr_l = (LR_BATCHES, LR_LRS) if s.name == "full" else ((64, 256), (0.05, 0.3))
    df_b, df_l = (DEEPFM_BATCHES, DEEPFM_LRS) if s.name == "full" else ((64,), (0.05,))
    btasks = [(s, "river", 1, lr) for lr in (RIVER_LRS if s.name == "full" else (0.1,))]
    btasks += [(s, "driftline_lr", b, lr) for b in lr_b for lr in lr_l]
    btasks += [(s, "driftline_lr_sequential", s.base_lr_seq_batch, lr)
               for lr in (SEQ_LRS if s.name == "full" else (0.1,))]
    btasks += [(s, "driftline_online", b, lr) for b in df_b for lr in df_l]
    btasks += [(s, "driftline_served", b, lr) for b in SERVED_BATCHES
               for lr in (SERVED_LRS if s.name == "full" else ((0.05, 0.3),))]
    btasks += [(s, "driftline_served_size", SIZE_BATCH, size)
               for size in (SERVED_SIZES if s.name == "full" else (SERVED_SIZES[-2],))]
    btasks += [(s, "counts", 1, p) for p in (COUNT_PRIORS if s.name == "full" else (10.0,))]
    coll = pmap(_coll_candidate, tasks, s.workers, "tune collisions")
    base = pmap(_base_candidate, btasks, s.workers, "tune baselines")
    best = _best(coll, "criterion")
    chosen = {k: getattr(s.model_copy(update=dict(**best["overrides"])), k) for k in COLL_KEYS}
    used = {k: getattr(s, k) for k in COLL_KEYS}
    t = tuning_stream(s)
    out: dict = {
        "collisions": {"split": {"train_share_of_train_part": 1 - s.coll_val_fraction,
                                 "validation_share_of_train_part": s.coll_val_fraction,
                                 "epochs": s.coll_epochs, "seed": seed},
                       "criterion": "mean validation AUC over the epochs (collisionless arm)",
                       "candidates": coll, "chosen": chosen, "settings_used": used,
                       "settings_match_choice": _same(chosen, used)},
        "baselines": {"stream": {"offset": t.base_offset, "ratings": t.base_limit},
                      "criterion": "progressive-validation AUC on the tuning stream, per (model, batch size)",
                      "candidates": base, "chosen": {}},
    }
    for m in ("river", "driftline_lr", "driftline_lr_sequential", "driftline_online", "driftline_served", "counts"):  # sizes: below
        for b in sorted({r["batch_size"] for r in base if r["model"] == m}):
            out["baselines"]["chosen"][f"{m}@{b}"] = _best([r for r in base if r["model"] == m and r["batch_size"] == b], "auc")
    # driftline LR's batch for the model-matched comparison: the largest (fastest) whose tuned AUC reaches River's
    chosen = out["baselines"]["chosen"]
    river = chosen.get("river@1", {}).get("auc", np.inf)
    ok = [r["batch_size"] for k, r in chosen.items() if k.startswith("driftline_lr@") and r["auc"] >= river]
    lr_batches = [r["batch_size"] for k, r in chosen.items() if k.startswith("driftline_lr@")]
    out["baselines"]["lr_batch"] = {"rule": "the largest mini-batch whose tuned AUC reaches River LR's (else the smallest)",
                                    "chosen": max(ok) if ok else min(lr_batches), "used": s.base_lr_batch}
    served = {r["batch_size"]: r["auc"] for k, r in chosen.items() if k.startswith("driftline_served@")}
    out["baselines"]["served_batch"] = {"rule": "the served model's batch with the best tuned AUC: the live trainer's default",
                                        "chosen": max(served, key=lambda b: (served[b], b)) if served else None,
                                        "used": served_batch()}
    ch = {k: list(v["lr"]) if isinstance(v["lr"], tuple) else v["lr"] for k, v in out["baselines"]["chosen"].items()}
    used = {"river@1": s.river_lr, f"driftline_lr@{s.base_lr_batch}": s.base_lr_lr,
            f"driftline_online@{s.base_batch_size}": s.base_sparse_lr,
            f"driftline_lr_sequential@{s.base_lr_seq_batch}": s.base_lr_seq_lr,
            f"driftline_served@{served_batch()}": [s.base_sparse_lr, s.base_linear_lr],
            "counts@1": s.count_prior,
            **{f"driftline_lr@{b}": lr for b, lr in s.base_lr_curve}}
    out["baselines"]["settings_used"] = used
    out["baselines"]["served_size"] = _served_size(base, chosen.get("driftline_online@1024"))
    out["baselines"]["settings_match_choice"] = (all(ch.get(k) == v for k, v in used.items() if k in ch)
                                                 and out["baselines"]["lr_batch"]["chosen"] == s.base_lr_batch
                                                 and out["baselines"]["served_batch"]["chosen"] in (None, served_batch())
                                                 and out["baselines"]["served_size"]["chosen"]
                                                 == out["baselines"]["served_size"]["used"])
    return out


def _served_size(base: list[dict], plain: dict | None) -> dict:
    """The served model's (dim, MLP): the best AUC among the sizes :data:`SPEED_MARGIN` times as fast as ``plain``
    (the plain DeepFM at batch 1024, tuned lr; the same pool of runs), else the fastest."""
    from trainer.config import SERVED_DIM, SERVED_MLP

    sizes = [r for r in base if r["model"] == "driftline_served_size"]
    bar = plain["ex_per_s"] if plain else 0.0
    fast = [r for r in sizes if r["ex_per_s"] >= SPEED_MARGIN * bar]
    pick = _best(fast, "auc") if fast else max(sizes, key=lambda r: r["ex_per_s"]) if sizes else None

    def size(z: tuple) -> list:
        return [int(z[0]), [int(x) for x in z[1]]]

    return {"rule": f"the best AUC among the served model's sizes (dim, MLP) at batch {SIZE_BATCH} at least "
                    f"{SPEED_MARGIN}x as fast as the plain DeepFM at batch 1024", "plain_ex_per_s": bar,
            "candidates": [{"size": size(r["lr"]), "auc": r["auc"], "ex_per_s": r["ex_per_s"]} for r in sizes],
            "chosen": size(pick["lr"]) if pick else None, "used": size((SERVED_DIM, SERVED_MLP))}


def _same(a: dict, b: dict) -> bool:
    return all(tuple(v) == tuple(b[k]) if isinstance(v, (list, tuple)) else v == b[k] for k, v in a.items())
