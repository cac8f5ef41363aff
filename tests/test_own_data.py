"""Issue 16's acceptance, for a schema that is not MovieLens: ``driftline init``, an edited project
file (string user and item features, the place each item is shown at, a dense feature, a dense item feature kept in
the feature store, no user ids), ``up --config``,
the user's item features through ``features load --config``, traffic with a planted signal through
the client package (``driftline.client.RankClient.from_project``: ``/rank`` and ``/actions``) and,
for a quarter of the requests, through its Kafka producers (a system that ranks on its own and logs
``FeatureLog``/``Action`` itself), then: examples join, the trainer's AUC beats 0.5, serving's
scores move with the deltas, the dense feature changes the score, and nothing was downloaded."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from driftline.client import ActionProducer, Blocking, FeatureLogProducer, RankClient, Ranking, UnknownFeature
from driftline.project import load_project
from tests.loopstack import LoopStack

SEGMENTS = ["students", "parents", "pros"]
BRANDS = ["acme", "globex", "initech", "umbrella"]
SKUS = [f"SKU-{i:03d}" for i in range(40)]

FEATURES = '''\
[[features]]
name = "segment"
source = "context"
ids = "string"

[[features]]
name = "item_id"
source = "candidate"

[[features]]
name = "brand"
source = "item"
ids = "string"

[[features]]
name = "position"
source = "position"

[[features]]
name = "price"
source = "candidate"
kind = "dense"

[[features]]
name = "rating"
source = "item"
kind = "dense"

'''


def _edit(template: str) -> str:
    """The user's edit of ``driftline init``'s file: their features, small and fast windows."""
    head, rest = template.split("\n[[features]]\n", 1)
    tables = rest[rest.index("# ---"):]
    text = head + "\n" + FEATURES + tables
    for old, new in (('name = "my-model"', 'name = "shop"'), ("dim = 8", "dim = 4"), ("mlp = [32, 16]", "mlp = [8]"),
                     ("window_seconds = 900", "window_seconds = 4"), ("idle_advance_seconds = 30", "idle_advance_seconds = 2"),
                     ("sparse_interval_s = 10", "sparse_interval_s = 1"), ("dense_interval_s = 60", "dense_interval_s = 2"),
                     ("negative_rate = 0.25", "negative_rate = 1.0"), ('item_key = "item_id"', 'item_key = "sku"')):
        assert old in text, old
        text = text.replace(old, new)
    # the joiner's watermark margin: a 4 s window needs an idle partition to catch up within seconds
    return text + "\n[settings.joiner]\nidle_advance_margin_seconds = 1\n"


def _click_probability(segment: str, brand: str, position: int) -> float:
    """The planted signal: students click acme, pros click umbrella, top positions more."""
    liked = (segment, brand) in {("students", "acme"), ("pros", "umbrella")}
    return (0.6 if liked else 0.05) * (1.0 if position < 2 else 0.5)


def _brand(sku: str) -> str:
    return BRANDS[int(sku[-3:]) % len(BRANDS)]


def _rating(sku: str) -> float:
    """The item's stored dense feature (``features load``: serving adds it to every candidate)."""
    return int(sku[-3:]) / 8


def _request(rng: random.Random, price: float | None = None) -> tuple[list[dict], list[str]]:
    """Four candidates: the user's own string SKUs and their prices (plain values); serving places them."""
    skus = rng.sample(SKUS, 4)
    return [{"item_id": sku, "features": {"price": rng.random() if price is None else price}} for sku in skus], skus


def _clicked(rng: random.Random, segment: str, skus: list[str]) -> list[str]:
    return [sku for pos, sku in enumerate(skus) if rng.random() < _click_probability(segment, _brand(sku), pos)]


def _traffic(stack: LoopStack, client: RankClient, config: Path) -> tuple[float | None, float]:
    """Requests until the trainer learned the signal (or 150 s): three in four through ``/rank``
    and ``/actions``, one in four logged to Kafka by the producers (with the item's brand: no
    serving adds it there). Returns the trainer's AUC and examples learned."""
    rng = random.Random(0)
    settings = stack.settings()
    logs = Blocking(FeatureLogProducer(load_project(config).features, settings, model_id="shop"))
    actions = Blocking(ActionProducer(settings=settings, action_types=["click"]))
    sent = 0
    with logs, actions:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            segment = rng.choice(SEGMENTS)
            candidates, skus = _request(rng)
            if sent % 4 == 3:
                for pos, (c, sku) in enumerate(zip(candidates, skus)):  # shown in this order
                    c["features"].update(brand=_brand(sku), rating=_rating(sku), position=pos)
                rid = logs.send(None, candidates, context={"segment": segment})
                for sku in _clicked(rng, segment, skus):
                    actions.send(rid, sku, "click")
            else:
                ranking = client.rank(candidates=candidates, context={"segment": segment})
                clicks = _clicked(rng, segment, [str(i.item) for i in ranking.items])  # shown as answered
                if clicks:
                    client.actions([{"request_id": ranking.request_id, "item_id": sku, "action_type": "click"}
                                    for sku in clicks])
            sent += 1
            if sent % 50 == 0:  # the trainer's whole /metrics page per look: not on every request
                auc, trained = _learned(stack)
                if trained > 2000 and auc is not None and auc > 0.6:
                    break
    return _learned(stack)


def _learned(stack: LoopStack) -> tuple[float | None, float]:
    """The trainer's AUC and examples learned, from its /metrics."""
    return (stack.metric("trainer", "driftline_trainer_auc", {"model": "shop"}),
            stack.metric("trainer", "driftline_trainer_examples_total", {"model": "shop"}) or 0)


def _scores(r: Ranking) -> dict[str, float]:
    return {str(i.item): i.raw_score for i in r.items}


@pytest.mark.timeout(420)
def test_own_data_end_to_end(tmp_path: Path, repo_root: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_")}
    config = tmp_path / "driftline.toml"
    cli = [sys.executable, "-m", "driftline.cli"]
    subprocess.run([*cli, "init", str(config)], env=env, check=True, cwd=repo_root, timeout=60)
    config.write_text(_edit(config.read_text()))

    data = tmp_path / "data"
    stack = LoopStack.start(tmp_path, repo_root, "--config", str(config), env={"DRIFTLINE_DATA_DIR": str(data)})
    try:
        items = tmp_path / "items.csv"
        items.write_text("sku,brand,rating\n" + "".join(f"{s},{_brand(s)},{_rating(s)}\n" for s in SKUS))
        load = subprocess.run([*cli, "features", "load", "--config", str(config), "--items", str(items),
                               "--redis-url", f"redis://127.0.0.1:{stack.redis_port}/0"],
                              env=env, capture_output=True, text=True, cwd=repo_root, timeout=120)
        assert load.returncode == 0, load.stderr
        stack.wait_for("serving ready", lambda: stack.get(stack.serving_url + "/readyz")[0] == 200, 180)

        probe, _ = _request(random.Random(1), price=0.5)
        with RankClient.from_project(str(config), stack.serving_url, timeout_s=30) as client:
            first = client.rank(candidates=probe, context={"segment": "students"})
            auc, trained = _traffic(stack, client, config)
            assert trained > 0, f"no example joined and trained\n{stack.logs_tail()}"
            assert auc is not None and auc > 0.5, (auc, trained)
            moved = client.rank(candidates=probe, context={"segment": "students"})
            assert moved.model_version["sparse_version"] > first.model_version["sparse_version"]
            assert _scores(moved) != _scores(first)
            stack.wait_for("dense weights", lambda: client.rank(candidates=probe, context={"segment": "students"})
                           .model_version["dense_version"] > 0, 60)
            cheap = client.rank(candidates=probe, context={"segment": "students"})
            dear = client.rank(candidates=_request(random.Random(1), price=50.0)[0], context={"segment": "students"})
            assert _scores(cheap) != _scores(dear)
            with pytest.raises(UnknownFeature, match="colour"):  # the client refuses it before sending
                client.rank(candidates=[{"item_id": "SKU-001", "features": {"colour": "red", "price": 1.0}}])
        r = httpx.post(stack.serving_url + "/rank", json={"candidates": [{"item_id": 1, "features": {
            "sparse": {"colour": [1]}, "dense": {"price": 1.0}}}]}, timeout=30)
        assert r.status_code == 422 and "colour" in r.json()["message"]  # and so does serving
        assert not (stack.metric("trainer", "driftline_trainer_bad_examples_total", {"model": "shop"}) or 0)
        # the price reached the head scaled by statistics the trainer published (trainer.dense_scaling)
        assert (stack.metric("trainer", "driftline_trainer_dense_input",
                             {"model": "shop", "feature": "price", "stat": "examples"}) or 0) > 0, stack.logs_tail()
    finally:
        code = stack.stop()
    assert code == 0, stack.text()
    assert not data.exists()  # no MovieLens download
    logs = {p.name for p in stack.log_dir.glob("*.log")}
    assert not logs & {"warm-start.log", "features-load.log", "feature-keeper.log", "replay.log"}, logs
    _the_stored_dense_feature_was_trained_on(stack.var_dir / "examples")
    _warm_start_from_the_dumped_examples(tmp_path, repo_root, config, stack.var_dir / "examples")


def _the_stored_dense_feature_was_trained_on(examples: Path) -> None:
    """Every example carries its item's ``rating`` (serving's from the store, the producers' own)
    and the place it was shown at (serving's answer's, the producers' own), all four used."""
    from joiner.dumper import read_examples
    from services.hashing import string_key

    t = read_examples(examples)
    want = {string_key(s): _rating(s) for s in SKUS}
    wrong = [(i, v) for i, v in zip(t["item_id"].to_pylist(), t["dense_rating"].to_pylist()) if v != want[i]]
    assert t.num_rows and not wrong, wrong[:5]
    places = t["sparse_position"].to_pylist()
    assert all(len(p) == 1 for p in places) and {p[0] for p in places} == {0, 1, 2, 3}, places[:10]


def _warm_start_from_the_dumped_examples(tmp_path: Path, repo_root: Path, config: Path, examples: Path) -> None:
    """``[warm_start] kind = "examples"``: a new stack trains on the first one's Parquet examples
    (``trainer batch``, its snapshot the one the online trainer and serving start from)."""
    assert list(examples.rglob("*.parquet")), "the dumper wrote no Parquet"
    text = config.read_text().replace('kind = "none"', f'kind = "examples"\nexamples_dir = "{examples}"')
    warm = tmp_path / "warm.toml"
    warm.write_text(text)
    second = tmp_path / "second"
    second.mkdir()
    stack = LoopStack.start(second, repo_root, "--config", str(warm), env={"DRIFTLINE_DATA_DIR": str(second / "data")})
    try:
        assert "warm start" in stack.text()
        stack.wait_for("serving ready", lambda: stack.get(stack.serving_url + "/readyz")[0] == 200, 180)
        candidates = _request(random.Random(1), price=0.5)[0]
        for c in candidates:  # this stack's store is empty: the request gives the item's rating itself
            c["features"]["rating"] = 1.0
        with RankClient.from_project(str(warm), stack.serving_url, timeout_s=30) as client:
            ranking = client.rank(candidates=candidates, context={"segment": "students"})
        assert ranking.model_version["model_id"] == "shop"
        snaps = list((second / "var" / "snapshots" / "shop").glob("snap-*"))
        assert snaps, stack.logs_tail()
        passes = [json.loads(line) for line in (stack.log_dir / "warm-start.log").read_text().splitlines()
                  if line.startswith('{"pass"')]
        assert passes and passes[-1]["examples"] > 1000, stack.logs_tail()
    finally:
        code = stack.stop()
    assert code == 0, stack.text()
