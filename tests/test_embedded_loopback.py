"""The embedded broker and Redis, which cannot authenticate clients nor encrypt, listen on the
loopback address only, and a non-loopback ``embedded.host`` is refused with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from driftline.embedded import redis_command, tansu_command, wait_for_port
from services.ports import free_port
from services.settings import EmbeddedSettings, Settings
from tests.conftest import _start, _stop

ROOT = Path(__file__).parents[1]


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_the_embedded_servers_listen_on_127_0_0_1_only(tmp_path: Path) -> None:
    """Started as ``up`` starts them (its commands, from the default settings)."""
    e = Settings(var_dir=tmp_path).embedded.model_copy(update=dict(broker_port=free_port(), redis_port=free_port()))
    broker_argv, redis_argv = tansu_command(e.host, e.broker_port), redis_command(e.host, e.redis_port, tmp_path / "redis")
    url = f"tcp://127.0.0.1:{e.broker_port}"
    assert broker_argv[broker_argv.index("--listener-url") + 1] == url  # (tansu's own default: 0.0.0.0)
    assert broker_argv[broker_argv.index("--advertised-listener-url") + 1] == url
    assert redis_argv[redis_argv.index("--bind") + 1] == "127.0.0.1"
    procs = [_start(broker_argv, tmp_path / "tansu.log"), _start(redis_argv, tmp_path / "redis.log")]
    try:
        wait_for_port(e.host, e.broker_port, 20, "broker", procs[0])
        wait_for_port(e.host, e.redis_port, 20, "redis", procs[1])
        assert _listening(procs[0].pid) == {("127.0.0.1", e.broker_port)}
        assert _listening(procs[1].pid) == {("127.0.0.1", e.redis_port)}
    finally:
        for proc in procs:
            _stop(proc)


def test_a_non_loopback_embedded_host_is_refused() -> None:
    for host in ("0.0.0.0", "::", "192.168.1.5", "kafka.example.com"):
        with pytest.raises(ValueError, match=f"embedded.host {host} is not a loopback address"):
            EmbeddedSettings(host=host)
    assert [EmbeddedSettings(host=h).host for h in ("127.0.0.1", "::1", "localhost")] == ["127.0.0.1", "::1", "localhost"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIFTLINE_", "KAFKA_", "REDIS_"))}
    done = subprocess.run([sys.executable, "-m", "driftline.cli", "up", "--no-replay"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**env, "DRIFTLINE_EMBEDDED__HOST": "0.0.0.0"})
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == ("driftline: settings: embedded.host 0.0.0.0 is not a loopback address: the embedded broker "
                           "and Redis have no authentication nor TLS and listen on 127.0.0.1 only; for servers other "
                           "hosts can reach, run your own and set KAFKA_BOOTSTRAP_SERVERS and REDIS_URL\n")
