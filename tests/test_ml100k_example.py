"""``examples/ml-100k`` stays runnable: ``prep.py`` on the session's ml-100k, its project file
checked, its feature files loaded into a real Redis with nothing skipped but the keys, and its log
read through its map into one request of one candidate per rating, with the rating's click.

Then the walk in ``examples/ml-100k/README.md`` on a running stack, shortened: ``up --config``,
``features load``, and the first 3,000 ratings through ``traffic --csv ... --rebase --speed 0``,
whose join report must count no click lost (the example's windows; issue 32). The full walk's
numbers are in that README; ``tests/test_own_data.py`` runs ``driftline eval data``."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis

from driftline.cli import main as cli_main
from movielens.data import load
from producers.csv_log import load_map, requests_of
from producers.csv_traffic import project_of
from services.settings import get_settings
from tests.loopstack import LoopStack

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ml-100k"


def _prepared(tmp_path: Path) -> Path:
    """``prep.py`` on the session's ml-100k: the folder of impressions.csv, users.csv, items.csv."""
    ml = load("ml-100k", get_settings().data_dir)
    src = tmp_path / "ml-100k"
    src.mkdir()
    for name in ("ratings", "users", "items"):
        pq.write_table(getattr(ml, name), src / f"{name}.parquet")
    out = tmp_path / "log"
    subprocess.run([sys.executable, str(EXAMPLE / "prep.py"), "--data-dir", str(src), "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    return out


def test_the_ml100k_example_prepares_loads_and_maps(redis_url: str, tmp_path: Path, capsys) -> None:
    ml = load("ml-100k", get_settings().data_dir)
    out = _prepared(tmp_path)
    assert cli_main(["init", "--check", str(EXAMPLE / "driftline.toml")]) == 0

    prefix = f"ml100k{time.time_ns()}"
    assert cli_main(["features", "load", "--config", str(EXAMPLE / "driftline.toml"), "--users", str(out / "users.csv"),
                     "--items", str(out / "items.csv"), "--redis-url", redis_url, "--prefix", prefix]) == 0
    said = capsys.readouterr()
    assert "loaded 2625 feature keys" in said.out + said.err and "column 'genres'" not in said.out + said.err
    raw = redis.Redis.from_url(redis_url)
    try:
        user = raw.get(f"{prefix}:u:1").decode()
        assert user.startswith("gender=") and ";age=24;" in user and ";occupation=" in user and ";zip=" in user
        assert raw.get(f"{prefix}:i:1").decode().count(",") == 2  # Toy Story: three genres, then its year
    finally:
        raw.close()

    features, _ = project_of(EXAMPLE / "driftline.toml")
    spec = load_map(EXAMPLE / "map.toml")
    with open(out / "impressions.csv", newline="") as f:
        requests = requests_of(csv.DictReader(f), spec, spec.feature_specs(features))
    ratings = ml.ratings.sort_by("timestamp")
    assert len(requests) == ratings.num_rows == 100_000
    assert all(len(r.candidates) == 1 for r in requests)
    assert sum(len(r.actions) for r in requests) == int((ratings["rating"].to_numpy() >= 4).sum())
    first = ratings.slice(0, 1).to_pylist()[0]
    assert (requests[0].user, requests[0].event_time_ms) == (first["user_id"], first["timestamp"] * 1000)


@pytest.mark.timeout(400)
def test_the_ml100k_replay_at_full_speed_loses_no_click(tmp_path: Path, repo_root: Path) -> None:
    out = _prepared(tmp_path)
    config = str(EXAMPLE / "driftline.toml")
    stack = LoopStack.start(tmp_path, repo_root, "--config", config)
    # the stack's own serving and joiner /metrics, where `driftline up` put them
    env = os.environ | {"DRIFTLINE_VAR_DIR": str(stack.var_dir), "DRIFTLINE_SERVING__PORT": str(stack.serving_port),
                        "DRIFTLINE_EMBEDDED__METRICS_PORT_BASE": str(stack.metrics_base)}
    try:
        cli = [sys.executable, "-m", "driftline.cli"]
        subprocess.run([*cli, "features", "load", "--config", config, "--users", str(out / "users.csv"),
                        "--items", str(out / "items.csv"), "--redis-url", f"redis://127.0.0.1:{stack.redis_port}/0"],
                       env=env, check=True, capture_output=True, timeout=120, cwd=repo_root)
        replay = subprocess.run([*cli, "traffic", "--csv", str(out / "impressions.csv"), "--map", str(EXAMPLE / "map.toml"),
                                 "--config", config, "--rebase", "--speed", "0", "--limit", "3000", "--no-progress"],
                                env=env, capture_output=True, text=True, timeout=300, cwd=repo_root)
        assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-3000:]
        stats = json.loads(replay.stdout.strip().splitlines()[-1])
    finally:
        assert stack.stop() == 0, stack.text()
    join = stats["join"]
    print(json.dumps(stats))
    assert stats["rank_errors"] == stats["action_errors"] == 0 and stats["actions"] > 1000, stats
    assert join["actions_sent"] == stats["actions"] and join["lost"] == 0, join
    assert "joiner lost" not in replay.stderr
