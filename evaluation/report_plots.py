"""The results' PNG plots (``docs/eval_*.png``), one per section of :mod:`evaluation.report`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .baselines import MODELS as BASELINE_MODELS


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_collisions(c: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm, label in (("collisionless", "collisionless"), ("hashed", "MD5-hashed (paper rates)"),
                       ("hashed_harsh", "MD5-hashed (harsh)")):
        a = c.get(arm)
        if not a:
            continue
        m, s = np.array(a["per_epoch_mean"], float), np.array(a["per_epoch_std"], float)
        x = np.arange(1, m.size + 1)
        ax.errorbar(x, m, yerr=s, marker="o", capsize=3, label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test AUC (chronological split)")
    ax.set_title("ml-1m DeepFM on ids: collisionless vs hashed (cf. Monolith Fig. 7)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_online(o: dict, path: Path) -> None:
    plt = _plt()
    ks = [k for k in ("N10", "N50", "N100") if k in o]
    fig, axes = plt.subplots(1, len(ks) + 1, figsize=(4.2 * (len(ks) + 1), 3.8))
    for ax, k in zip(axes, ks):
        on = np.array(o[k]["shard_auc_mean"], float)
        bo = np.array(o[k]["batch_only_shard_auc_mean"], float)
        x = np.arange(1, on.size + 1)
        ax.plot(x, on, label="online", lw=1.2)
        ax.plot(x, bo, label="batch-only", lw=1.2)
        ax.set_title(f"{k}: AUC per shard")
        ax.set_xlabel("shard (time order)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("AUC")
    axes[0].legend()
    ax = axes[-1]
    names = ["batch_only"] + ks
    ax.errorbar(range(len(names)), [o[n]["auc_mean"] for n in names], yerr=[o[n]["auc_std"] for n in names],
                fmt="o", capsize=4)
    ax.set_xticks(range(len(names)), ["batch" if n == "batch_only" else n for n in names])
    ax.set_title("average AUC (mean ± std, seeds)")
    ax.grid(alpha=0.3)
    fig.suptitle("ml-1m: Algorithm 1 with sync through ParameterDelta (cf. Monolith Fig. 9/10)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_staleness(s: dict, path: Path) -> None:
    plt = _plt()
    st = s["setup"]
    f = st["failure_before_shard"]
    fig, ax = plt.subplots(figsize=(7, 4))
    base = np.array(s["no_failure"]["shard_auc_mean"], float)
    lo = max(0, f - max(st["k"] + [1]) - 2)
    x = np.arange(lo, base.size)
    ax.plot(x + 1, base[lo:], color="k", lw=2, label="no failure")
    for k in st["k"]:
        a = s.get(f"k{k}")
        if a:
            y = np.array(a["shard_auc_mean"], float)
            ax.plot(np.arange(f, y.size) + 1, y[f:], lw=1, label=f"restore snapshot {k} shards old")
    ax.axvline(f + 0.5, color="r", ls="--", lw=1)
    ax.set_xlabel(f"shard (N = {st['N']}); failure before shard {f + 1}")
    ax.set_ylabel("AUC (mean over seeds)")
    ax.set_title("ml-1m: AUC after restoring a stale snapshot")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_baselines(b: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in BASELINE_MODELS:
        a = b.get(m)
        if not a or a.get("auc_mean") is None:
            continue
        ax.errorbar(a["ex_per_s"], a["auc_mean"], yerr=a.get("auc_std") or 0, fmt="o", capsize=3)
        ax.annotate(m, (a["ex_per_s"], a["auc_mean"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    curve = b.get("driftline_lr_curve") or []
    if curve:
        ax.plot([c["ex_per_s"] for c in curve], [c["auc_mean"] for c in curve], "s--", color="gray", lw=1, ms=4,
                label="driftline LR by mini-batch")
        for c in curve:
            ax.annotate(str(c["batch_size"]), (c["ex_per_s"], c["auc_mean"]), textcoords="offset points",
                        xytext=(3, -10), fontsize=7, color="gray")
        r = b.get("river")
        if r:
            ax.axvline(5 * r["ex_per_s"], color="r", ls=":", lw=1, label="5x River LR")
        ax.legend(fontsize=8, loc="lower left")
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi * 3)  # room for the rightmost point's label
    ax.set_xlabel("examples/s (score + learn, 1 thread)")
    ax.set_ylabel("progressive-validation AUC")
    ax.set_title("Same stream, from scratch: quality vs throughput")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
