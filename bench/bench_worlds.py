"""The served model against counting clicks on worlds nobody tuned to. Last line: JSON.

Every number driftline shows for MovieLens was measured on the data its settings were chosen on.
This bench draws synthetic click logs of other shapes and asks one question of each: does the
served model (:func:`trainer.config.deepfm_config`'s defaults on ``user_id`` and ``item_id``,
online at the live trainer's batch size) rank better than the trainer's live baseline, per-user
plus per-item click rates (:class:`trainer.count_baseline.CountBaseline`)? Progressive validation
(each impression scored before it is learned); the AUC is over the second half of the stream.

Each impression is a user and an item (uniform, or Zipf with exponent ``a``), clicked with
probability ``sigmoid(user_bias + item_appeal + <p_user, q_item>)``: biases ~ N(0, 0.7), appeal ~
N(``mean``, 1), 8-dim vectors ~ N(0, ``inter``). :data:`WORLDS` names each shape. In
``noise_feature`` every impression also has a feature ``noise`` that says nothing, one of 10,000
values drawn at random (as a zip code or a device model may say nothing of what a user clicks):
the model reads it, as it would read every feature a project declares; counting does not. Its
impressions and clicks are ``uniform``'s (the feature is drawn last): that row is the model without it.

Arms: ``model`` (the served model), ``counts``, ``unstarted``: the served model with its head's
bias set to 1e-12 before training, so it learns from (almost) 0 with the dense optimizer as every
head did before :meth:`trainer.head.DenseHead.start_bias` (which leaves a bias that is not 0
alone): what starting the bias at the labels' log-odds buys, in the same run; and ``unscaled``:
the served model without its learned factor on each first-order field
(:attr:`trainer.head.DenseHead.linear_scale`): what the factors buy.

Keys (medians over ``SEEDS``, 0,1,2; ``QUICK=1``: seed 0, 200,000 impressions a world):
``auc_<arm>_<world>``, ``ctr_<world>``, ``gap_<world>`` (model - counts),
``gain_started_<world>`` (model - unstarted), ``gain_scaled_<world>`` (model - unscaled), and ``behind``: the worlds where the median gap is
below -0.002 (the served model ranking below counting clicks).
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
import torch

from services.settings import get_settings
from trainer.batch import SparseBatch
from trainer.config import deepfm_config
from trainer.count_baseline import CountBaseline
from trainer.metrics import auc
from trainer.model import SparseModel

QUICK = os.environ.get("QUICK") == "1"
SEEDS = tuple(int(x) for x in os.environ.get("SEEDS", "0" if QUICK else "0,1,2").split(","))
IMPRESSIONS = int(os.environ.get("IMPRESSIONS", 200_000 if QUICK else 400_000))
ARMS = ("model", "unstarted", "unscaled", "counts")

#: name -> (users, items, Zipf exponent of users, of items (0: uniform), appeal mean, interaction
#: scale, values of a feature that says nothing (0: none))
WORLDS: dict[str, tuple[int, int, float, float, float, float, int]] = {
    "uniform": (2_000, 200, 0.0, 0.0, -2.0, 0.5, 0),
    "one_time_users": (200_000, 50_000, 0.0, 1.1, -2.0, 0.5, 0),   # Zipf items, most users seen twice
    "rare_clicks": (5_000, 1_000, 0.8, 0.8, -5.0, 0.5, 0),         # ~1.7% clicked
    "very_rare_clicks": (5_000, 1_000, 0.8, 0.8, -6.5, 0.5, 0),    # ~0.4%
    "strong_interactions": (2_000, 500, 0.0, 0.0, -2.0, 1.0, 0),
    "additive": (5_000, 1_000, 0.8, 0.8, -2.0, 0.0, 0),            # no user x item term at all
    "heavy_users": (300, 5_000, 1.2, 0.5, -2.0, 0.5, 0),
    "noise_feature": (2_000, 200, 0.0, 0.0, -2.0, 0.5, 10_000),    # uniform, and a feature that says nothing
}


def draw(name: str, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``({slot: ids}, labels)`` of world ``name``."""
    n_users, n_items, zu, zi, mean, inter, noise = WORLDS[name]
    rng = np.random.default_rng(seed)

    def ids(k: int, a: float) -> np.ndarray:
        if a <= 0:
            return rng.integers(0, k, IMPRESSIONS)
        w = 1.0 / np.arange(1, k + 1) ** a
        return rng.choice(k, IMPRESSIONS, p=w / w.sum())

    users, items = ids(n_users, zu), ids(n_items, zi)
    p, q = rng.normal(0, inter, (n_users, 8)), rng.normal(0, inter, (n_items, 8))
    z = rng.normal(0, 0.7, n_users)[users] + rng.normal(mean, 1, n_items)[items] + np.einsum("nd,nd->n", p[users], q[items])
    labels = (rng.random(IMPRESSIONS) < 1 / (1 + np.exp(-z))).astype(np.float32)
    ids = {"user_id": users, "item_id": items}
    if noise:
        ids["noise"] = rng.integers(0, noise, IMPRESSIONS)
    return ids, labels


def scores(arm: str, ids: dict[str, np.ndarray], labels: np.ndarray, seed: int) -> np.ndarray:
    """``arm``'s progressive scores of every impression."""
    torch.manual_seed(seed)
    bs = get_settings().trainer.batch_size
    if arm == "counts":
        scorer = CountBaseline(get_settings().eval.count_prior)
    else:
        cfg = deepfm_config("worlds", slots=tuple(ids), recent_items=False, seed=seed)
        scorer = SparseModel(cfg.model_copy(update={"linear_scale_lr": None}) if arm == "unscaled" else cfg)
        if arm == "unstarted":
            with torch.no_grad():
                scorer.head.bias.fill_(1e-12)
    out = np.empty(labels.size, np.float32)
    for lo in range(0, labels.size, bs):
        hi = min(lo + bs, labels.size)
        off = np.arange(hi - lo + 1, dtype=np.int64)
        b = SparseBatch(hi - lo, {s: v[lo:hi] for s, v in ids.items()}, {s: off for s in ids}, labels=labels[lo:hi])
        out[lo:hi] = scorer.score_batch(b) if isinstance(scorer, CountBaseline) else scorer.train_step(b)[1]
    return out


def run_world(name: str, seed: int, arms: tuple[str, ...] = ARMS) -> dict[str, float]:
    ids, y = draw(name, seed)
    half = y.size // 2
    out = {f"auc_{arm}": float(auc(scores(arm, ids, y, seed)[half:], y[half:])) for arm in arms}
    out["ctr"] = float(y.mean())
    return out


def main() -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out: dict = {"seeds": list(SEEDS), "impressions": IMPRESSIONS, "behind": []}
    for name in WORLDS:
        runs = [run_world(name, seed) for seed in SEEDS]
        for key in runs[0]:
            out[f"{key}_{name}"] = round(float(np.median([r[key] for r in runs])), 4)
        gap = float(np.median([r["auc_model"] - r["auc_counts"] for r in runs]))
        out[f"gap_{name}"] = round(gap, 4)
        for arm, key in (("unstarted", "started"), ("unscaled", "scaled")):
            out[f"gain_{key}_{name}"] = round(float(np.median([r["auc_model"] - r[f"auc_{arm}"] for r in runs])), 4)
        if gap < -0.002:
            out["behind"].append(name)
        print(name, {k: round(v, 4) for k, v in runs[-1].items()}, file=sys.stderr, flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
