"""``python -m serving`` as a real process: a 200 from /rank survives kill -9 (the spool), a broker
that is down while requests are answered gets every feature log once it is back, and SIGTERM
ships the spool and exits 0.

Delivery is at least once: a kill between Kafka's acknowledgement and the spool's shipped mark
ships those entries again after the restart (the joiner drops duplicate impressions), so the
checks are "every answered request id is on the topic", not "exactly once".
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serving_helpers import read_keys, read_records

from services.ports import free_port
from services.settings import Settings
from serving.fm_model import FMModel
from tests.conftest import Broker

ROOT = Path(__file__).resolve().parents[2]


class ServingProcess:
    """One serving replica as a subprocess, restartable on the same port (and so the same spool)."""

    def __init__(self, settings: Settings, redis_url: str, prefix: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        t = settings.topics
        self.env = dict(
            os.environ, KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers, REDIS_URL=redis_url,
            DRIFTLINE_VAR_DIR=str(settings.var_dir), DRIFTLINE_LOG_LEVEL="INFO",
            DRIFTLINE_TOPICS__FEATURES=t.features, DRIFTLINE_TOPICS__ACTIONS=t.actions,
            DRIFTLINE_TOPICS__PARAM_DELTAS=t.param_deltas, DRIFTLINE_TOPICS__DEAD_LETTERS=t.dead_letters,
            DRIFTLINE_SERVING__MODEL="fm", DRIFTLINE_SERVING__EMBEDDING_DIM="4",
            DRIFTLINE_SERVING__KAFKA_RETRY_S="0.3", DRIFTLINE_SERVING__REDIS_PREFIX=prefix,
            DRIFTLINE_SERVING__FEATURE_LOG_SEND_TIMEOUT_S="1",
            # A kill -9'd member lingers in its group until its session ends: keep it out of others'.
            DRIFTLINE_SERVING__REALTIME_GROUP_ID=f"realtime-{prefix}",
        )
        # A snapshot makes the replica ready without the broker.
        FMModel(dim=4).save_snapshot(settings.var_dir / "snapshots")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "serving", "--port", str(self.port)],
                                     cwd=ROOT, env=self.env, stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"serving exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)

    def signal(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=30)
        self.proc = None
        return code

    def rank(self, request_ids: list[str]) -> None:
        """Answer each request (8 at a time); every one must be a 200."""
        def one(rid: str) -> int:
            body = {"request_id": rid, "user_id": 1, "candidates": [{"item_id": i} for i in range(1, 21)]}
            return httpx.post(f"{self.url}/rank", json=body, timeout=10).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, request_ids))
        assert codes == [200] * len(request_ids)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def replica(settings: Settings, redis_url: str, tmp_path: Path) -> Iterator[ServingProcess]:
    p = ServingProcess(settings, redis_url, f"p{time.time_ns()}", tmp_path / "serving.log")
    yield p
    p.stop()


def _unshipped_at_start(log: Path) -> int:
    lines = [x for x in log.read_text().splitlines() if "left unshipped by the last run" in x]
    return int(lines[-1].split(": ")[-1].split(" entries")[0]) if lines else 0


def test_kill_9_after_answers_then_sigterm(replica: ServingProcess, settings: Settings) -> None:
    replica.start()
    first = [f"k9-{i}" for i in range(60)]
    replica.rank(first)
    assert replica.signal(signal.SIGKILL) == -signal.SIGKILL  # right after the last answer
    replica.start()  # same port, same spool: ships what the killed one had not
    second = [f"term-{i}" for i in range(20)]
    replica.rank(second)
    assert replica.signal(signal.SIGTERM) == 0  # the stop shipped the spool within its bound
    want = set(first) | set(second)
    seen = asyncio.run(read_keys(settings, settings.topics.features, want))
    assert want <= seen, sorted(want - seen)[:10]
    print(f"feature logs the killed replica left in its spool: {_unshipped_at_start(replica.log)}")


def test_broker_down_answers_are_spooled_and_shipped_after_kill_9(
        settings: Settings, redis_url: str, tmp_path: Path) -> None:
    own = Broker(tmp_path)  # this test stops its broker: not the session's
    settings = settings.model_copy(update={"kafka_bootstrap_servers": own.bootstrap})
    replica = ServingProcess(settings, redis_url, f"p{time.time_ns()}", tmp_path / "serving.log")
    try:
        own.stop()
        replica.start()
        down = [f"down-{i}" for i in range(30)]
        replica.rank(down)  # answered from the spool: Kafka is unreachable
        assert httpx.get(f"{replica.url}/readyz").json()["feature_log_buffered"] == 30
        assert replica.signal(signal.SIGKILL) == -signal.SIGKILL
        replica.start()  # still no broker: the tail waits in the spool
        later = [f"later-{i}" for i in range(10)]
        replica.rank(later)
        own.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{replica.url}/readyz").json()["feature_log_buffered"]:
            assert time.monotonic() < deadline, "the spool was not shipped after the broker came back"
            time.sleep(0.2)
        assert replica.signal(signal.SIGINT) == 0
        want = set(down) | set(later)
        seen = asyncio.run(read_keys(settings, settings.topics.features, want))
        assert want <= seen, sorted(want - seen)[:10]
        assert _unshipped_at_start(replica.log) == 30
    finally:
        replica.stop()
        own.stop()


def test_a_hung_broker_answers_actions_503_in_time_and_an_action_sent_again_counts_once(
        settings: Settings, redis_url: str, tmp_path: Path) -> None:
    """A broker that stops answering (SIGSTOP: a long pause, a network that drops packets) but
    keeps its connections: ``/actions`` is a 503 within its send timeout that says sending again is
    safe, ``/rank`` is answered from the spool. The producer still writes the action it took once
    the broker answers; the client's second send of it is one more copy on ``actions``, and the
    user's recent clicks hold the item once."""
    import redis

    own = Broker(tmp_path)  # this test stops its broker: not the session's
    settings = settings.model_copy(update={"kafka_bootstrap_servers": own.bootstrap})
    prefix = f"p{time.time_ns()}"
    replica = ServingProcess(settings, redis_url, prefix, tmp_path / "serving.log")
    store = redis.Redis.from_url(redis_url)
    post = lambda path, body: httpx.post(f"{replica.url}{path}", json=body, timeout=15)  # noqa: E731
    click = lambda item: {"actions": [{"request_id": f"r{item}", "item_id": item, "action_type": "click",  # noqa: E731
                                       "user_id": 3}]}
    clicks = lambda: [int(x) for x in store.lrange(f"{prefix}:clicks:3", 0, -1)]  # noqa: E731
    try:
        replica.start()
        deadline = time.monotonic() + 30
        while clicks() != [1]:  # (the recent-clicks reader joined: a new group starts at the end)
            assert post("/actions", click(1)).status_code == 202
            assert time.monotonic() < deadline, clicks()
            time.sleep(0.5)
        assert own.proc is not None
        own.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            r = post("/actions", click(2))
            assert r.status_code == 503 and "sending them again is safe" in r.json()["message"], r.text
            assert time.monotonic() - started < 5
            replica.rank(["during-the-hang"])
        finally:
            own.proc.send_signal(signal.SIGCONT)
        assert post("/actions", click(2)).status_code == 202  # the client's second send
        deadline = time.monotonic() + 30
        while clicks() != [2, 1]:
            assert time.monotonic() < deadline, clicks()
            time.sleep(0.2)
        from proto import Action

        copies = lambda: sum(a.request_id == "r2" for a in asyncio.run(  # noqa: E731
            read_records(settings, settings.topics.actions, Action, 1000, timeout=3)))
        deadline = time.monotonic() + 30
        while copies() < 2:  # the one the 503 answered, written once the broker answered, and the resend
            assert time.monotonic() < deadline
        assert clicks() == [2, 1]
        assert "during-the-hang" in asyncio.run(read_keys(settings, settings.topics.features, {"during-the-hang"}))
    finally:
        store.close()
        replica.stop()
        own.stop()
