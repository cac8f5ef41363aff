"""The served model is not behind counting clicks on worlds nobody tuned to (``make bench-worlds``,
seed 0): where clicks are rare or most users come once it was, until its head's bias started at the
labels' log-odds (:meth:`trainer.head.DenseHead.start_bias`); where a feature says nothing it was,
until each first-order field got a learned factor (:attr:`trainer.head.DenseHead.linear_scale`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def worlds(repo_root: Path):
    spec = importlib.util.spec_from_file_location("bench_worlds", repo_root / "bench" / "bench_worlds.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: the worlds where the served model without one of its parts fell behind counting, and that part
WITHOUT = {"one_time_users": "unstarted", "very_rare_clicks": "unstarted", "noise_feature": "unscaled"}


@pytest.mark.parametrize("name", ["uniform", "one_time_users", "rare_clicks", "very_rare_clicks",
                                  "strong_interactions", "additive", "heavy_users", "noise_feature"])
def test_the_served_model_ranks_at_least_as_well_as_counting_clicks(worlds, name):
    without = WITHOUT.get(name)
    got = worlds.run_world(name, 0, ("model", "counts") + ((without,) if without else ()))
    assert got["auc_model"] >= got["auc_counts"] - 0.002, got
    if without:  # and without that part it is behind (as make bench-worlds' "behind" counts it)
        assert got[f"auc_{without}"] < got["auc_counts"] - 0.002, got
