"""What a position feature buys: a closed loop where the model's own ranking decides where items
are shown and the places decide the clicks (:mod:`serving.positions`). Last line: JSON.

A synthetic shop (nobody tuned to it): ``USERS`` users (default 500), 1,000 items, each (user,
item) with a true relevance ``r = sigmoid(bias_item + <p_user, q_item>)``; each user's candidates
come from a pool of ``POOL`` items of their own (default 20: what retrieval hands the ranker;
``POOL=1000``: any item). A request is a user and ``K`` = 10 candidates from their pool, shown in
the ranked order, and the item at place ``k`` is clicked with probability ``r / (1 + k)`` (the first
place is looked at most). Every arm learns online from its own impressions with the served DeepFM
(``trainer.config.deepfm_config``'s defaults, batch ``trainer.batch_size``; a position is a
first-order term only, as a project file makes it unless ``model.fields`` names it, or an
embedding field too with ``POSITION_FIELD=1``), ranking each block of 32 requests with the model
as it stood before them (serving a few deltas behind):

* ``none``: the model reads user_id and item_id only (the naive baseline);
* ``answered``: and a ``source = "position"`` feature: scored at the first place, logged at the
  place answered (serving's own functions, :func:`serving.positions.scored_at_first` and
  :func:`serving.positions.logged_at_answer`);
* ``request_order``: the position declared a ``candidate`` feature, as the project template had
  it: the client gives each candidate its index in the request (it cannot know the answer's), so
  the model scores and learns places nobody saw the items at;
* ``random`` and ``oracle`` (ranked by the true relevance): the floor and the ceiling;
* with ``CANDIDATES=30 SHOWN=10`` (30 candidates ranked, the first 10 shown: what is not shown is
  not clicked), ``none_logs_all`` and ``answered_logs_all``: the same models logging every
  candidate answered, where the others log the shown ones only (``/rank``'s ``shown``,
  :mod:`serving.shown`).

Keys: ``ctr_<arm>`` (clicks per request over the second half of the requests),
``progressive_auc_counts_<arm>`` (the trainer's live baseline on the same impressions: click
rates per user and item, and per place where the model reads a position;
``..._counts_without_places_<arm>``: without the places, as it was),
``relevance_auc_<arm>`` (at the end, for every user, 20 items of their pool: the AUC of the
model's score, at the first place, against the true relevance, each item a positive of weight
``r`` and a negative of weight ``1 - r``, averaged over users: how well the model orders a user's
items by what they want, wherever the items were shown), ``progressive_auc_<arm>`` (on the arm's
own impressions, second half), medians over ``SEEDS`` (default 0,1,2; ``QUICK=1``: 0 and 8,000
requests instead of 40,000), and the paired gains of ``answered`` over ``none`` and over
``request_order`` (``gain_<key>_answered_vs_<arm>``) with their std over seeds.
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
from serving.positions import logged_at_answer, scored_at_first
from serving.shown import logged_of, take
from trainer.batch import SparseBatch
from trainer.config import ModelConfig, deepfm_config
from trainer.count_baseline import CountBaseline
from trainer.metrics import auc
from trainer.model import SparseModel

QUICK = os.environ.get("QUICK") == "1"
SEEDS = tuple(int(x) for x in os.environ.get("SEEDS", "0" if QUICK else "0,1,2").split(","))
REQUESTS = int(os.environ.get("REQUESTS", 8_000 if QUICK else 40_000))
USERS, ITEMS, DIM, BLOCK, PROBE_ITEMS = int(os.environ.get("USERS", 500)), 1_000, 8, 32, 20
K = int(os.environ.get("CANDIDATES", 10))
SHOWN = int(os.environ.get("SHOWN", K))
POOL = int(os.environ.get("POOL", max(20, 2 * K)))
# with SHOWN < K: the same models logging every candidate answered, shown or not
ARMS = ("none", "answered", "request_order", "random", "oracle") + \
    (("none_logs_all", "answered_logs_all") if SHOWN < K else ())
POSITION = "position"


class Shop:
    """The true relevances and the click draws of one seed."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.p = rng.normal(0, 0.7, (USERS, DIM))
        self.q = rng.normal(0, 0.7, (ITEMS, DIM))
        self.bias = rng.normal(-2.0, 1.0, ITEMS)
        self.users = rng.integers(0, USERS, REQUESTS)
        # each user's candidates come from a pool of their own (what retrieval hands the ranker)
        pools = np.stack([rng.choice(ITEMS, POOL, replace=False) for _ in range(USERS)])
        self.candidates = np.stack([rng.choice(pools[u], K, replace=False) for u in self.users])
        self.coins = rng.random((REQUESTS, K))  # one coin per place: every arm faces the same luck
        self.shuffles = rng.random((REQUESTS, K))  # the random arm's order
        # every user's own ranking: PROBE_ITEMS items of their pool each
        self.probe_users = np.repeat(np.arange(USERS), PROBE_ITEMS)
        self.probe_items = np.concatenate([rng.choice(pools[u], PROBE_ITEMS, replace=False) for u in range(USERS)])

    def relevance(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        z = self.bias[items] + np.einsum("nd,nd->n", self.p[users], self.q[items])
        return 1 / (1 + np.exp(-z))


def _config(arm: str, seed: int) -> ModelConfig:
    arm = arm.removesuffix("_logs_all")
    slots = ("user_id", "item_id") if arm == "none" else ("user_id", "item_id", POSITION)
    cfg = deepfm_config(f"position-{arm}", slots=slots, recent_items=False, seed=seed)
    if arm == "none":
        return cfg
    d = cfg.model_dump()
    if os.environ.get("POSITION_FIELD") != "1":  # a first-order term only, as a project declares it
        d["slots"] = {k: v for k, v in d["slots"].items() if k != POSITION}
        d["tables"] = [t for t in d["tables"] if t["name"] != POSITION]
    return ModelConfig.model_validate({**d, "position_slot": POSITION})


def weighted_auc(scores: np.ndarray, pos: np.ndarray, neg: np.ndarray) -> float:
    """AUC with each item a positive of weight ``pos`` and a negative of weight ``neg`` (ties: half).

    >>> weighted_auc(np.array([0.1, 0.9]), np.array([0.0, 1.0]), np.array([1.0, 0.0]))
    1.0
    """
    order = np.argsort(scores, kind="stable")
    s, p, n = scores[order], pos[order], neg[order]
    _, start = np.unique(s, return_index=True)
    groups = np.split(np.arange(s.size), start[1:])
    below = 0.0
    total = 0.0
    for g in groups:  # negatives below each group's positives, half of those tied with them
        total += p[g].sum() * (below + n[g].sum() / 2)
        below += n[g].sum()
    return float(total / (p.sum() * n.sum()))


def _per_user_auc(scores: np.ndarray, rel: np.ndarray) -> float:
    """The mean over users of :func:`weighted_auc` of their probe items (``PROBE_ITEMS`` each, in a row)."""
    s, r = scores.reshape(-1, PROBE_ITEMS), rel.reshape(-1, PROBE_ITEMS)
    return float(np.mean([weighted_auc(s[u], r[u], 1 - r[u]) for u in range(s.shape[0])]))


def run_arm(shop: Shop, arm: str, seed: int) -> dict:
    torch.manual_seed(seed)
    model = None if arm in ("random", "oracle") else SparseModel(_config(arm, seed))
    prior = get_settings().eval.count_prior
    # the trainer's live baseline, scored on the same impressions (with the places when the model reads them)
    counts = {"counts": CountBaseline(prior, None if model is None else model.cfg.position_slot),
              "counts_without_places": CountBaseline(prior)}
    batch_size = get_settings().trainer.batch_size
    clicks = np.zeros(REQUESTS)
    pending: list[tuple[dict, float]] = []
    progressive: list[tuple[float, float]] = []
    baseline: dict[str, list[np.ndarray]] = {name: [] for name in counts}
    t0 = time.perf_counter()
    for a in range(0, REQUESTS, BLOCK):
        block = range(a, min(a + BLOCK, REQUESTS))
        rows = [[{"user_id": [int(shop.users[r])], "item_id": [int(i)]} for i in shop.candidates[r]] for r in block]
        if arm == "request_order":
            rows = [[{**row, POSITION: [k]} for k, row in enumerate(req)] for req in rows]
        if model is not None:
            scored = rows
            if arm.startswith("answered"):  # serving's user/candidate split, merged into rows for the trainer's scorer
                scored = []
                for req in rows:
                    user, items = scored_at_first(POSITION, {}, req, given=[])
                    scored.append([{**user, **item} for item in items])
            flat = [row for req in scored for row in req]
            scores = model.predict(SparseBatch.from_slot_dicts(flat, slots=model.cfg.all_slots)).reshape(len(rows), K)
        elif arm == "oracle":
            scores = np.stack([shop.relevance(np.full(K, shop.users[r]), shop.candidates[r]) for r in block])
        else:
            scores = shop.shuffles[a:a + len(rows)]
        for j, r in enumerate(block):
            order = np.argsort(-scores[j], kind="stable")
            rel = shop.relevance(np.full(K, shop.users[r]), shop.candidates[r])
            place = np.empty(K, np.int64)
            place[order] = np.arange(K)
            clicked = (shop.coins[r] < rel / (1 + place)) & (place < SHOWN)  # what is not shown is not seen
            clicks[r] = clicked.sum()
            if model is None:
                continue
            logged = rows[j]
            if arm.startswith("answered"):
                logged, _ = logged_at_answer(POSITION, rows[j], [None] * K, order, given=[])
            labels = clicked.astype(np.float32).tolist()
            if (kept := logged_of(order, None if arm.endswith("_logs_all") else SHOWN)) is not None:
                logged, labels = take(kept, logged, labels)
            pending += list(zip(logged, labels))
        while model is not None and len(pending) >= batch_size:
            step, pending = pending[:batch_size], pending[batch_size:]
            batch = SparseBatch.from_slot_dicts([row for row, _ in step], slots=model.cfg.all_slots,
                                                labels=np.array([y for _, y in step], np.float32))
            _, p = model.train_step(batch)
            progressive += list(zip(p.tolist(), batch.labels.tolist()))
            for name, c in counts.items():
                baseline[name].append(c.score_batch(batch))
    seconds = time.perf_counter() - t0
    out = {"ctr": float(clicks[REQUESTS // 2:].mean()), "seconds": seconds}
    rel = shop.relevance(shop.probe_users, shop.probe_items)
    if model is not None:
        probe = [{"user_id": [int(u)], "item_id": [int(i)]} for u, i in zip(shop.probe_users, shop.probe_items)]
        if not arm.startswith("none"):
            probe = [{**row, POSITION: [0]} for row in probe]  # the first place, as serving scores
        s = model.predict(SparseBatch.from_slot_dicts(probe, slots=model.cfg.all_slots))
        out["relevance_auc"] = _per_user_auc(s.astype(np.float64), rel)
        half = len(progressive) // 2
        y = np.array([y for _, y in progressive[half:]])
        out["progressive_auc"] = auc(np.array([p for p, _ in progressive[half:]], np.float32), y)
        for name, scores in baseline.items():
            out[f"progressive_auc_{name}"] = auc(np.concatenate(scores)[half:], y)
    elif arm == "oracle":
        out["relevance_auc"] = _per_user_auc(rel, rel)
    return out


def main() -> None:
    torch.set_num_threads(1)
    res = {(arm, seed): run_arm(Shop(seed), arm, seed) for seed in SEEDS for arm in ARMS}
    out: dict = {"seeds": list(SEEDS), "requests": REQUESTS, "candidates": K, "shown": SHOWN}
    for arm in ARMS:
        for key in ("ctr", "relevance_auc", "progressive_auc", "progressive_auc_counts",
                    "progressive_auc_counts_without_places"):
            vals = [res[(arm, s)][key] for s in SEEDS if key in res[(arm, s)]]
            if vals:
                out[f"{key}_{arm}"] = round(float(np.median(vals)), 4)
    pairs = [("answered", "none"), ("answered", "request_order")]
    if SHOWN < K:
        pairs += [("none", "none_logs_all"), ("answered", "answered_logs_all")]
    for key in ("ctr", "relevance_auc"):
        for arm, other in pairs:
            gains = [res[(arm, s)][key] - res[(other, s)][key] for s in SEEDS]
            out[f"gain_{key}_{arm}_vs_{other}"] = round(float(np.mean(gains)), 4)
            out[f"gain_{key}_{arm}_vs_{other}_std"] = round(float(np.std(gains, ddof=1)), 4) if len(gains) > 1 else None
    out["seconds"] = round(sum(r["seconds"] for r in res.values()), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
