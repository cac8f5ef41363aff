"""`driftline eval ... --smoke`: the real experiments at tiny settings, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from evaluation import cli
from evaluation.common import HashedIds, buckets_for_rate, collision_rate, data, md5_bucket, smoke


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval")
    rc = cli.main(["all", "--smoke", "--out", str(out), "--work-dir", str(out / "work"), "--quiet"])
    assert rc == 0
    return out


def test_results_json_has_the_required_keys(smoke_out):
    r = json.loads((smoke_out / "results.json").read_text())
    for arm in ("collisionless", "hashed"):
        assert 0.5 < r["collisions"][arm]["auc_mean"] < 1 and r["collisions"][arm]["auc_std"] >= 0
        assert len(r["collisions"][arm]["per_epoch_mean"]) == smoke().coll_epochs
    for k in ("batch_only", "N10", "N50", "N100"):
        assert 0.5 < r["online"][k]["auc_mean"] < 1 and r["online"][k]["auc_std"] >= 0
    for k in ("river", "driftline_online"):
        assert 0 < r["baselines"][k]["auc_mean"] < 1 and r["baselines"][k]["ex_per_s"] > 0
    assert r["meta"]["settings"]["name"] == "smoke"
    # measured collision rates near the paper's targets
    rates = r["collisions"]["hashed"]["collision_rates"]
    assert abs(rates["user_id"]["colliding"] - 0.0773) < 0.02
    assert abs(rates["item_id"]["colliding"] - 0.0286) < 0.01


def test_sync_through_parameter_delta_makes_serving_equal_trainer(smoke_out):
    r = json.loads((smoke_out / "results.json").read_text())
    for k in ("N10", "N50", "N100"):
        assert r["online"][k]["sync_max_abs_diff"] == 0.0
        assert r["online"][k]["sync_rows_per_shard"] > 0


def test_restoring_a_fresh_snapshot_loses_nothing(smoke_out):
    st = json.loads((smoke_out / "results.json").read_text())["staleness"]
    assert st["k0"]["auc_lost_mean"] == 0.0  # snapshot restore is exact
    assert all(f"k{k}" in st for k in st["setup"]["k"])


def test_report_and_plots_are_written(smoke_out):
    md = (smoke_out / "results.md").read_text()
    assert "ml-1m" in md and "Criteo" in md and "| online N100 |" in md and "## Targets" in md
    for png in ("eval_collisions.png", "eval_online.png", "eval_staleness.png", "eval_baselines.png"):
        assert (smoke_out / png).stat().st_size > 1000
    assert not any((smoke_out / "work").iterdir())  # scratch snapshots removed


def test_one_section_rerun_keeps_the_others(smoke_out):
    before = json.loads((smoke_out / "results.json").read_text())
    assert cli.main(["staleness", "--smoke", "--out", str(smoke_out), "--work-dir", str(smoke_out / "work"),
                     "--quiet", "--no-plots"]) == 0
    after = json.loads((smoke_out / "results.json").read_text())
    assert after["collisions"] == before["collisions"] and after["online"] == before["online"]
    assert after["staleness"] == before["staleness"]  # seeded: the same numbers again


def test_md5_hash_space_hits_the_rate():
    ids = np.arange(1, 6041)
    plan = buckets_for_rate(ids, 0.0773)
    assert abs(plan["colliding"] - 0.0773) < 0.003
    assert collision_rate(ids, plan["buckets"]) == {k: plan[k] for k in ("ids", "buckets", "colliding", "ids_lost")}
    assert (md5_bucket(ids[:10], 1000) == md5_bucket(ids[:10], 1000)).all()


def test_hashed_ids_only_touch_their_slots():
    d = data(smoke(), 2000)
    b = d.batch(np.arange(64))
    h = HashedIds({"user_id": 7}, {"user_id": int(d.user_id.max())})(b)
    assert h.ids["user_id"].max() < 7 and (h.ids["item_id"] == b.ids["item_id"]).all()
    assert (h.ids["user_id"] == md5_bucket(b.ids["user_id"], 7)).all()


def test_relabelled_hashing_keeps_the_collisions_and_lone_ids_keep_their_key():
    d = data(smoke(), 2000)
    users = np.unique(d.user_id)
    m = 97  # small: many collisions
    h = HashedIds({"user_id": m}, {"user_id": int(d.user_id.max())}, present={"user_id": d.user_id})
    keys, buckets = h.lut["user_id"][users], md5_bucket(users, m)
    # the same partition of the ids into shared rows as plain MD5 bucketing
    assert len(set(zip(keys.tolist(), buckets.tolist()))) == len(set(keys.tolist())) == len(set(buckets.tolist()))
    _, inv, counts = np.unique(buckets, return_inverse=True, return_counts=True)
    alone = counts[inv] == 1
    assert (keys[alone] == users[alone]).all()  # a lone id is its own key: same PS init as collisionless
    assert all(keys[i] == users[buckets == buckets[i]].min() for i in np.flatnonzero(~alone))


def test_tuning_never_reads_the_test_split(smoke_out):
    from evaluation import collisions

    s = smoke()
    d = data(s, s.coll_limit)
    tr, te = collisions.split(s, d)
    vtr, vte = collisions.split(s, d, validation=True)
    assert np.union1d(vtr, vte).tolist() == tr.tolist() and vtr.max() < vte.min()
    tn = json.loads((smoke_out / "results.json").read_text())["tuning"]
    assert tn["collisions"]["settings_match_choice"]
    base = json.loads((smoke_out / "results.json").read_text())["baselines"]["setup"]
    assert tn["baselines"]["stream"]["offset"] >= base["offset"] + base["ratings"]  # disjoint from the reported stream


def test_model_matched_baselines_are_reported(smoke_out):
    b = json.loads((smoke_out / "results.json").read_text())["baselines"]
    assert set(b["model_matched"]) == {"lr", "lr_minibatch", "fm"}
    assert b["driftline_lr_sequential"]["batch_size"] == smoke().base_lr_seq_batch
    assert [c["batch_size"] for c in b["driftline_lr_curve"]] == [bs for bs, _ in smoke().base_lr_curve]
    md = (smoke_out / "results.md").read_text()
    assert "Model-matched comparisons" in md and "How settings were chosen" in md


def test_coldstart_measures_cold_users_and_items_beside_counting_clicks(smoke_out):
    c = json.loads((smoke_out / "results.json").read_text())["coldstart"]
    st = c["setup"]
    assert st["examples"]["users_first_1"] <= st["examples"]["users_first_10"] <= st["examples"]["overall"]
    assert list(c["arms"]) == ["served", "meta", "content", "both", "deepfm", "counts"]
    for arm in ("served", "deepfm", "counts"):
        a = c["arms"][arm]
        assert 0.5 < a["auc_overall"]["mean"] < 1 and a["ex_per_s"] > 0
        assert a["auc_users_first_10"]["mean"] == a["auc_users_first_10"]["mean"]  # not NaN
    d = c["arms"]["counts"]["vs_served"]["auc_users_first_10"]
    runs = {(r["arm"], r["seed"]): r for r in c["runs"]}
    want = [runs[("counts", s)]["auc_users_first_10"] - runs[("served", s)]["auc_users_first_10"] for s in st["seeds"]]
    assert abs(d["mean"] - sum(want) / len(want)) < 1e-12
    assert "## 5. Cold start" in (smoke_out / "results.md").read_text()
