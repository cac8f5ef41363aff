"""The embedded Redis keeps the feature store across a kill -9 (its append-only file)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from driftline.embedded import redis_command, repair_redis_aof, wait_for_port
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


def test_a_damaged_append_only_file_is_cut_at_the_damage_and_redis_starts(tmp_path: Path) -> None:
    """Bytes garbled in the middle of the append-only file (a disk's error): Redis itself refuses
    to start on it, on every restart. ``repair_redis_aof`` (the supervisor runs it before each
    start) keeps the file aside and cuts a copy at the first bad command: Redis starts with the keys
    written before the damage; a file that reads is left alone."""
    port = free_port()
    data = tmp_path / "redis"
    argv = redis_command("127.0.0.1", port, data)
    log = open(tmp_path / "redis.log", "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 20, "redis", proc)
        client = redis.Redis(port=port)
        for i in range(400):
            client.set(f"driftline:u:{i:03d}", f"user {i}")
        time.sleep(1.5)  # appendfsync everysec
    finally:
        proc.kill()
        proc.wait()
    assert repair_redis_aof(data) is None  # (whole: left alone)
    aof = data / "appendonly.aof"
    raw = bytearray(aof.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 8] = b"#" * 8
    aof.write_bytes(bytes(raw))
    assert subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=20).returncode != 0  # (Redis alone)
    aside = repair_redis_aof(data)
    assert aside is not None and aside.read_bytes() == bytes(raw) and aof.stat().st_size < len(raw)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 20, "redis", proc)
        deadline = time.monotonic() + 10
        while True:
            try:
                n = redis.Redis(port=port).dbsize()
                break
            except redis.exceptions.BusyLoadingError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert 100 < n < 400, n
        assert redis.Redis(port=port).get("driftline:u:000") == b"user 0"
    finally:
        proc.kill()
        proc.wait()


def test_an_empty_append_only_file_is_left_alone(tmp_path: Path) -> None:
    """Redis started on nothing and killed leaves an empty file, which redis-check-aof calls
    "Empty file" and Redis reads: not a damage."""
    (tmp_path / "appendonly.aof").write_bytes(b"")
    assert repair_redis_aof(tmp_path) is None
    assert [p.name for p in tmp_path.iterdir()] == ["appendonly.aof"]
