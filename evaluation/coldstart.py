"""``driftline eval coldstart``: how the models do on users and items they have never seen (issue 36).

The stream is the first ``base_limit`` ratings of ml-1m in time order, learned once from scratch
with progressive validation (every example scored before it is learned). Its first
``cold_split`` share stands for the batch data a model starts from; the rest is the online part,
where every number here is measured:

* a **cold user** is one the batch part never saw (on ml-1m most of the online part: users arrive
  in bursts); ``users_first_k`` is the AUC over cold users' first ``k`` online examples, for k in
  :data:`FIRST`: what a new user's first requests get;
* a **cold item** likewise (an item first rated in the online part), ``items_first_k``;
* ``overall``: the AUC over the whole online part (cold-start help must not cost the warm users).

Arms: ``served`` (the model ``make up`` serves: sequential first-order weights and embeddings, at
the live trainer's batch size), ``meta`` (the same with new users' starting points meta-learned from
the stream: ``ModelConfig.meta``, :mod:`trainer.meta`), ``content`` (the same with a content encoder over
the items' title words and genres, its output added to the item's embedding:
``ModelConfig.content``, :mod:`trainer.content`), ``both`` (the served model with the meta-learned
starts and the content encoder together), ``deepfm`` (the collisions experiment's plain DeepFM:
every table stepped once per batch, plain Adagrad, no first-order factors) and ``counts``
(per-user and per-item click rates: a new user's first example gets the global rate). Each runs
every seed of ``seeds``; for each learned arm the paired differences against ``served`` (same
seed) are reported with their std.

>>> firsts(np.array([7, 8, 7, 7, 8]), np.array([True, True, True, False, True]), (1, 2))
{1: array([ True,  True, False, False, False]), 2: array([ True,  True,  True, False,  True])}
"""

from __future__ import annotations

import time

import numpy as np

from movielens.features import ITEM_CONTENT
from services.settings import EvalSettings
from trainer.config import ContentConfig, MetaConfig
from trainer.model import SparseModel

from .baselines import count_scores
from .common import auc, data, mean_std, model_config, pmap, served_batch, served_model_config

__all__ = ["ARMS", "FIRST", "firsts", "run"]

#: the first-k buckets of a cold user's (item's) online examples
FIRST = (1, 5, 10, 20)
ARMS = ("served", "meta", "content", "both", "deepfm", "counts")


def firsts(keys: np.ndarray, cold: np.ndarray, ks: tuple[int, ...] = FIRST) -> dict[int, np.ndarray]:
    """Per ``k``: which examples are among the first ``k`` of their (cold) key's, in stream order."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    start = np.r_[0, np.flatnonzero(sk[1:] != sk[:-1]) + 1]
    rank = np.empty(keys.size, np.int64)
    rank[order] = np.arange(keys.size) - np.repeat(start, np.diff(np.r_[start, keys.size]))
    return {k: cold & (rank < k) for k in ks}


def _split(s: EvalSettings):
    d = data(s, s.base_limit, s.base_offset, content=True)  # (only the content arm reads the items' content)
    n = d.label.size
    cut = int(n * s.cold_split)
    online = np.arange(cut, n)
    cold_user = ~np.isin(d.user_id[online], d.user_id[:cut])
    cold_item = ~np.isin(d.item_id[online], d.item_id[:cut])
    masks = {"overall": np.ones(online.size, bool)}
    for what, keys, cold in (("users", d.user_id[online], cold_user), ("items", d.item_id[online], cold_item)):
        for k, m in firsts(keys, cold).items():
            masks[f"{what}_first_{k}"] = m
    return d, cut, masks


def run_arm(s: EvalSettings, arm: str, seed: int) -> dict:
    """One progressive pass of ``arm`` with ``seed``: its AUC on every bucket, examples/s."""
    d, cut, masks = _split(s)
    n = d.label.size
    if arm == "counts":
        t0 = time.perf_counter()
        p = count_scores(d.user_id, d.item_id, d.label, s.count_prior)
    else:
        cfg = model_config(s, seed, "cold-deepfm") if arm == "deepfm" else served_model_config(s, seed, f"cold-{arm}")
        if arm in ("meta", "both"):  # the served model with new users' starting points meta-learned (trainer.meta)
            cfg = cfg.model_copy(update={"meta": MetaConfig(task_slot="user_id")})
        if arm in ("content", "both"):  # ... with a content encoder over titles and genres (trainer.content)
            cfg = cfg.model_copy(update={"content": ContentConfig(slot=ITEM_CONTENT, item_slot="item_id")})
        bs = served_batch()
        # a kernel's first call in a process loads (or compiles) it: a fixed cost, paid outside the
        # timing by a throwaway model, so that examples/s is every arm's throughput alike
        SparseModel(cfg).train_step(d.batch(np.arange(min(n, bs))))
        t0 = time.perf_counter()
        model = SparseModel(cfg)
        p = np.empty(n, np.float32)
        for a in range(0, n, bs):
            p[a:a + bs] = model.train_step(d.batch(np.arange(a, min(n, a + bs))))[1]
    dt = time.perf_counter() - t0
    y, q = d.label[cut:], p[cut:]
    out = {f"auc_{name}": auc(q[m], y[m]) for name, m in masks.items()}
    return {"arm": arm, "seed": seed, "ex_per_s": n / dt, "examples": {name: int(m.sum()) for name, m in masks.items()},
            **out}


def run(s: EvalSettings) -> dict:
    """Every arm and seed; per arm the mean and std of each AUC, and the paired differences
    against ``served``."""
    tasks = [(s, arm, seed) for arm in ARMS for seed in s.seeds]
    runs = pmap(run_arm, tasks, s.workers, "coldstart")
    by = {(r["arm"], r["seed"]): r for r in runs}
    keys = [k for k in runs[0] if k.startswith("auc_")]
    arms: dict = {}
    for arm in ARMS:
        rs = [by[(arm, seed)] for seed in s.seeds]
        a = {k: dict(zip(("mean", "std"), mean_std(r[k] for r in rs), strict=True)) for k in keys}
        a["ex_per_s"] = float(np.median([r["ex_per_s"] for r in rs]))
        if arm != "served":
            a["vs_served"] = {k: dict(zip(("mean", "std"), mean_std(by[(arm, sd)][k] - by[("served", sd)][k]
                                                                       for sd in s.seeds), strict=True))
                              for k in keys}
        arms[arm] = a
    _, cut, masks = _split(s)
    return {"setup": {"ratings": int(cut + masks["overall"].size), "offset": s.base_offset, "batch_part": cut,
                      "cold_split": s.cold_split,
                      "first": list(FIRST), "batch_size": served_batch(), "seeds": list(s.seeds),
                      "examples": {name: int(m.sum()) for name, m in masks.items()}},
            "arms": arms, "runs": runs}


def markdown(st: dict, c: dict) -> list[str]:
    """The section of ``results.md``."""
    ex = st["examples"]
    buckets = ["overall"] + [f"{w}_first_{k}" for w in ("users", "items") for k in st["first"]]
    L = [f"`driftline eval coldstart`: the first {st['ratings']:,} ratings in time order, learned once from scratch "
         f"with progressive validation at batch {st['batch_size']}; the first {st['cold_split']:.0%} stand for the "
         f"batch data, every AUC is over the {ex['overall']:,} online examples after them. A cold user (item) is one "
         "the batch part never saw; `users_first_k`: cold users' first k online examples "
         f"({_counts(ex, 'users', st['first'])} examples; cold items' {_counts(ex, 'items', st['first'])}). Mean ± std over seeds "
         f"{st['seeds']}; for each arm its paired difference with `served` (same seed). Arms: `served`, the model "
         "`make up` serves; `meta`, the same with new users' starting points meta-learned from the stream "
         "(`[model] meta = {task_slot = \"user_id\"}`, `trainer/meta.py`: each new user's first 5 examples as "
         "support, the next 5 as query, the starting Adagrad accumulators of its rows learned first-order); "
         "`content`, the served model with a content encoder over the items' title words and genres (`[model] "
         "content`, `trainer/content.py`), its output added to the item's embedding; `both`, the served model "
         "with the meta-learned starts and the content encoder together; `deepfm`, the collisions experiment's "
         "plain DeepFM (every table stepped once per batch, plain Adagrad, no first-order factors); `counts`, "
         "per-user and per-item click rates.", "",
         "| arm | " + " | ".join(buckets) + " | ex/s |", "|---|" + "---|" * (len(buckets) + 1)]
    for arm, a in c["arms"].items():
        cells = [f"{a[f'auc_{b}']['mean']:.4f} ± {a[f'auc_{b}']['std']:.4f}" for b in buckets]
        L.append(f"| {arm} | " + " | ".join(cells) + f" | {a['ex_per_s'] / 1000:,.1f}k |")
        if "vs_served" in a:
            d = a["vs_served"]
            L.append(f"| {arm} − served | " + " | ".join(f"{d[f'auc_{b}']['mean']:+.4f} ± {d[f'auc_{b}']['std']:.4f}"
                                                       for b in buckets) + " | |")
    return L + [""]


def _counts(ex: dict, what: str, first: list[int]) -> str:
    return ", ".join(f"k={k}: {ex[f'{what}_first_{k}']:,}" for k in first)


def summary(c: dict) -> list[str]:
    """Terminal lines: each arm's overall and first-10 AUCs."""
    return [f"coldstart.{arm}: AUC overall {a['auc_overall']['mean']:.4f}, cold users' first 10 "
            f"{a['auc_users_first_10']['mean']:.4f}, cold items' first 10 {a['auc_items_first_10']['mean']:.4f}"
            for arm, a in c["arms"].items()]
