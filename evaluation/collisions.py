"""Collisionless vs MD5-hashed ids (Monolith Figure 7) on a chronological split of ml-1m.

Three arms, same DeepFM (``coll_*`` settings: ids only, tuned on validation by
:mod:`evaluation.tune`), same PS, same data order per seed; only the ``user_id`` and ``item_id``
slots differ:

* ``collisionless``: raw ids (the PS table has one row per id);
* ``hashed``: ids MD5-hashed into a space sized so that the measured share of colliding ids
  matches the paper's (7.73% of users, 2.86% of movies);
* ``hashed_harsh``: the same at ``coll_harsh_factor`` times those rates.

Training shuffles the training part each epoch (seeded); the test part is the last
``coll_test_fraction`` of ratings in time; AUC is measured on it after every epoch.
"""

from __future__ import annotations

import numpy as np

from trainer.model import SparseModel

from .common import (
    EvalSettings,
    HashedIds,
    auc,
    buckets_for_rate,
    coll_model_config,
    data,
    md5_bucket,
    mean_std,
    pmap,
    predict_rows,
    train_rows,
)

ARMS = ("collisionless", "hashed", "hashed_harsh")


def hash_plan(s: EvalSettings) -> dict:
    """Per hashed arm: buckets per slot chosen to hit the target rates, with measured rates."""
    d = data(s, s.coll_limit)
    users, items = np.unique(d.user_id), np.unique(d.item_id)
    plan = {}
    for arm, f in (("hashed", 1.0), ("hashed_harsh", s.coll_harsh_factor)):
        u = buckets_for_rate(users, min(0.95, s.coll_user_rate * f))
        i = buckets_for_rate(items, min(0.95, s.coll_item_rate * f))
        plan[arm] = {"user_id": u, "item_id": i}
    return plan


def _transform(s: EvalSettings, arm: str, plan: dict | None):
    if arm == "collisionless" or plan is None:
        return None
    d = data(s, s.coll_limit)
    max_ids = {"user_id": int(max(d.user_id.max(), max(d.features.user_ids))),
               "item_id": int(max(d.item_id.max(), max(d.features.item_ids)))}
    return HashedIds({k: v["buckets"] for k, v in plan[arm].items()}, max_ids,
                     present={"user_id": d.user_id, "item_id": d.item_id})


def split(s: EvalSettings, d, validation: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) rows in time order; with ``validation`` the test part is never touched: the
    last ``coll_val_fraction`` of the train part is held out instead (what settings are tuned on)."""
    tr, te = d.split(s.coll_test_fraction)
    if not validation:
        return tr, te
    cut = int(tr.size * (1 - s.coll_val_fraction))
    return tr[:cut], tr[cut:]


def run_one(s: EvalSettings, arm: str, seed: int, plan: dict | None, validation: bool = False) -> dict:
    """One arm, one seed: test (or validation) AUC after each of ``coll_epochs`` epochs."""
    d = data(s, s.coll_limit)
    tr, te = split(s, d, validation)
    model = SparseModel(coll_model_config(s, seed, f"coll-{arm}"))
    tf = _transform(s, arm, plan)
    rng = np.random.default_rng(seed)
    aucs, train_aucs, secs, n = [], [], 0.0, 0
    for _ in range(s.coll_epochs):
        rows = rng.permutation(tr)
        p, dt = train_rows(model, d, rows, s.batch_size, tf)
        secs += dt
        n += rows.size
        train_aucs.append(auc(p, d.label[rows]))
        aucs.append(auc(predict_rows(model.predict, d, te, transform=tf), d.label[te]))
    return {"arm": arm, "seed": seed, "test_auc": aucs, "train_auc_progressive": train_aucs,
            "ex_per_s": n / secs if secs else float("nan"), "rows": {name: len(t) for name, t in model.tables.items()}}


def _touched(d, rows: np.ndarray, arm_plan: dict) -> float:
    """Share of ``rows`` whose user or movie shares its bucket with another id of the data."""
    hit = np.zeros(rows.size, bool)
    for slot, ids in (("user_id", d.user_id), ("item_id", d.item_id)):
        u = np.unique(ids)
        b = md5_bucket(u, arm_plan[slot]["buckets"])
        _, inv, counts = np.unique(b, return_inverse=True, return_counts=True)
        colliding = set(u[counts[inv] > 1].tolist())
        hit |= np.fromiter((x in colliding for x in ids[rows].tolist()), bool, rows.size)
    return float(hit.mean()) if rows.size else 0.0


def run(s: EvalSettings) -> dict:
    plan = hash_plan(s)
    seeds = s.coll_seeds or s.seeds
    tasks = [(s, arm, seed, plan) for arm in ARMS for seed in seeds]
    runs = pmap(run_one, tasks, s.workers, "collisions")
    d = data(s, s.coll_limit)
    tr, te = d.split(s.coll_test_fraction)
    out: dict = {"setup": {"ratings": len(d), "train": int(tr.size), "test": int(te.size),
                           "epochs": s.coll_epochs, "seeds": list(seeds),
                           "first_test_time_ms": int(d.time_ms[te[0]]) if te.size else None,
                           "test_new_user_share": float(np.isin(d.user_id[te], d.user_id[tr], invert=True).mean())
                           if te.size else None,
                           "model": {"slots": list(s.coll_slots), "dim": s.coll_dim, "mlp": list(s.coll_mlp),
                                     "sparse_lr": s.coll_sparse_lr, "init_acc": s.coll_init_acc,
                                     "dense_lr": s.coll_dense_lr, "batch_size": s.batch_size}}}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        per = np.array([r["test_auc"] for r in rs], np.float64)  # [seeds, epochs]
        ms = [mean_std(per[:, e]) for e in range(per.shape[1])]
        out[arm] = {"auc_mean": ms[-1][0], "auc_std": ms[-1][1],
                    "per_epoch_mean": [m for m, _ in ms], "per_epoch_std": [sd for _, sd in ms],
                    "best_epoch_auc_mean": float(np.max([m for m, _ in ms])),
                    "ex_per_s": float(np.mean([r["ex_per_s"] for r in rs])),
                    "runs": [{"seed": r["seed"], "test_auc": r["test_auc"]} for r in rs]}
        if arm in plan:
            out[arm]["collision_rates"] = plan[arm]
            out[arm]["test_share_touched"] = _touched(d, te, plan[arm])
    base = np.array([r["test_auc"] for r in runs if r["arm"] == "collisionless"], np.float64)
    for arm in ARMS[1:]:
        other = np.array([r["test_auc"] for r in runs if r["arm"] == arm], np.float64)
        diff = base - other  # paired by seed (same shuffles, same dense init)
        margin = []
        for e in range(base.shape[1]):
            sd = max(mean_std(base[:, e])[1], mean_std(other[:, e])[1])
            margin.append(float((base[:, e].mean() - other[:, e].mean()) / sd) if sd > 0 else float("inf"))
        out[f"gain_vs_{arm}"] = {"per_epoch_mean": diff.mean(0).tolist(),
                                 "per_epoch_wins": (diff > 0).sum(0).tolist(), "seeds": int(diff.shape[0]),
                                 "per_epoch_paired_std": diff.std(0, ddof=1).tolist() if diff.shape[0] > 1 else [0.0] * diff.shape[1],
                                 "per_epoch_margin_in_std": margin,
                                 "beats_every_epoch_by_2std": bool(all(m > 2 for m in margin))}
        if diff.shape[0] > 1:
            sd = diff.std(0, ddof=1)
            out[f"gain_vs_{arm}"]["beats_every_epoch_by_2_paired_std"] = bool(np.all(diff.mean(0) > 2 * sd))
    cm, cs = out["collisionless"]["per_epoch_mean"], out["collisionless"]["per_epoch_std"]
    # "does not overfit": the last epoch is within one seed std of the best epoch
    out["collisionless"]["overfit"] = {"best_epoch": int(np.argmax(cm)) + 1, "drop_best_to_last": float(max(cm) - cm[-1]),
                                       "no_overfit": bool(max(cm) - cm[-1] <= (cs[-1] or 0.0))}
    return out
