"""The feature-store loader fills Redis from a real MovieLens dataset."""

from __future__ import annotations

import asyncio
from pathlib import Path

from producers.movielens import load
from producers.movielens_features import MovieLensFeatures
from serving.feature_store import FeatureStore, main


def test_loader_fills_store(redis_url: str, repo_root: Path, capsys) -> None:
    data = repo_root / "var" / "data"
    assert main(["load", "--movielens", "--dataset", "ml-100k", "--data-dir", str(data), "--redis-url", redis_url,
                 "--prefix", "loadtest"]) == 0
    assert "loaded 2625 feature keys" in capsys.readouterr().out  # 943 users + 1682 items
    ml = load("ml-100k", data)
    feats = MovieLensFeatures(ml.users, ml.items)

    async def fetch():
        store = FeatureStore(redis_url, "loadtest")
        try:
            return await store.fetch(1, [1, 50, 10**9])
        finally:
            await store.close()

    got = asyncio.run(fetch())
    assert got.user == feats.user_slots(1)
    assert got.items[:2] == [feats.item_slots(1), feats.item_slots(50)] and got.items[2] is None
    assert main(["load", "--movielens", "--redis-url", "redis://127.0.0.1:1/0", "--dataset", "ml-100k",
                 "--data-dir", str(data)]) == 1


def test_the_redis_client_parses_replies_in_c() -> None:
    """hiredis is pinned for serving's feature reads (a 100-candidate fetch: ~0.9 -> ~0.6 ms);
    redis-py falls back to its Python parser silently if it is missing."""
    import redis.utils

    assert redis.utils.HIREDIS_AVAILABLE
