"""The embedded Redis keeps the feature store across a kill -9 (its append-only file)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from driftline.embedded import redis_command, wait_for_port
from services.ports import free_port


def test_a_killed_redis_restarts_with_its_keys(tmp_path: Path) -> None:
    port = free_port()
    argv = redis_command("127.0.0.1", port, tmp_path / "redis")
    log = open(tmp_path / "redis.log", "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 20, "redis", proc)
        client = redis.Redis(port=port)
        client.mset({f"driftline:u:{i}": f"user {i}" for i in range(1000)})
        client.lpush("driftline:clicks:1", 5, 6, 7)
        time.sleep(1.5)  # appendfsync everysec
        proc.kill()
        proc.wait()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port("127.0.0.1", port, 20, "redis", proc)
        deadline = time.monotonic() + 10
        while True:  # the port opens before the file is loaded: LOADING errors until then
            try:
                client = redis.Redis(port=port)
                assert client.dbsize() == 1001
                break
            except redis.exceptions.BusyLoadingError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert client.get("driftline:u:999") == b"user 999"
        assert client.lrange("driftline:clicks:1", 0, -1) == [b"7", b"6", b"5"]
    finally:
        proc.kill()
        proc.wait()
