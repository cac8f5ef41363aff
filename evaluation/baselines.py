"""Baselines on one stream (the first ``base_limit`` ratings of ml-1m in time order), every model
from scratch with progressive validation (score each example before learning it):

* ``driftline_online``: the DeepFM of every other experiment, :class:`trainer.model.SparseModel`
  over collisionless PS tables, mini-batches of ``base_batch_size`` (scores come from
  ``train_step``'s forward pass, before the update);
* ``driftline_online_throughput``: the same DeepFM at ``batch_size`` (throughput setting);
* ``driftline_served``: the model ``make up`` serves (:func:`evaluation.common.served_model_config`:
  the same DeepFM whose first-order weights learn example by example inside each mini-batch of
  the live trainer's ``batch_size``, :mod:`trainer.sequential`); judged against the sequential LR's AUC and
  ``driftline_online_throughput``'s examples/s;
* ``driftline_init_defaults``: the model a new project gets from ``driftline init``
  (:func:`evaluation.common.init_model_config`: the template's dim, MLP and optimizers, untuned)
  at the live trainer's batch size (``Settings().trainer.batch_size``);
* ``counts``: per-user and per-item click-rate counts in the same order (each example scored from
  the counts of the examples before it, then counted): ``logit(user rate) + logit(item rate) -
  logit(global rate)``, each rate smoothed toward the global rate so far by ``count_prior``
  examples. The naive baseline every learned model must beat;
* ``driftline_lr``: logistic regression (:func:`trainer.config.lr_config`) on the same PS path,
  on exactly River's features: the 8 MovieLens slots, one weight per ``slot=id``, genres mean-pooled
  (River's 1/len weights), no ``recent_items`` (ml-1m has none); ``lr_config`` would sum genres;
* ``driftline_lr_curve``: the same LR at several mini-batches (speed against quality);
* ``driftline_lr_sequential``: the same LR with ``ModelConfig.sequential`` at mini-batch
  ``base_lr_seq_batch``: within a batch each example is scored, then its weights are stepped
  before the next one is scored (River's order), in one numba pass; only the bias waits for the
  batch's end. The model-matched LR comparison is judged with it;
* ``hashed_embedding``: the same :class:`trainer.head.DenseHead`, with every slot's ids hashed
  (salted per slot) into one fixed-size ``nn.Embedding``-style weight of ``hashed_buckets`` rows
  (plus a first-order one), pooled with ``F.embedding_bag``, sparse Adagrad (same lr) for the
  embeddings, Adam for the head: the "TensorFlow-style" fixed-size table;
* ``river`` (LogisticRegression) and ``river_fm`` (FMClassifier), example by example through
  ``predict_proba_one`` / ``learn_one`` (River's progressive validation), on one-hot features
  ``slot=id`` of the same slots (genres weighted 1/len, like the DeepFM's mean pooling). Building
  River's feature dicts is *not* timed, and neither is building driftline's mini-batches.

Examples/s count scoring + learning. Runs share the pool with each other (one torch thread each).

``base_other_datasets`` (ml-100k) repeat the served model, the DeepFM at ``batch_size``, the
sequential LR and the counts on each whole data set, with the settings tuned on ml-1m's tuning
stream (nothing is tuned on them).

>>> from evaluation.common import auc
>>> y = np.array([1, 1, 0, 0, 1, 0], np.float32)
>>> p = count_scores(np.array([0, 0, 1, 1, 0, 1]), np.array([5, 6, 5, 6, 7, 7]), y, prior=1.0)
>>> round(float(p[0]), 3), bool(p[4] > p[5])  # first example: no counts yet; user 0 clicks, user 1 does not
(0.5, True)
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import AdagradConfig
from trainer.batch import SparseBatch
from trainer.config import ModelConfig, lr_config
from trainer.count_baseline import CountBaseline
from trainer.head import DenseHead
from trainer.model import SparseModel

from .common import EvalSettings, auc, data, init_model_config, mean_std, model_config, pmap, served_batch, served_model_config

_MIX = np.uint64(0x9E3779B97F4A7C15)


def _salted_hash(ids: np.ndarray, salt: int, bits: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (ids.astype(np.uint64) ^ np.uint64(salt)) * _MIX
        x ^= x >> np.uint64(29)
        x *= _MIX
    return (x >> np.uint64(64 - bits)).astype(np.int64)


class HashedEmbeddingDeepFM(nn.Module):
    """DeepFM with a fixed-size hashed embedding (collisions by construction)."""

    def __init__(self, cfg: ModelConfig, buckets: int, seed: int):
        super().__init__()
        if buckets & (buckets - 1):
            raise ValueError("hashed_buckets must be a power of two")
        self.cfg, self.bits = cfg, buckets.bit_length() - 1
        self.head = DenseHead(cfg)
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(buckets, cfg.embed_dim, generator=g) * 0.01)
        self.lin = nn.Parameter(torch.zeros(buckets, 1))
        self.slots = list(cfg.slots)
        self.salts = {s: (i + 1) * 0x5851F42D4C957F2D & 0x7FFF_FFFF_FFFF_FFFF for i, s in enumerate(self.slots)}
        self.sparse_opt = torch.optim.Adagrad([self.emb, self.lin], lr=cfg.table(self.slots[0]).optimizer.lr)
        self.dense_opt = torch.optim.Adam(self.head.parameters(), lr=cfg.dense_lr)

    def buckets_of(self, b: SparseBatch, slot: str) -> np.ndarray:
        return _salted_hash(b.ids[slot], self.salts[slot], self.bits)

    def forward(self, b: SparseBatch) -> torch.Tensor:
        embs, lins = [], []
        for s in self.slots:
            ids = torch.from_numpy(self.buckets_of(b, s))
            offs = torch.from_numpy(b.offsets[s][:-1])
            mode = self.cfg.pooling.get(s, "sum")
            embs.append(F.embedding_bag(ids, self.emb, offs, mode=mode, sparse=True))
            lins.append(F.embedding_bag(ids, self.lin, offs, mode=mode, sparse=True))
        return self.head(torch.stack(embs, 1), torch.cat(lins, 1), None)

    def train_step(self, b: SparseBatch) -> np.ndarray:
        logits = self.forward(b)
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(b.labels))
        self.sparse_opt.zero_grad(set_to_none=True)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        return torch.sigmoid(logits.detach()).numpy()


def _batches(d, rows: np.ndarray, bs: int) -> list:
    """The stream's mini-batches, built before the clock starts: River's feature dicts are built
    untimed too, so both sides are timed on scoring + learning alone."""
    return [(a, d.batch(rows[a:a + bs])) for a in range(0, rows.size, bs)]


def _stream(s: EvalSettings):
    d = data(s, s.base_limit, s.base_offset)
    return d, np.arange(len(d))


def lr_model_config(s: EvalSettings, lr: float | None = None, model_id: str = "base-lr",
                    sequential: bool = False) -> ModelConfig:
    """LR on River's features (see the module docstring), sparse Adagrad at ``lr`` (default
    ``base_lr_lr``, or ``base_lr_seq_lr`` when ``sequential``)."""
    d = lr_config(model_id, recent_items=False, sequential=sequential).model_dump()
    d["pooling"] = {"genres": "mean"}
    default = s.base_lr_seq_lr if sequential else s.base_lr_lr
    d["tables"][0]["optimizer"] = AdagradConfig(lr=default if lr is None else lr).model_dump()
    return ModelConfig.model_validate(d)


def deepfm_model_config(s: EvalSettings, seed: int, model_id: str = "base-deepfm") -> ModelConfig:
    """The experiments' DeepFM with the stream's (tuned) sparse lr."""
    return model_config(s.model_copy(update=dict(sparse_lr=s.base_sparse_lr)), seed, model_id)


def count_scores(users: np.ndarray, items: np.ndarray, y: np.ndarray, prior: float) -> np.ndarray:
    """The ``counts`` baseline's probability for each example (see the module docstring): the
    trainer's live baseline (:class:`trainer.count_baseline.CountBaseline`) over the whole stream."""
    return CountBaseline(prior).score_and_count(users, items, np.asarray(y, np.float64))


def run_counts(s: EvalSettings, seed: int = 0) -> dict:
    d, rows = _stream(s)
    t0 = time.perf_counter()
    p = count_scores(d.user_id[rows], d.item_id[rows], d.label[rows], s.count_prior)
    dt = time.perf_counter() - t0
    return {"seed": seed, "auc": auc(p, d.label), "ex_per_s": rows.size / dt, "seconds": dt, "batch_size": 1,
            "count_prior": s.count_prior}


def run_driftline(s: EvalSettings, seed: int, kind: str, batch_size: int | None = None, lr: float | None = None,
                  size: tuple | None = None) -> dict:
    """One progressive pass; ``size``: the served model's ``(dim, MLP)`` instead of its own."""
    d, rows = _stream(s)
    cfg = (deepfm_model_config(s, seed) if kind == "deepfm"
           else served_model_config(s, seed, size=size) if kind == "served"
           else init_model_config(seed) if kind == "init"
           else lr_model_config(s, lr, sequential=kind == "lr_sequential"))
    model = SparseModel(cfg)
    bs = batch_size or s.base_batch_size
    batches = _batches(d, rows, bs)
    p = np.empty(rows.size, np.float32)
    t0 = time.perf_counter()
    for a, b in batches:
        p[a:a + b.size] = model.train_step(b)[1]
    dt = time.perf_counter() - t0
    return {"seed": seed, "auc": auc(p, d.label), "batch_size": bs,
            "ex_per_s": rows.size / dt, "seconds": dt, "rows": int(sum(len(t) for t in model.tables.values()))}


def run_hashed(s: EvalSettings, seed: int) -> dict:
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    d, rows = _stream(s)
    model = HashedEmbeddingDeepFM(deepfm_model_config(s, seed, "base-hashed"), s.hashed_buckets, seed)
    p = np.empty(rows.size, np.float32)
    used, keys = set(), set()
    bs = s.base_batch_size
    batches = _batches(d, rows, bs)
    t0 = time.perf_counter()
    for a, b in batches:
        p[a:a + b.size] = model.train_step(b)
    dt = time.perf_counter() - t0
    b = d.batch(rows)  # collision rate of the table over every (slot, id) in the stream
    for sl in model.slots:
        u = np.unique(b.ids[sl])
        keys.update((sl, int(x)) for x in u)
        used.update(model.buckets_of(SparseBatch(u.size, {sl: u}, {sl: np.arange(u.size + 1)}), sl).tolist())
    return {"seed": seed, "auc": auc(p, d.label), "ex_per_s": rows.size / dt, "batch_size": bs,
            "seconds": dt, "buckets": s.hashed_buckets, "distinct_keys": len(keys),
            "keys_sharing_a_row": float(1 - len(used) / len(keys)) if keys else 0.0}


def _river_features(d, rows) -> list[dict]:
    f = d.features
    out = []
    for u, i in zip(d.user_id[rows].tolist(), d.item_id[rows].tolist()):
        x = {}
        for k, v in f.user_slots(u).items():
            for id_ in v:
                x[f"{k}={id_}"] = 1.0
        for k, v in f.item_slots(i).items():
            w = 1.0 / len(v) if k == "genres" and v else 1.0
            for id_ in v:
                x[f"{k}={id_}"] = w
        out.append(x)
    return out


def run_river(s: EvalSettings, kind: str, seed: int = 0) -> dict:
    from river import facto, linear_model, optim

    d, rows = _stream(s)
    X, Y = _river_features(d, rows), (d.label[rows] > 0.5).tolist()
    if kind == "lr":
        model = linear_model.LogisticRegression(optimizer=optim.SGD(s.river_lr))
    else:
        model = facto.FMClassifier(n_factors=s.dim, seed=seed)
    p = np.empty(len(X), np.float32)
    t0 = time.perf_counter()
    for j, (x, y) in enumerate(zip(X, Y)):
        p[j] = model.predict_proba_one(x).get(True, 0.0)
        model.learn_one(x, y)
    dt = time.perf_counter() - t0
    desc = (f"river.linear_model.LogisticRegression(optimizer=optim.SGD({s.river_lr}))" if kind == "lr"
            else f"river.facto.FMClassifier(n_factors={s.dim})")
    return {"seed": seed, "auc": auc(p, d.label), "ex_per_s": len(X) / dt, "seconds": dt, "batch_size": 1,
            "river_model": desc}


_WARM: set = set()


def _warm_up(s: EvalSettings) -> None:
    """Untimed: compile/load the PS kernels and torch paths once per process before timing."""
    if s in _WARM:
        return
    d, rows = _stream(s)
    b = d.batch(rows[:256])
    for cfg in (deepfm_model_config(s, 99, "warm"), served_model_config(s, 99, "warm"), lr_model_config(s, model_id="warm"),
                lr_model_config(s, model_id="warm", sequential=True)):
        m = SparseModel(cfg)
        for _ in range(3):
            m.train_step(b)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    h = HashedEmbeddingDeepFM(deepfm_model_config(s, 99, "warm"), s.hashed_buckets, 99)
    for _ in range(3):
        h.train_step(b)
    _WARM.add(s)


def _task(s: EvalSettings, what: str, seed: int, batch: int | None = None, lr: float | None = None) -> dict:
    _warm_up(s)
    if what == "river":
        r = run_river(s, "lr", seed)
    elif what == "river_fm":
        r = run_river(s, "fm", seed)
    elif what == "hashed_embedding":
        r = run_hashed(s, seed)
    elif what == "driftline_online_throughput":
        r = run_driftline(s, seed, "deepfm", s.batch_size)
    elif what == "driftline_served":
        r = run_driftline(s, seed, "served", served_batch())
    elif what == "driftline_init_defaults":
        r = run_driftline(s, seed, "init", served_batch())
    elif what == "counts":
        r = run_counts(s, seed)
    elif what == "driftline_lr":
        r = run_driftline(s, seed, "lr", s.base_lr_batch)
    elif what == "driftline_lr_sequential":
        r = run_driftline(s, seed, "lr_sequential", s.base_lr_seq_batch)
    elif what == "driftline_lr_curve":
        r = dict(run_driftline(s, seed, "lr", batch, lr), lr=lr)
    else:
        r = run_driftline(s, seed, "deepfm")
    return dict(r, model=what, dataset=s.dataset)


#: driftline_online: DeepFM, mini-batch base_batch_size (the headline); _throughput: the same at batch_size
MODELS = ("driftline_served", "driftline_init_defaults", "driftline_online", "driftline_online_throughput", "driftline_lr",
          "driftline_lr_sequential", "hashed_embedding", "river", "river_fm", "counts")
#: what runs on each of ``base_other_datasets``
OTHER_MODELS = ("driftline_served", "driftline_init_defaults", "driftline_online_throughput", "driftline_lr_sequential", "counts")


def run(s: EvalSettings) -> dict:
    d, rows = _stream(s)
    # River is deterministic for a fixed stream (LR) or slow (FM): one run each; torch models per seed.
    tasks = [(s, "river_fm", s.seeds[0]), (s, "river", s.seeds[0]), (s, "counts", s.seeds[0])]
    tasks += [(s, m, seed) for m in ("hashed_embedding", "driftline_served", "driftline_init_defaults", "driftline_online",
                                     "driftline_online_throughput", "driftline_lr", "driftline_lr_sequential")
              for seed in s.seeds]
    others = [s.model_copy(update=dict(dataset=ds, base_limit=s.base_other_limit, base_offset=0)) for ds in s.base_other_datasets]
    tasks += [(o, m, seed) for o in others for m in OTHER_MODELS for seed in (s.seeds[:1] if m == "counts" else s.seeds)]
    # LR starts from zeros and its stream order is fixed: the seed changes nothing, one run per point
    tasks += [(s, "driftline_lr_curve", s.seeds[0], b, lr) for b, lr in s.base_lr_curve]
    runs = pmap(_task, tasks, s.workers, "baselines")
    out: dict = {"dataset": s.dataset, "setup": {"ratings": int(rows.size), "offset": s.base_offset, "batch_size": s.batch_size,
                           "protocol": "progressive validation from scratch, one pass, time order"}}
    mine = [r for r in runs if r["dataset"] == s.dataset]
    out.update(_summaries(mine, MODELS))
    out["datasets"] = {}
    for o in others:
        theirs = _summaries([r for r in runs if r["dataset"] == o.dataset], OTHER_MODELS)
        theirs["setup"] = {"ratings": len(data(o, o.base_limit, 0)), "offset": 0}
        theirs["checks"] = _served_checks(theirs)
        out["datasets"][o.dataset] = theirs
    out["driftline_lr_curve"] = [{"batch_size": r["batch_size"], "lr": r["lr"], "auc_mean": r["auc"],
                                  "ex_per_s": r["ex_per_s"]} for r in runs if r["model"] == "driftline_lr_curve"]
    out["setup"].update({"deepfm_sparse_lr": s.base_sparse_lr, "driftline_lr_adagrad_lr": s.base_lr_lr,
                         "driftline_lr_sequential_adagrad_lr": s.base_lr_seq_lr, "river_lr": s.river_lr,
                         "served_batch_size": served_batch(), "served_linear_adagrad_lr": s.base_linear_lr,
                         "count_prior": s.count_prior})
    dl = out["driftline_online"]
    out["checks"] = {
        **_served_checks(out),
        "driftline_auc_ge_river": bool(dl["auc_mean"] >= out["river"]["auc_mean"]),
        "driftline_speedup_vs_river": dl["ex_per_s"] / out["river"]["ex_per_s"],
        "driftline_auc_ge_river_fm": bool(dl["auc_mean"] >= out["river_fm"]["auc_mean"]),
        "driftline_speedup_vs_river_fm": dl["ex_per_s"] / out["river_fm"]["ex_per_s"],
        "driftline_lr_speedup_vs_river": out["driftline_lr"]["ex_per_s"] / out["river"]["ex_per_s"],
        "driftline_lr_sequential_speedup_vs_river": out["driftline_lr_sequential"]["ex_per_s"] / out["river"]["ex_per_s"],
        "driftline_throughput_speedup_vs_river": out["driftline_online_throughput"]["ex_per_s"] / out["river"]["ex_per_s"],
    }
    # LR is judged with the sequential LR; the mini-batch LR and its curve stay for the trade-off they show
    out["model_matched"] = {"lr": _pair(out["driftline_lr_sequential"], out["river"], []),
                            "lr_minibatch": _pair(out["driftline_lr"], out["river"], out["driftline_lr_curve"]),
                            "fm": _pair(dl, out["river_fm"], [])}
    return out


def _summaries(runs: list[dict], models: tuple[str, ...]) -> dict:
    out = {}
    for m in models:
        rs = [r for r in runs if r["model"] == m]
        am, asd = mean_std(r["auc"] for r in rs)
        out[m] = {"auc_mean": am, "auc_std": asd, "ex_per_s": float(np.mean([r["ex_per_s"] for r in rs])),
                  "runs": len(rs), "batch_size": rs[0]["batch_size"]}
        if len(rs) > 1:
            out[m]["aucs"] = [r["auc"] for r in rs]
        for k in ("river_model", "buckets", "distinct_keys", "keys_sharing_a_row"):
            if k in rs[0]:
                out[m][k] = rs[0][k]
    return out


def _served_checks(out: dict) -> dict:
    """The served model against both of yesterday's ends (the sequential LR's AUC, the DeepFM's
    examples/s at the live batch) and against counting."""
    sv, seq, fast, cnt = (out[k] for k in ("driftline_served", "driftline_lr_sequential",
                                           "driftline_online_throughput", "counts"))
    return {"served_auc_ge_lr_sequential": bool(sv["auc_mean"] >= seq["auc_mean"]),
            "served_speed_vs_deepfm_throughput": sv["ex_per_s"] / fast["ex_per_s"],
            "served_auc_minus_counts": sv["auc_mean"] - cnt["auc_mean"],
            "served_auc_gt_counts": bool(sv["auc_mean"] > cnt["auc_mean"]),
            "init_defaults_auc_gt_counts": bool(out["driftline_init_defaults"]["auc_mean"] > cnt["auc_mean"])}


def _pair(ours: dict, river: dict, curve: list[dict]) -> dict:
    """Target check for one (driftline, River) pair of the same model: AUC >= River's at >= 5x its examples/s;
    with a curve, also the fastest of its points that still reaches River's AUC."""
    out = {"auc": ours["auc_mean"], "river_auc": river["auc_mean"], "speedup": ours["ex_per_s"] / river["ex_per_s"],
           "auc_ge_river": bool(ours["auc_mean"] >= river["auc_mean"])}
    out["met"] = bool(out["auc_ge_river"] and out["speedup"] >= 5)
    ok = [c for c in curve if c["auc_mean"] >= river["auc_mean"]]
    if curve:
        out["curve_fastest_at_river_auc"] = (dict(max(ok, key=lambda c: c["ex_per_s"]),
                                                  speedup=max(c["ex_per_s"] for c in ok) / river["ex_per_s"]) if ok else None)
        fast = [c for c in curve if c["ex_per_s"] >= 5 * river["ex_per_s"]]
        out["curve_best_auc_at_5x"] = dict(max(fast, key=lambda c: c["auc_mean"])) if fast else None
        out["met"] = out["met"] or any(c["ex_per_s"] >= 5 * river["ex_per_s"] for c in ok)
    return out
