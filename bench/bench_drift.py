"""When the traffic changes: how fast the served model follows, against what could be known, and
what a cap on Adagrad's accumulators (``max_accumulator``) buys and costs. Last line: JSON.

A synthetic shop nobody tuned to: ``USERS`` users (2,000), ``ITEMS`` items (200), each impression
a random user and item, clicked with probability ``sigmoid(appeal_item + <p_user, q_item>)``
(appeal ~ N(-2, 1), vectors of 8 dims ~ N(0, 0.5)). After ``BEFORE`` impressions every item's
appeal is drawn again (a season, a price change, the news: what people click changes at once) and
``AFTER`` more follow. Every arm learns online with progressive validation (each example scored
before it is learned) at the live trainer's batch size:

* ``plain``: the served DeepFM (:func:`trainer.config.deepfm_config`'s defaults on ``user_id`` and
  ``item_id``: sequential first-order weights and embeddings, plain Adagrad);
* ``capped``: the same with every table's Adagrad ``max_accumulator`` = ``CAP`` (30; the first-order
  tables are where it matters: their accumulators grow fastest);
* ``fresh``: the plain model started at the change (what the traffic after it alone teaches);
* ``counts``: the trainer's live baseline, click rates per user and item since the stream began;
* ``recent_counts``: the same counted with the half-life ``trainer.recent_half_life`` (the live
  baseline the trainer's recent AUC is judged against).

Keys (medians over ``SEEDS``, 0,1,2; ``QUICK=1``: seed 0, 200,000 + 100,000 impressions):
``auc_before_<arm>`` (the last 30,000 impressions before the change), ``auc_after_<arm>`` (the first
60,000 after it), ``auc_later_<arm>`` (the rest), ``recover_examples_<arm>`` (impressions after the
change until the arm's AUC over a window of 10,000 is within 0.01 of the fresh model's; None:
never); ``gain_after_capped_vs_plain`` (and ``_std`` over seeds, and the same for ``before``: the
cap's cost where nothing changes); ``flagged_<arm>``: whether the live trainer's bookkeeping
(:class:`trainer.learned.Learned`, fed the arm's scores) raised
``driftline_trainer_trails_recent_counts`` to 0.01 or more after the change (the plain model: in every
seed; the capped one: in any), and ``flagged_before_<arm>`` before it, in any seed (a false alarm); and on ml-1m's first ``ML_RATINGS`` ratings
(300,000; QUICK 100,000), where item appeal hardly changes, ``ml1m_auc_plain`` /
``ml1m_auc_capped``: what the cap costs on a stream that does not change.
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
from prometheus_client import REGISTRY

from ps import AdagradConfig
from services.settings import get_settings
from trainer.batch import SparseBatch
from trainer.config import ModelConfig, deepfm_config
from trainer.count_baseline import CountBaseline
from trainer.learned import Learned
from trainer.metrics import StreamingAUC, auc
from trainer.model import SparseModel
from trainer.sample_rates import SampleRateTracker

QUICK = os.environ.get("QUICK") == "1"
SEEDS = tuple(int(x) for x in os.environ.get("SEEDS", "0" if QUICK else "0,1,2").split(","))
BEFORE = int(os.environ.get("BEFORE", 200_000 if QUICK else 400_000))
AFTER = int(os.environ.get("AFTER", 100_000 if QUICK else 200_000))
USERS, ITEMS, DIM = int(os.environ.get("USERS", 2_000)), int(os.environ.get("ITEMS", 200)), 8
CAP = float(os.environ.get("CAP", 30.0))
ML_RATINGS = int(os.environ.get("ML_RATINGS", 100_000 if QUICK else 300_000))
WINDOW, AFTER_WINDOW, BEFORE_WINDOW = 10_000, 60_000, 30_000
ARMS = ("plain", "capped", "fresh", "counts", "recent_counts")


class Shop:
    """One seed's users, items, impressions and clicks."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        p, q = rng.normal(0, 0.5, (USERS, DIM)), rng.normal(0, 0.5, (ITEMS, DIM))
        appeal = np.stack([rng.normal(-2, 1, ITEMS), rng.normal(-2, 1, ITEMS)])  # before, after
        n = BEFORE + AFTER
        self.users, self.items = rng.integers(0, USERS, n), rng.integers(0, ITEMS, n)
        z = appeal[(np.arange(n) >= BEFORE).astype(int), self.items] + np.einsum("nd,nd->n", p[self.users], q[self.items])
        self.labels = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float32)

    def batch(self, lo: int, hi: int) -> SparseBatch:
        off = np.arange(hi - lo + 1, dtype=np.int64)
        return SparseBatch(hi - lo, {"user_id": self.users[lo:hi].astype(np.int64),
                                     "item_id": self.items[lo:hi].astype(np.int64)},
                           {"user_id": off, "item_id": off}, labels=self.labels[lo:hi],
                           sample_rate=np.ones(hi - lo, np.float32))


def capped(cfg: ModelConfig, cap: float) -> ModelConfig:
    """``cfg`` with every Adagrad table's ``max_accumulator`` set to ``cap``."""
    tables = [t.model_copy(update={"optimizer": t.optimizer.model_copy(update={"max_accumulator": cap})})
              if isinstance(t.optimizer, AdagradConfig) else t for t in cfg.tables]
    return cfg.model_copy(update={"tables": tables})


def scores(shop: Shop, arm: str, seed: int, start: int, model_cfg: ModelConfig) -> np.ndarray:
    """The arm's progressive scores from ``start`` on (NaN before)."""
    bs = get_settings().trainer.batch_size
    prior = get_settings().eval.count_prior
    out = np.full(shop.labels.size, np.nan)
    torch.manual_seed(seed)
    if arm in ("counts", "recent_counts"):
        c = CountBaseline(prior, half_life=get_settings().trainer.recent_half_life if arm == "recent_counts" else None)
        step = c.score_batch
    else:
        model = SparseModel(capped(model_cfg, CAP) if arm == "capped" else model_cfg)
        step = lambda b: model.train_step(b)[1]  # noqa: E731
    for lo in range(start, shop.labels.size, bs):
        hi = min(lo + bs, shop.labels.size)
        out[lo:hi] = step(shop.batch(lo, hi))
    return out


def flagged(shop: Shop, arm: str, p: np.ndarray) -> tuple[bool, bool]:
    """Whether the live bookkeeping, fed ``p``, flags the model behind counting recent clicks
    ``(before the change, after it)``."""
    ts, prior = get_settings().trainer, get_settings().eval.count_prior
    name = f"drift-{arm}"
    book = Learned(name, StreamingAUC(), SampleRateTracker(1e6), baseline=CountBaseline(prior),
                   recent_baseline=CountBaseline(prior, half_life=ts.recent_half_life))
    seen = [False, False]
    for lo in range(0, shop.labels.size, ts.batch_size):
        hi = min(lo + ts.batch_size, shop.labels.size)
        book.batch(shop.batch(lo, hi), 0.5, p[lo:hi], None)
        gap = REGISTRY.get_sample_value("driftline_trainer_trails_recent_counts", {"model": name}) or 0.0
        seen[int(lo >= BEFORE)] |= gap >= 0.01
    return seen[0], seen[1]


def _auc(p: np.ndarray, y: np.ndarray) -> float:
    return float(auc(p.astype(np.float32), y))


def run_seed(seed: int) -> dict:
    shop = Shop(seed)
    cfg = deepfm_config("drift", slots=("user_id", "item_id"), recent_items=False, seed=seed)
    y, out = shop.labels, {}
    t0 = time.perf_counter()
    p = {arm: scores(shop, arm, seed, BEFORE if arm == "fresh" else 0, cfg) for arm in ARMS}
    for arm, s in p.items():
        if arm != "fresh":
            out[f"auc_before_{arm}"] = _auc(s[BEFORE - BEFORE_WINDOW:BEFORE], y[BEFORE - BEFORE_WINDOW:BEFORE])
        out[f"auc_after_{arm}"] = _auc(s[BEFORE:BEFORE + AFTER_WINDOW], y[BEFORE:BEFORE + AFTER_WINDOW])
        out[f"auc_later_{arm}"] = _auc(s[BEFORE + AFTER_WINDOW:], y[BEFORE + AFTER_WINDOW:])
    starts = range(BEFORE, y.size - WINDOW + 1, WINDOW)
    fresh = [_auc(p["fresh"][a:a + WINDOW], y[a:a + WINDOW]) for a in starts]
    for arm in ("plain", "capped", "counts", "recent_counts"):
        mine = [_auc(p[arm][a:a + WINDOW], y[a:a + WINDOW]) for a in starts]
        out[f"recover_examples_{arm}"] = next((i * WINDOW for i, (m, f) in enumerate(zip(mine, fresh)) if m >= f - 0.01), None)
    for arm in ("plain", "capped"):
        out[f"flagged_before_{arm}"], out[f"flagged_{arm}"] = flagged(shop, arm, p[arm])
    out["seconds"] = time.perf_counter() - t0
    return out


def ml1m(seed: int) -> dict:
    """The served model and the capped one on ml-1m's first ratings (progressive AUC)."""
    from evaluation.common import data, full, served_model_config

    s = full()
    d = data(s, ML_RATINGS)
    rows = np.arange(len(d))
    bs = get_settings().trainer.batch_size
    out = {}
    for arm in ("plain", "capped"):
        torch.manual_seed(seed)
        cfg = served_model_config(s, seed)
        model = SparseModel(capped(cfg, CAP) if arm == "capped" else cfg)
        p = np.concatenate([model.train_step(d.batch(rows[a:a + bs]))[1] for a in range(0, rows.size, bs)])
        out[f"ml1m_auc_{arm}"] = _auc(p, d.label)
    return out


def _median(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return round(float(np.median(vals)), 4) if vals else None


def main() -> None:
    torch.set_num_threads(1)
    runs = [run_seed(seed) for seed in SEEDS]
    ml = [ml1m(seed) for seed in SEEDS]
    out: dict = {"seeds": list(SEEDS), "before": BEFORE, "after": AFTER, "users": USERS, "items": ITEMS, "cap": CAP,
                 "recent_half_life": get_settings().trainer.recent_half_life}
    for key in runs[0]:
        vals = [r[key] for r in runs]
        if key.startswith("flagged"):  # the plain model after the change: in every seed; the rest: in any
            out[key] = all(vals) if key == "flagged_plain" else any(vals)
        elif key != "seconds":
            out[key] = _median(vals)
    for when in ("before", "after", "later"):
        gains = [r[f"auc_{when}_capped"] - r[f"auc_{when}_plain"] for r in runs]
        out[f"gain_{when}_capped_vs_plain"] = round(float(np.mean(gains)), 4)
        out[f"gain_{when}_capped_vs_plain_std"] = round(float(np.std(gains, ddof=1)), 4) if len(gains) > 1 else None
    for key in ml[0]:
        out[key] = _median([m[key] for m in ml])
    gains = [m["ml1m_auc_capped"] - m["ml1m_auc_plain"] for m in ml]
    out["ml1m_gain_capped_vs_plain"] = round(float(np.mean(gains)), 4)
    out["ml1m_gain_capped_vs_plain_std"] = round(float(np.std(gains, ddof=1)), 4) if len(gains) > 1 else None
    out["seconds"] = round(sum(r["seconds"] for r in runs), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
