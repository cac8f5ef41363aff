"""The feature-store loader fills Redis from a real MovieLens dataset."""

from __future__ import annotations

import asyncio
from pathlib import Path

from movielens.data import load
from movielens.features import MovieLensFeatures
from serving.feature_files import main
from serving.feature_store import FeatureStore


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


def test_fetch_recovers_a_dropped_connection_and_fails_as_one_error(redis_url: str) -> None:
    """/rank's one round trip (:meth:`FeatureStore._round_trip`): a pooled connection the server
    dropped (a Redis restart) is retried once on a new connection, so even the first fetch after it
    is answered; an unreachable store is one :class:`FeatureStoreError` (``/rank`` then answers 503)."""
    import pytest
    import redis.asyncio as aioredis

    from serving.feature_store import FeatureStoreError, encode_slots

    async def run() -> None:
        store = FeatureStore(redis_url, "droptest")
        admin = aioredis.Redis.from_url(redis_url)
        try:
            await admin.set("droptest:i:7", encode_slots({"item_id": [7]}))
            await admin.rpush("droptest:clicks:1", 5, 6)
            first = await store.fetch(1, [7, 8])
            assert first.user is None and first.items == [{"item_id": [7]}, None] and first.recent_items == [5, 6]
            await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            again = await store.fetch(1, [7])
            assert again.items == [{"item_id": [7]}] and again.recent_items == [5, 6]
        finally:
            await admin.delete("droptest:i:7", "droptest:clicks:1")
            await admin.aclose()
            await store.close()
        down = FeatureStore("redis://127.0.0.1:1/0", timeout_s=0.5)
        try:
            with pytest.raises(FeatureStoreError, match="fetch failed"):
                await down.fetch(1, [7])
        finally:
            await down.close()

    asyncio.run(run())
