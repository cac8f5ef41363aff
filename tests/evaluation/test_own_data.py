"""``driftline eval data`` on a project that is not MovieLens: dumped examples (written as the
dumper writes them) of users with tastes for item categories, negatives sampled at a recorded
rate; the project's model and the LR must beat the base rate, the counts too, and the report
must say so in its table, JSON and PNG."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from evaluation import own_data
from joiner import dumper
from proto import Example
from services import example_batch
from services.settings import get_settings

PROJECT = """name = "synth"

[[features]]
name = "user_id"
source = "context"

[[features]]
name = "item_id"
source = "candidate"

[[features]]
name = "cat"
source = "item"
"""

KEEP = 0.5  # negatives' keep rate


@pytest.fixture(autouse=True)
def _own_environ():
    """``main`` applies the project file to the process environment, as the CLI does: undone after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    get_settings.cache_clear()


def _dump(root, n=12_000, seed=0, places: bool = False, noise: int = 0) -> float:
    """Examples of 40 users x 80 items in 4 categories: an item's appeal, a user's appetite and
    +2 in log-odds for the category the user likes; negatives kept at KEEP. Returns the population
    click rate. ``places``: each example shown at a place 0-4 (feature ``pos``), -1 in log-odds
    per place. ``noise``: a feature ``noise`` that says nothing, one of that many values at random."""
    rng = np.random.default_rng(seed)
    likes, appetite = rng.integers(0, 4, 40), rng.normal(0, 0.5, 40)
    cat, appeal = rng.integers(0, 4, 80), rng.normal(0, 1, 80)
    out, clicks = [], 0
    t0 = 1_700_000_000_000
    for i in range(n):
        u, it, place = int(rng.integers(40)), int(rng.integers(80)), int(rng.integers(5))
        z = appeal[it] + appetite[u] + 2.0 * (cat[it] == likes[u]) - 2.5 - (place if places else 0)
        y = float(rng.random() < 1 / (1 + np.exp(-z)))
        clicks += y
        if not y and rng.random() >= KEEP:
            continue
        e = Example(example_id=f"r{i}/{it}", request_id=f"r{i}", item_id=it, user_id=u,
                    event_time_ms=t0 + i * 1000, sample_rate=1.0 if y else KEEP, model_id="synth")
        e.labels["click"] = y
        e.features.sparse["user_id"].ids.append(u)
        e.features.sparse["item_id"].ids.append(it)
        e.features.sparse["cat"].ids.append(int(cat[it]))
        if places:
            e.features.sparse["pos"].ids.append(place)
        if noise:
            e.features.sparse["noise"].ids.append(int(rng.integers(noise)))
        out.append(e)
    # two files in two hours, the later hour written first: the split follows event time, not disk order
    half = len(out) // 2
    for hour, part in ((1, out[half:]), (0, out[:half])):
        d = root / "dt=2023-11-14" / f"hour={hour:02d}"
        d.mkdir(parents=True)
        c = example_batch.decode(example_batch.encode(example_batch.from_examples(part)))
        pq.write_table(dumper.flatten(c, ["click"]), d / "part-0000000001-0000.parquet")
    return clicks / n


def test_eval_data_judges_the_project_model_against_naive_baselines(tmp_path, capsys):
    (tmp_path / "driftline.toml").write_text(PROJECT)
    rate = _dump(tmp_path / "examples")
    out = tmp_path / "eval"
    assert own_data.main(["--project", str(tmp_path / "driftline.toml"), "--examples-dir", str(tmp_path / "examples"),
                          "--test-fraction", "0.25", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| model |" in table and "| counts_user_item |" in table and "| counts_recent |" in table and "| base_rate |" in table
    r = json.loads((out / "eval-data.json").read_text())
    assert (out / "eval-data.png").stat().st_size > 10_000
    assert r["train_examples"] + r["test_examples"] == r["examples"] and r["sampled_negatives"]
    # the joiner's last window (900 s of the 12,000 s of event time): its negatives may still wait there
    assert 0.05 * r["examples"] < r["open_window_dropped"] < 0.1 * r["examples"]
    s = {k: v["holdout"] for k, v in r["scorers"].items()}
    for name in ("model", "lr", "counts_user_item"):
        assert s[name]["auc"] > 0.7, (name, s[name])
        assert s[name]["log_loss"] < s["base_rate"]["log_loss"], (name, s)
    assert s["base_rate"]["auc"] == 0.5
    # corrected for the sampled negatives: the base rate's score is the population's click rate
    assert abs(s["base_rate"]["mean_score"] - rate) < 0.03 and abs(s["base_rate"]["click_rate"] - rate) < 0.03
    assert s["model"]["calibration_error"] < 0.05, s["model"]


@pytest.mark.parametrize("source", ["position", "candidate"])
def test_the_counts_know_the_places_when_the_model_does(tmp_path, capsys, source):
    """A log whose clicks fall with the place: with a position feature the counting baselines
    count the places too (as the trainer's does), so the model's lead over them is its own."""
    (tmp_path / "driftline.toml").write_text(PROJECT + f'\n[[features]]\nname = "pos"\nsource = "{source}"\n')
    _dump(tmp_path / "examples", places=True)
    out = tmp_path / "eval"
    assert own_data.main(["--project", str(tmp_path / "driftline.toml"), "--examples-dir", str(tmp_path / "examples"),
                          "--test-fraction", "0.25", "--out", str(out)]) == 0
    capsys.readouterr()
    s = {k: v["holdout"]["auc"] for k, v in json.loads((out / "eval-data.json").read_text())["scorers"].items()}
    if source == "position":
        assert s["counts_user_item"] > s["model"] - 0.03, s
    else:  # the same column as a plain candidate feature: the counts do not see the places
        assert s["counts_user_item"] < s["model"] - 0.05, s


def test_eval_data_refuses_what_it_cannot_judge(tmp_path, capsys):
    (tmp_path / "driftline.toml").write_text(PROJECT)
    assert own_data.main(["--project", str(tmp_path / "driftline.toml"), "--test-fraction", "1"]) == 2
    assert "--test-fraction 1.0 is not in (0, 1)" in capsys.readouterr().err
    assert own_data.main(["--project", str(tmp_path / "missing.toml")]) == 2
    assert own_data.main(["--project", str(tmp_path / "driftline.toml"),
                          "--examples-dir", str(tmp_path / "none")]) == 2
    assert "no examples with a label_click column under" in capsys.readouterr().err


def test_each_feature_left_out_says_what_it_is_worth(tmp_path, capsys):
    """``--each-feature``: the model once more without each feature. The category (what the users'
    tastes are for) is worth AUC; a feature that says nothing, of 1,000 values each seen a dozen
    times, costs some (``make bench-worlds``' ``noise_feature``): the table and JSON say both."""
    (tmp_path / "driftline.toml").write_text(PROJECT + '\n[[features]]\nname = "noise"\nsource = "context"\n')
    _dump(tmp_path / "examples", noise=1_000)
    out = tmp_path / "eval"
    assert own_data.main(["--project", str(tmp_path / "driftline.toml"), "--examples-dir", str(tmp_path / "examples"),
                          "--each-feature", "--no-plot", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    r = json.loads((out / "eval-data.json").read_text())
    assert sorted(r["left_out"]) == ["cat", "item_id", "noise", "user_id"]
    assert r["left_out"]["cat"]["progressive"] < -0.005, r["left_out"]
    assert r["left_out"]["noise"]["progressive"] > 0.002, r["left_out"]
    assert "| model_without_cat |" in table and "| cat | -0.0" in table and "| noise | +0.0" in table
