"""``driftline features load --watch`` keeps the store loaded: a Redis restarted without its data
(kill -9 of one without persistence), or flushed, gets the features again, and a load that fails
does not end the watch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import redis

from driftline.embedded import redis_binary, wait_for_port
from services.ports import free_port
from serving.feature_store import LOADED_MARKER, marker_key


def _redis(port: int, tmp: Path) -> subprocess.Popen:
    """A Redis without persistence (compose's before it had any): a restart comes back empty."""
    proc = subprocess.Popen([str(redis_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 20, "redis", proc)
    return proc


def _until(what: str, check: Callable[[], object], log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _loads(metrics_port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    got = {}
    for line in body.splitlines():
        if line.startswith("driftline_serving_feature_load"):
            name, value = line.rsplit(" ", 1)
            got[name] = float(value)
    return got


def test_the_watch_loads_again_after_a_restart_without_data_a_flush_and_a_failed_load(tmp_path: Path) -> None:
    users = tmp_path / "users.csv"
    users.write_text("user_id,age,city\n1,25,paris\n2,31,lyon\n")
    port, metrics_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = _redis(port, tmp_path)
    client = redis.Redis(port=port)
    marker = marker_key("driftline", LOADED_MARKER)
    log = tmp_path / "keeper.log"
    env = {**{k: v for k, v in os.environ.items() if k != "DRIFTLINE_PROJECT"},  # (no project's declarations)
           "DRIFTLINE_METRICS_PORT": str(metrics_port), "DRIFTLINE_SERVING__FEATURE_STORE_CHECK_S": "0.2"}
    keeper = subprocess.Popen([sys.executable, "-m", "driftline.cli", "features", "load", "--users", str(users),
                               "--redis-url", url, "--watch"], env=env, stdout=log.open("wb"),
                              stderr=subprocess.STDOUT)

    def loaded() -> bool:
        try:
            return client.get(marker) is not None and client.get("driftline:u:2") is not None
        except redis.ConnectionError:
            return False

    try:
        _until("the first load (the store held none)", loaded, log)
        _until("its metrics", lambda: _loads(metrics_port).get(
            'driftline_serving_feature_loads_total{reason="absent"}') == 1.0, log)
        first = client.get(marker)

        server.kill()  # a Redis without persistence, killed and started again: empty
        server.wait()
        server = _redis(port, tmp_path)
        assert client.dbsize() == 0
        _until("the features loaded again after the restart", loaded, log)
        assert client.get(marker) != first  # (a new load's marker: written now)

        client.flushall()
        _until("the features loaded again after a flush", loaded, log)
        assert _loads(metrics_port)['driftline_serving_feature_loads_total{reason="lost"}'] == 2.0

        users.rename(tmp_path / "moved.csv")  # the next load fails: the watch goes on
        client.flushall()
        _until("a failed load counted", lambda: _loads(metrics_port).get(
            "driftline_serving_feature_load_failures_total", 0) >= 1, log)
        assert keeper.poll() is None
        (tmp_path / "moved.csv").rename(users)
        _until("the features loaded once the file is back", loaded, log)
        assert client.get("driftline:u:1") is not None
    finally:
        keeper.send_signal(signal.SIGTERM)
        code = keeper.wait(timeout=20)
        server.kill()
        server.wait()
    assert code == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "lost the features loaded into it" in text and "loading the features failed" in text
