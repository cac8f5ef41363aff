"""The compose Redis's start (``deploy/redis/start.sh``), run as compose runs it (its command, the
script from the repository, the embedded redis-server under the image's names): an append-only
file damaged in its middle, on which Redis alone refuses to start every time, is cut at the
damage; one that cannot be cut is set aside and Redis starts without it; the newest three damaged
copies are kept. The whole stack's side (the keeper loads the features again) is in
``tests/test_compose_processes.py``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from driftline.embedded import wait_for_port
from tests.composestack import ComposeProcesses

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def stack(tmp_path: Path) -> ComposeProcesses:
    return ComposeProcesses.create(ROOT, tmp_path)


def _run(stack: ComposeProcesses, log: Path) -> subprocess.Popen:
    return subprocess.Popen(stack.redis_argv(), env=stack.redis_env(), stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _keys(port: int) -> int:
    deadline = time.monotonic() + 20
    while True:  # the port opens before the file is loaded: LOADING errors until then
        try:
            return int(redis.Redis(port=port).dbsize())
        except redis.exceptions.BusyLoadingError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _write_and_kill(stack: ComposeProcesses, log: Path, n: int, rewrite: bool = False) -> None:
    proc = _run(stack, log)
    try:
        wait_for_port("127.0.0.1", stack.redis_port, 20, "redis", proc)
        client = redis.Redis(port=stack.redis_port)
        if rewrite:  # the file becomes an RDB snapshot first (the rewrite's preamble), commands after it
            client.flushall()
            client.mset({f"driftline:u:{i:03d}": f"user {i}" for i in range(n)})
            client.bgrewriteaof()
            while client.info("persistence")["aof_rewrite_in_progress"]:
                time.sleep(0.05)
        for i in range(n):
            client.set(f"driftline:i:{i:03d}", f"item {i}")
        time.sleep(1.5)  # appendfsync everysec
    finally:
        proc.kill()
        proc.wait()


def _garble(aof: Path, at: float) -> None:
    """Four bytes garbled: where a command starts at or after ``at`` of the file (inside a value
    they would be only data), else right there (an RDB part: its checksum fails)."""
    raw = bytearray(aof.read_bytes())
    i = int(len(raw) * at)
    if not raw.startswith(b"REDIS"):
        i = raw.index(b"\r\n*", i) + 2
    raw[i:i + 4] = b"####"
    aof.write_bytes(bytes(raw))


def _damaged(stack: ComposeProcesses) -> list[Path]:
    return sorted(stack.redis_data().glob("appendonly.aof.damaged-*"))


def test_a_damaged_append_only_file_is_cut_and_redis_starts(stack: ComposeProcesses, tmp_path: Path) -> None:
    log = tmp_path / "redis.log"
    _write_and_kill(stack, log, 400)
    aof = stack.redis_data() / "appendonly.aof"
    _garble(aof, 0.5)
    plain = subprocess.run(stack.redis_argv()[2:], env=stack.redis_env(), capture_output=True, timeout=20)
    assert plain.returncode != 0, "redis-server alone starts on the damaged file: nothing to show here"
    damaged = aof.read_bytes()
    proc = _run(stack, log)
    try:
        wait_for_port("127.0.0.1", stack.redis_port, 20, "redis", proc)
        assert 100 < _keys(stack.redis_port) < 400
        assert redis.Redis(port=stack.redis_port).get("driftline:i:000") == b"item 0"
    finally:
        proc.kill()
        proc.wait()
    assert [p.read_bytes() for p in _damaged(stack)] == [damaged]
    assert "cut at the first bad command" in log.read_text()
    # a file that reads is left alone
    proc = _run(stack, log)
    try:
        wait_for_port("127.0.0.1", stack.redis_port, 20, "redis", proc)
    finally:
        proc.kill()
        proc.wait()
    assert len(_damaged(stack)) == 1


def test_a_file_that_cannot_be_cut_is_set_aside_and_the_newest_three_copies_kept(
        stack: ComposeProcesses, tmp_path: Path) -> None:
    """Damage in the RDB snapshot a rewrite put at the file's start: nothing before it to keep, so
    Redis starts empty (the features' keeper loads them again); four damages keep three copies."""
    log = tmp_path / "redis.log"
    for n in range(4):
        _write_and_kill(stack, log, 300, rewrite=True)
        aof = stack.redis_data() / "appendonly.aof"
        assert aof.read_bytes().startswith(b"REDIS"), "no RDB preamble: the rewrite did not happen"
        _garble(aof, 0.1)
        proc = _run(stack, log)
        try:
            wait_for_port("127.0.0.1", stack.redis_port, 20, "redis", proc)
            assert _keys(stack.redis_port) == 0
        finally:
            proc.kill()
            proc.wait()
        assert len(_damaged(stack)) == min(n + 1, 3)
        time.sleep(1.0)  # (a copy's name has its second)
    assert "cannot be cut" in log.read_text() and "deleted an older damaged copy" in log.read_text()
