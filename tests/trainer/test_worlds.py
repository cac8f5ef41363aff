"""The served model is not behind counting clicks on worlds nobody tuned to (``make bench-worlds``,
seed 0): where clicks are rare or most users come once it was, until its head's bias started at the
labels' log-odds (:meth:`trainer.head.DenseHead.start_bias`)."""

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


@pytest.mark.parametrize("name", ["uniform", "one_time_users", "rare_clicks", "very_rare_clicks",
                                  "strong_interactions", "additive", "heavy_users"])
def test_the_served_model_ranks_at_least_as_well_as_counting_clicks(worlds, name):
    got = worlds.run_world(name, 0)
    assert got["auc_model"] >= got["auc_counts"] - 0.002, got
    if name in ("one_time_users", "very_rare_clicks"):  # where an unstarted bias left it behind counting
        assert got["auc_unstarted"] < got["auc_counts"] - 0.005, got
