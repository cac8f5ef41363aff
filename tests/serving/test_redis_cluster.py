"""The feature store on a real Redis Cluster (the embedded redis-server, 3 masters): the loader,
/rank (real HTTP) and the real-time clicks through it; a master killed without a replica fails
only the requests that read its keys (a 503 with the reason, counted); a master with a replica
is failed over and every request is served again within seconds (that cluster has a password:
the URL's reaches every node, a wrong one is one line)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from serving_helpers import replica_settings, running, wait_ready

from services.settings import RedisClientSettings, Settings, get_settings
from serving.app import create_app
from serving.feature_files import main
from serving.feature_store import LOADED_MARKER, FeatureStore
from tests.redis_cluster import LocalCluster, Node

USERS = range(1, 41)
ITEMS = range(1, 201)


def _load(tmp_path: Path, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch,
          capsys: pytest.CaptureFixture[str], code: int = 0) -> str:
    """``driftline features load`` with the cluster setting from the environment, as a user runs
    it; its stderr."""
    users, items = tmp_path / "users.csv", tmp_path / "items.csv"
    users.write_text("user_id,gender\n" + "".join(f"{u},g{u % 2}\n" for u in USERS))
    items.write_text("item_id,genre\n" + "".join(f"{i},g{i % 7}\n" for i in ITEMS))
    monkeypatch.setenv("DRIFTLINE_REDIS_CLIENT__CLUSTER", "true")
    get_settings.cache_clear()
    try:
        assert main(["load", "--users", str(users), "--items", str(items), "--redis-url", url,
                     "--prefix", prefix]) == code
    finally:
        get_settings.cache_clear()
    out = capsys.readouterr()
    assert code or f"loaded {len(USERS) + len(ITEMS)} feature keys" in out.out
    return out.err


def _options(settings: Settings, tmp_path: Path, url: str, prefix: str) -> Settings:
    options = replica_settings(settings, prefix, tmp_path / "snapshots").updated(redis_client=dict(cluster=True))
    return options.model_copy(update={"redis_url": url})


def _rank(base: str, user: int, items: list[int]) -> httpx.Response:
    return httpx.post(f"{base}/rank", json={"user_id": user, "candidates": [{"item_id": i} for i in items]},
                      timeout=15)


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _on(cluster: LocalCluster, store: FeatureStore, node: Node, alive: bool) -> tuple[int, list[int]]:
    """A user whose keys are on ``node`` (alive=False) or on none of its slots (True), and 10 items
    off ``node``."""
    def off(key: str) -> bool:
        return cluster.node_of(key) is not node

    user = next(u for u in USERS if (off(store.user_key(u)) and off(store.clicks_key(u))) == alive
                and (alive or not off(store.user_key(u))))
    return user, [i for i in ITEMS if off(store.item_key(i))][:10]


@contextmanager
def serving_on_cluster(settings: Settings, tmp_path: Path, replicas: int, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str], password: str | None = None,
                       ) -> Iterator[tuple[LocalCluster, str, FeatureStore]]:
    """A 3-master cluster with the features loaded, and serving on it: (cluster, base URL, store)."""
    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=replicas, password=password)
    url = cluster.url.replace("redis://", f"redis://:{password}@") if password else cluster.url
    prefix = f"c{time.time_ns()}"
    try:
        if password:  # a wrong one is one line, without it
            err = _load(tmp_path, url.replace(password, "wrong-pw"), prefix, monkeypatch, capsys, code=1)
            assert "Redis refused the login" in err and "wrong-pw" not in err, err
        _load(tmp_path, url, prefix, monkeypatch, capsys)
        app = create_app(_options(settings, tmp_path, url, prefix))
        with running(app) as base:
            store = app.state.serving.store
            assert store.cluster and app.state.serving.realtime.store is store
            assert wait_ready(base)["feature_store"] is True
            yield cluster, base, store
    finally:
        cluster.stop()


def test_a_cluster_serves_and_a_dead_master_fails_only_its_keys(settings: Settings, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with serving_on_cluster(settings, tmp_path, 0, monkeypatch, capsys) as (cluster, base, store):
        r = _rank(base, 1, list(ITEMS[:50]))  # 50 items: keys on every master
        assert r.status_code == 200 and r.json()["user_known"] is True, r.text

        # The real-time history: a click through /actions lands in the user's list.
        deadline = time.monotonic() + 90  # the reader joins its group first (~5 s alone, longer under load)
        n = 0
        while not asyncio.run(_clicks(cluster.url, store.prefix, 2)):
            n += 1
            assert httpx.post(f"{base}/actions", timeout=10, json={"actions": [
                {"request_id": f"a{n}", "item_id": 7, "action_type": "click", "user_id": 2}]}).status_code == 202
            assert time.monotonic() < deadline, "recent clicks never recorded in the cluster"
            time.sleep(0.3)

        # The master holding the load marker dies (no replica): its keys fail, the rest are served.
        dead = cluster.node_of(store.marker_key(LOADED_MARKER))
        cluster.kill(dead)
        refused_before = _metric(base, "driftline_serving_feature_store_unavailable_total")
        user, items = _on(cluster, store, dead, alive=True)
        lost_user, _ = _on(cluster, store, dead, alive=False)
        reasons = []
        for _ in range(5):
            r = _rank(base, user, items)
            assert r.status_code == 200 and r.json()["user_known"] is True, r.text
            r = _rank(base, lost_user, items)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            reasons.append(r.json()["detail"])
            r = _rank(base, user, [*items, *ITEMS])  # some candidates on the dead master
            assert r.status_code == 503, r.text
        assert all(d.startswith("feature store fetch failed (redis://127.0.0.1:") for d in reasons), reasons
        assert f"Error 111 connecting to 127.0.0.1:{dead.port}" in reasons[-1], reasons
        # At once, too: a failing read of the dead master's keys fails no read in flight on the
        # live ones (redis-py's own retry closed every node's connections and failed them all).
        with ThreadPoolExecutor(25) as pool:
            codes = list(pool.map(lambda u: _rank(base, u, items).status_code, [user] * 20 + [lost_user] * 5))
        assert codes == [200] * 20 + [503] * 5, codes
        assert _metric(base, "driftline_serving_feature_store_unavailable_total") == refused_before + 15
        # The marker cannot be read: the store is down in part, not emptied.
        ready = httpx.get(f"{base}/readyz", timeout=10).json()
        assert ready["feature_store"] is False and ready["feature_store_emptied"] is False


async def _clicks(url: str, prefix: str, user: int) -> list[int]:
    store = FeatureStore(url, prefix, client=RedisClientSettings(cluster=True))
    try:
        return (await store.fetch(user, [])).recent_items
    finally:
        await store.close()


def test_a_master_with_a_replica_fails_over_and_requests_are_served_again(settings: Settings, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with serving_on_cluster(settings, tmp_path, 1, monkeypatch, capsys, password="cluster-pw") as (cluster, base, store):
        assert _rank(base, 1, list(ITEMS[:50])).status_code == 200
        killed = time.monotonic()
        cluster.kill(cluster.node_of(store.user_key(1)))
        codes = []
        while True:  # cluster-node-timeout 1 s: the replica takes over within seconds
            r = _rank(base, 1, list(ITEMS[:50]))
            codes.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text
            assert time.monotonic() - killed < 20, f"not failed over in 20 s: {r.text}"
            time.sleep(0.2)
        recovered_s = time.monotonic() - killed
        for _ in range(10):  # and stays served
            r = _rank(base, 1, list(ITEMS[:50]))
            assert r.status_code == 200 and r.json()["user_known"] is True, r.text
        assert httpx.get(f"{base}/readyz", timeout=10).json()["feature_store"] is True
    print(f"served again {recovered_s:.1f} s after the kill; answers until then: {codes}")
