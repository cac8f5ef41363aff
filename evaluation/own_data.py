"""``driftline eval data``: is the model any good on your own examples, against naive baselines?

The joiner's dumped examples (``<var>/examples``, any project) are put in event-time order and
split: the first part is learned in one pass with progressive validation (each example scored
before it is learned, as the online trainer does), the last ``--test-fraction`` is scored by what
was learned, frozen. The examples of the joiner's last window (``joiner.window_seconds`` of event
time) are left out: a negative is emitted when its window closes, so a stack stopped mid-stream
leaves that window's positives without their negatives. On the same split, in the same order:

* ``model``: the project's model (:meth:`driftline.project.Project.model_config`) at the live
  trainer's batch size;
* ``lr``: a sequential logistic regression on the same sparse features
  (:func:`trainer.config.lr_config`: one weight per feature id, learned example by example, at
  the ``eval.base_lr_seq_lr`` tuned on ml-1m; dense features are not read);
* ``counts_user_item``: per-user + per-item click-rate counts (:class:`trainer.count_baseline.CountBaseline`,
  the online trainer's live baseline; keys: each example's ``user_id`` and ``item_id``);
* ``counts_item``: per-item click-rate counts alone (both count the places too when the model
  reads a position, as the trainer's does);
* ``counts_recent``: ``counts_user_item`` counted with the half-life ``trainer.recent_half_life``
  (the trainer's live baseline of recent clicks): traffic whose click rates change favours it;
* ``base_rate``: the click rate so far (on the holdout: the training part's).

Negative sampling is undone before judging: each score is corrected to the population as serving
corrects it (``p / (p + (1 - p) / rate)``, ``rate`` the negatives' keep rate in the example's slice,
:func:`negative_rates`) and each example weighs ``1 / sample_rate`` in the log loss and the
calibration error (AUC is unweighted: uniform sampling leaves it unchanged).
The calibration error is the weighted mean ``|mean score - click rate|`` over ten equal-count
bins of the score. Writes ``eval-data.json`` and ``eval-data.png`` (AUC over event time on the
learned part; the holdout's reliability curve) under ``--out``.

>>> y = np.array([0, 0, 1, 1.0]); w = np.ones(4)
>>> m = judged(np.array([0.1, 0.2, 0.7, 0.9]), y, w)
>>> m["auc"], round(m["log_loss"], 3), round(m["calibration_error"], 3)
(1.0, 0.198, 0.175)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from services.cli_args import at_least, run_main

__all__ = ["judged", "negative_rates", "run", "table_lines", "plot", "main", "without"]

SCORERS = ("model", "lr", "counts_user_item", "counts_item", "counts_recent", "base_rate")
#: the name of the model without a feature is this and the feature's (``--each-feature``)
LEFT_OUT = "model_without_"


def judged(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict:
    """AUC, weighted log loss, weighted calibration error (10 equal-count bins), mean score and
    click rate of probabilities ``p`` against labels ``y`` with example weights ``w``."""
    from trainer.metrics import auc

    n = y.size
    if n == 0:
        return {"examples": 0}
    q = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
    loss = -(y * np.log(q) + (1 - y) * np.log1p(-q))
    order = np.argsort(q, kind="stable")
    cal = 0.0
    for part in np.array_split(order, min(10, n)):
        cal += abs(float((w[part] * (q[part] - y[part])).sum()))  # the bin's weight x |mean score - rate|
    both = 0 < y.sum() < n
    return {"examples": int(n), "auc": float(auc(q, y)) if both else float("nan"),
            "log_loss": float((w * loss).sum() / w.sum()), "calibration_error": cal / float(w.sum()),
            "mean_score": float((w * q).sum() / w.sum()), "click_rate": float((w * y).sum() / w.sum())}


def _examples(root: Path):
    """The dumped examples with a known label, in event-time order (ties: their order on disk)."""
    import pyarrow.compute as pc

    from joiner.dumper import read_examples

    t = read_examples(root)
    if t.num_rows == 0:
        return t
    return t.take(pc.sort_indices(t, [("event_time_ms", "ascending")]))


class _Counts:
    """Click rates per item (and user), and per place where the model reads one (as the trainer's)."""

    def __init__(self, prior: float, users: bool, position_slot: str | None, half_life: float | None = None) -> None:
        from trainer.count_baseline import CountBaseline

        self.counts, self.users = CountBaseline(prior, position_slot, half_life), users

    def learn(self, b, users, items) -> np.ndarray:
        return self.counts.score_and_count(users if self.users else None, items, b.labels.astype(np.float64),
                                           self.counts.positions_of(b))

    def score(self, b, users, items) -> np.ndarray:
        return self.counts.score(users if self.users else None, items, self.counts.positions_of(b))


class _BaseRate:
    def __init__(self) -> None:
        self.clicks, self.seen = 0.0, 0.0

    def learn(self, b, users, items) -> np.ndarray:
        y = b.labels.astype(np.float64)
        p = (self.clicks + np.cumsum(y) - y + 1.0) / (self.seen + np.arange(y.size) + 2.0)
        self.clicks, self.seen = self.clicks + y.sum(), self.seen + y.size
        return p

    def score(self, b, users, items) -> np.ndarray:
        return np.full(b.size, (self.clicks + 1.0) / (self.seen + 2.0))


class _Learned:
    def __init__(self, cfg) -> None:
        from trainer.model import SparseModel

        self.model = SparseModel(cfg)

    def learn(self, b, users, items) -> np.ndarray:
        return self.model.train_step(b)[1]

    def score(self, b, users, items) -> np.ndarray:
        return self.model.predict(b)


def without(cfg, slot: str):
    """The model ``cfg`` with the sparse feature ``slot`` left out (its field, its first-order
    term, and the tables no other slot reads); None when the model cannot be without it (its only
    field, the content encoder's item slot, the meta-learning task slot).

    >>> from trainer.config import deepfm_config
    >>> cfg = deepfm_config("m", slots=("user_id", "item_id", "zip"), recent_items=False)
    >>> sorted(without(cfg, "zip").slots), [t.name for t in without(cfg, "zip").tables]
    (['item_id', 'user_id'], ['user_id', 'item_id', 'user_id_w', 'item_id_w'])
    >>> without(deepfm_config("m", slots=("user_id",), recent_items=False), "user_id") is None
    True
    """
    from trainer.config import ModelConfig

    slots = {k: v for k, v in cfg.slots.items() if k != slot}
    linear = {k: v for k, v in cfg.linear.items() if k != slot}
    used = {*slots.values(), *linear.values()}
    d = cfg.model_dump()
    d.update(slots=slots, linear=linear, tables=[t for t in d["tables"] if t["name"] in used],
             pooling={k: v for k, v in cfg.pooling.items() if k != slot},
             salt={k: v for k, v in cfg.salt.items() if k != slot},
             position_slot=None if cfg.position_slot == slot else cfg.position_slot,
             sequential=cfg.sequential and bool(linear),
             sequential_embeddings=cfg.sequential_embeddings and bool(linear))
    try:
        return ModelConfig.model_validate(d)
    except ValueError:
        return None


def _scorers(project, settings, each_slot: bool = False) -> dict[str, tuple[object, int]]:
    """Each scorer and the batch it learns in; with ``each_slot`` the project's model again
    without each of its sparse features in turn (``model_without_<slot>``)."""
    from trainer.config import lr_config

    cfg = project.model_config()
    lr = lr_config(f"{cfg.model_id}-lr", settings.eval.base_lr_seq_lr, tuple(cfg.all_slots), recent_items=False,
                   sequential=True).model_copy(update={"pooling": dict(cfg.pooling), "label": cfg.label})
    batch = settings.trainer.batch_size
    prior = settings.eval.count_prior
    out: dict[str, tuple[object, int]] = {
        "model": (_Learned(cfg), batch), "lr": (_Learned(lr), settings.eval.base_lr_seq_batch),
        "counts_user_item": (_Counts(prior, True, cfg.position_slot), batch),
        "counts_item": (_Counts(prior, False, cfg.position_slot), batch),
        "counts_recent": (_Counts(prior, True, cfg.position_slot, settings.trainer.recent_half_life), batch),
        "base_rate": (_BaseRate(), batch)}
    for slot in dict.fromkeys([*cfg.slots, *cfg.linear]) if each_slot else ():
        less = without(cfg, slot)
        if less is not None:
            out[f"{LEFT_OUT}{slot}"] = (_Learned(less), batch)
    return out


def _corrected(p: np.ndarray, rate: np.ndarray) -> np.ndarray:
    return p / (p + (1 - p) / rate)


def negative_rates(rate: np.ndarray, y: np.ndarray, slices: np.ndarray) -> np.ndarray:
    """Each example's negative keep rate: that of the latest negative of its slice before it (the
    first negative's for the examples before that). A positive's own ``sample_rate`` is always 1:
    correcting each example by its own rate would tell the label.

    >>> negative_rates(np.array([1, .5, 1, .25, 1]), np.array([1, 0, 1, 0, 1.]), np.zeros(5, int)).tolist()
    [0.5, 0.5, 0.5, 0.25, 0.25]
    """
    out = np.ones(rate.size)
    for s in np.unique(slices):
        at = np.flatnonzero(slices == s)
        neg = at[y[at] == 0]
        if neg.size:
            last = np.searchsorted(neg, at, side="right") - 1
            out[at] = rate[neg[np.maximum(last, 0)]]
    return out


def _windows(t_ms: np.ndarray, p: np.ndarray, y: np.ndarray, n: int) -> list[dict]:
    from trainer.metrics import auc

    out = []
    for part in np.array_split(np.arange(y.size), max(1, min(n, y.size // 500))):
        yy = y[part]
        if 0 < yy.sum() < yy.size:
            out.append({"t_ms": int(t_ms[part[-1]]), "auc": float(auc(p[part], yy))})
    return out


def run(project, root: Path, test_fraction: float, open_window_s: float,
        progress: Callable[[str], None] = lambda _: None, each_slot: bool = False) -> dict:
    """Every scorer on the split of ``root``'s examples (see the module docstring), less the
    examples of the last ``open_window_s`` of event time; ``each_slot``: the model without each
    of its sparse features too, and under ``left_out`` what leaving each out moved the AUCs by."""
    from services.settings import get_settings
    from trainer.data import arrow_batch

    settings = get_settings()
    cfg = project.model_config()
    t = _examples(root)
    n = t.num_rows
    label = f"label_{cfg.label}"
    if n == 0 or label not in t.column_names:
        raise ValueError(f"no examples with a {label} column under {root}")
    known = np.asarray(t[label].is_valid())
    t = t.filter(known)
    # The joiner emits a negative when its window closes: the last window of event time may hold
    # positives whose negatives are still waiting (a stack stopped mid-stream), so it is left out.
    t_all = t["event_time_ms"].to_numpy(zero_copy_only=False)
    closed = t_all <= t_all.max() - open_window_s * 1000 if t.num_rows else t_all
    dropped = int(t.num_rows - closed.sum())
    t = t.filter(closed)
    n = t.num_rows
    if n < 2:
        raise ValueError(f"{dropped} examples under {root}, all within the joiner's last window ({open_window_s:g} s "
                         "of event time, --open-window-s): nothing to judge")
    cut = n - int(n * test_fraction)
    y = np.nan_to_num(t[label].to_numpy(zero_copy_only=False).astype(np.float64))
    rate = (t["sample_rate"].to_numpy(zero_copy_only=False).astype(np.float64)
            if "sample_rate" in t.column_names else np.ones(n))
    users = t["user_id"].to_numpy(zero_copy_only=False).astype(np.int64)
    items = t["item_id"].to_numpy(zero_copy_only=False).astype(np.int64)
    t_ms = t["event_time_ms"].to_numpy(zero_copy_only=False).astype(np.int64)
    w = 1.0 / rate
    slices = (np.unique(t["model_id"].to_numpy(zero_copy_only=False), return_inverse=True)[1]
              if "model_id" in t.column_names else np.zeros(n, np.int64))
    keep = negative_rates(rate, y, slices)
    out: dict = {"examples": n, "open_window_dropped": dropped, "train_examples": cut, "test_examples": n - cut, "test_fraction": test_fraction,
                 "model_id": cfg.model_id, "first_event_ms": int(t_ms[0]), "last_event_ms": int(t_ms[-1]),
                 "sampled_negatives": bool((rate < 1).any()), "scorers": {}}
    for name, (scorer, bs) in _scorers(project, settings, each_slot).items():
        t0 = time.perf_counter()
        p = np.empty(n, np.float64)
        for lo, hi, learn in [(a, min(a + bs, cut), True) for a in range(0, cut, bs)] + \
                             [(a, min(a + 8192, n), False) for a in range(cut, n, 8192)]:
            b = arrow_batch(t.slice(lo, hi - lo), cfg.all_slots, cfg.label, cfg.dense_features)
            p[lo:hi] = (scorer.learn if learn else scorer.score)(b, users[lo:hi], items[lo:hi])
        q = _corrected(p, keep)
        out["scorers"][name] = {"progressive": judged(q[:cut], y[:cut], w[:cut]),
                                "holdout": judged(q[cut:], y[cut:], w[cut:]),
                                "auc_over_time": _windows(t_ms[:cut], q[:cut], y[:cut], 20),
                                "reliability": _reliability(q[cut:], y[cut:], w[cut:]),
                                "seconds": time.perf_counter() - t0}
        progress(f"{name}: {time.perf_counter() - t0:.1f} s")
    full = out["scorers"]["model"]
    out["left_out"] = {name[len(LEFT_OUT):]: {part: _change(s[part].get("auc"), full[part].get("auc"))
                                              for part in ("progressive", "holdout")}
                       for name, s in out["scorers"].items() if name.startswith(LEFT_OUT)}
    return out


def _change(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or math.isnan(a) or math.isnan(b) else a - b


def _reliability(p: np.ndarray, y: np.ndarray, w: np.ndarray, bins: int = 10) -> list[list[float]]:
    """[mean score, click rate] per equal-count bin of the score."""
    order = np.argsort(p, kind="stable")
    parts = np.array_split(order, min(bins if np.ptp(p) > 0 else 1, p.size))  # one score: one point
    return [[float((w[b] * p[b]).sum() / w[b].sum()), float((w[b] * y[b]).sum() / w[b].sum())]
            for b in parts if b.size]


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table_lines(r: dict) -> list[str]:
    """The result as a Markdown table: each scorer's progressive and holdout AUC, log loss and
    calibration error."""
    lines = [f"{r['examples']} examples of model {r['model_id']}: the first {r['train_examples']} learned "
             f"(progressive), the last {r['test_examples']} held out ({r['open_window_dropped']} of the joiner's "
             "last window left out)",
             "",
             "| scorer | AUC | log loss | calibration error | holdout AUC | holdout log loss | holdout calibration error |",
             "|---|---|---|---|---|---|---|"]
    for name, s in r["scorers"].items():
        a, h = s["progressive"], s["holdout"]
        lines.append(f"| {name} | {_f(a.get('auc'))} | {_f(a.get('log_loss'))} | {_f(a.get('calibration_error'))} "
                     f"| {_f(h.get('auc'))} | {_f(h.get('log_loss'))} | {_f(h.get('calibration_error'))} |")
    if r.get("left_out"):
        lines += ["", "Each feature left out (the AUC without it minus the model's; above 0: the model is better "
                  "without it):", "", "| feature | AUC change | holdout AUC change |", "|---|---|---|"]
        lines += [f"| {slot} | {_f(c['progressive'], '+.4f')} | {_f(c['holdout'], '+.4f')} |"
                  for slot, c in r["left_out"].items()]
    return lines


def plot(r: dict, path: Path) -> None:
    """AUC over event time on the learned part; reliability curves on the holdout."""
    import datetime as dt

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    top = 0.0
    for name, s in r["scorers"].items():
        if name.startswith(LEFT_OUT):  # (the table says what each feature is worth)
            continue
        pts = s["auc_over_time"]
        if pts:
            a.plot([dt.datetime.fromtimestamp(p["t_ms"] / 1000, dt.UTC) for p in pts],
                   [p["auc"] for p in pts], marker=".", label=name)
        rel = np.array(s["reliability"])
        if rel.size:
            b.plot(rel[:, 0], rel[:, 1], marker="o", label=name)
            top = max(top, float(rel.max()))
    a.set(title="progressive AUC over event time (learned part)", ylabel="AUC")
    a.tick_params(axis="x", labelrotation=30)
    a.legend(fontsize=8)
    b.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=1)
    b.set(title="reliability on the holdout", xlabel="mean corrected score", ylabel="click rate")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="driftline eval data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", default=os.environ.get("DRIFTLINE_PROJECT", "driftline.toml"),
                    help="the project file (default $DRIFTLINE_PROJECT, else ./driftline.toml)")
    ap.add_argument("--examples-dir", default=None, help="the dumped examples (default <var>/examples)")
    ap.add_argument("--test-fraction", type=float, default=0.2, help="the last part held out (default 0.2)")
    ap.add_argument("--open-window-s", type=at_least(0, float), default=None,
                    help="leave out the examples of the last this many seconds of event time: their negatives may "
                         "still wait in the joiner's windows (default joiner.window_seconds; 0 keeps all)")
    ap.add_argument("--out", default=None, help="where eval-data.json and eval-data.png go (default <var>/eval)")
    ap.add_argument("--each-feature", action="store_true",
                    help="also learn the model once without each of its sparse features, and say what each is worth "
                         "(a feature the model is better without hurts it; one pass of the model per feature)")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.test_fraction < 1:
        print(f"driftline eval data: --test-fraction {args.test_fraction} is not in (0, 1)", file=sys.stderr)
        return 2
    from driftline.project import ProjectError, apply_to_environ, load_project
    from services.settings import get_settings

    from .common import nan_to_none

    try:
        project = load_project(args.project)
    except (ProjectError, OSError) as err:
        print(f"driftline eval data: {err}", file=sys.stderr)
        return 2
    apply_to_environ(project)
    get_settings.cache_clear()
    settings = get_settings()
    var = settings.var_dir
    open_window_s = settings.joiner.window_seconds if args.open_window_s is None else args.open_window_s
    root = Path(args.examples_dir) if args.examples_dir else var / "examples"
    out = Path(args.out) if args.out else var / "eval"
    try:
        r = run(project, root, args.test_fraction, open_window_s, lambda line: print(line, file=sys.stderr, flush=True),
                each_slot=args.each_feature)
    except ValueError as err:
        print(f"driftline eval data: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval-data.json").write_text(json.dumps(nan_to_none(r), indent=1) + "\n")
    if not args.no_plot:
        plot(r, out / "eval-data.png")
    print("\n".join(table_lines(r)))
    print(f"wrote {out / 'eval-data.json'}" + ("" if args.no_plot else f" and {out / 'eval-data.png'}"),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python -m evaluation.own_data"))
