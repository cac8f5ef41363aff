"""``examples/ml-100k`` stays runnable: ``prep.py`` on the session's ml-100k, its project file
checked, its feature files loaded into a real Redis with nothing skipped but the keys, and its log
read through its map into one request of one candidate per rating, with the rating's click.

The replay through a running stack is the walk in ``examples/ml-100k/README.md`` (measured; the
same commands run end to end for another project in ``tests/test_own_data.py``)."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import redis

from driftline.cli import main as cli_main
from producers.csv_log import load_map, requests_of
from producers.csv_traffic import project_of
from producers.movielens import load
from services.settings import get_settings

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ml-100k"


def test_the_ml100k_example_prepares_loads_and_maps(redis_url: str, tmp_path: Path, capsys) -> None:
    ml = load("ml-100k", get_settings().data_dir)
    src = tmp_path / "ml-100k"
    src.mkdir()
    for name in ("ratings", "users", "items"):
        pq.write_table(getattr(ml, name), src / f"{name}.parquet")
    out = tmp_path / "log"
    subprocess.run([sys.executable, str(EXAMPLE / "prep.py"), "--data-dir", str(src), "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
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
