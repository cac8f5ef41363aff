"""Issue 16's acceptance, for a schema that is not MovieLens: ``driftline init``, an edited project
file (string user and item features, a position, a dense feature, no user ids), ``up --config``,
the user's item features through ``features load --config``, traffic with a planted signal through
serving (plain HTTP here; the client package and the Kafka producers come next), then: examples
join, the trainer's AUC beats 0.5, serving's scores move with the deltas, the dense feature
changes the score, and nothing was downloaded."""

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

from services.hashing import string_id, string_key
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
source = "candidate"

[[features]]
name = "price"
source = "candidate"
kind = "dense"

'''


def _edit(template: str) -> str:
    """The user's edit of ``driftline init``'s file: their features, small and fast windows."""
    head, rest = template.split("\n[[features]]\n", 1)
    tables = rest[rest.index("# ---"):]
    text = head + "\n" + FEATURES + tables
    for old, new in (('name = "my-model"', 'name = "shop"'), ("dim = 8", "dim = 4"), ("mlp = [64, 32]", "mlp = [8]"),
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


def _request(rng: random.Random, segment: str, price: float | None = None) -> tuple[dict, list[str]]:
    skus = rng.sample(SKUS, 4)
    return {"context": {"sparse": {"segment": [string_id(segment)]}},
            "candidates": [{"item_id": string_key(sku), "features": {
                "sparse": {"position": [pos]}, "dense": {"price": rng.random() if price is None else price}}}
                for pos, sku in enumerate(skus)]}, skus


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
        items.write_text("sku,brand\n" + "".join(f"{s},{_brand(s)}\n" for s in SKUS))
        load = subprocess.run([*cli, "features", "load", "--config", str(config), "--items", str(items),
                               "--redis-url", f"redis://127.0.0.1:{stack.redis_port}/0"],
                              env=env, capture_output=True, text=True, cwd=repo_root, timeout=120)
        assert load.returncode == 0, load.stderr
        stack.wait_for("serving ready", lambda: stack.get(stack.serving_url + "/readyz")[0] == 200, 180)

        rng = random.Random(0)
        probe, _ = _request(random.Random(1), "students", price=0.5)
        with httpx.Client(base_url=stack.serving_url, timeout=30) as http:
            first = http.post("/rank", json=probe).json()
            deadline, sent = time.monotonic() + 150, 0
            while time.monotonic() < deadline:
                segment = rng.choice(SEGMENTS)
                body, skus = _request(rng, segment)
                r = http.post("/rank", json=body)
                assert r.status_code == 200, r.text
                rid = r.json()["request_id"]
                clicks = [{"request_id": rid, "item_id": string_key(sku), "action_type": "click"}
                          for pos, sku in enumerate(skus) if rng.random() < _click_probability(segment, _brand(sku), pos)]
                if clicks:
                    assert http.post("/actions", json={"actions": clicks}).status_code < 300
                sent += 1
                auc = stack.metric("trainer", "driftline_trainer_auc", {"model": "shop"})
                trained = stack.metric("trainer", "driftline_trainer_examples_total", {"model": "shop"}) or 0
                if sent % 50 == 0 and trained > 2000 and auc is not None and auc > 0.6:
                    break
            assert trained > 0, f"no example joined and trained\n{stack.logs_tail()}"
            assert auc is not None and auc > 0.5, (auc, trained)
            moved = http.post("/rank", json=probe).json()
            assert moved["model_version"]["sparse_version"] > first["model_version"]["sparse_version"]
            assert [i["raw_score"] for i in moved["items"]] != [i["raw_score"] for i in first["items"]]
            stack.wait_for("dense weights", lambda: http.post("/rank", json=probe).json()
                           ["model_version"]["dense_version"] > 0, 60)
            cheap = http.post("/rank", json=probe).json()["items"]
            probe_dear, _ = _request(random.Random(1), "students", price=50.0)
            dear = http.post("/rank", json=probe_dear).json()["items"]
            assert {i["item_id"]: i["raw_score"] for i in cheap} != {i["item_id"]: i["raw_score"] for i in dear}
            r = http.post("/rank", json={"candidates": [{"item_id": 1, "features": {
                "sparse": {"colour": [1]}, "dense": {"price": 1.0}}}]})
            assert r.status_code == 422 and "colour" in r.json()["message"]
        assert not (stack.metric("trainer", "driftline_trainer_bad_examples_total", {"model": "shop"}) or 0)
    finally:
        code = stack.stop()
    assert code == 0, stack.text()
    assert not data.exists()  # no MovieLens download
    logs = {p.name for p in stack.log_dir.glob("*.log")}
    assert not logs & {"warm-start.log", "features-load.log", "replay.log"}, logs
    _warm_start_from_the_dumped_examples(tmp_path, repo_root, config, stack.var_dir / "examples")


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
        body, _ = _request(random.Random(1), "students", price=0.5)
        r = httpx.post(stack.serving_url + "/rank", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["model_version"]["model_id"] == "shop", r.text
        snaps = list((second / "var" / "snapshots" / "shop").glob("snap-*"))
        assert snaps, stack.logs_tail()
        passes = [json.loads(line) for line in (stack.log_dir / "warm-start.log").read_text().splitlines()
                  if line.startswith('{"pass"')]
        assert passes and passes[-1]["examples"] > 1000, stack.logs_tail()
    finally:
        code = stack.stop()
    assert code == 0, stack.text()
