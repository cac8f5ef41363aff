"""The online trainer while its broker stops answering (SIGSTOP: a long pause, a network that
drops packets) and answers again, on a broker of this module's own: the trainer waits, it does
not exit, and every example is applied once."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.settings import Settings
from tests.conftest import Broker
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.online import OnlineTrainer

N = 4_000


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory):
    b = Broker(tmp_path_factory.mktemp("hang-broker"))
    yield b
    b.stop()


@pytest.fixture
def settings(own_broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    suffix = uuid.uuid4().hex[:8]
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", own_broker.bootstrap)
    s = Settings(var_dir=tmp_path / "var")
    for name in ("features", "actions", "examples", "param_deltas", "dead_letters"):
        setattr(s.topics, name, f"{name.replace('_', '-')}-{suffix}")
    # a request the broker does not answer fails after 8 s (tansu's group joins take some seconds),
    # and used to be given up for good then (2 s after the first try)
    return s.updated(kafka={"connect_timeout_s": 2.0, "request_timeout_ms": 8_000, "session_timeout_ms": 4_000,
                            "heartbeat_interval_ms": 1_000},
                     trainer={"sync_interval_s": 0.3, "snapshot_interval_event_s": 0, "batch_size": 128})


def _waiting(model_id: str) -> float:
    return REGISTRY.get_sample_value("driftline_trainer_publish_waiting_seconds", {"model": model_id}) or 0.0


async def test_the_trainer_waits_out_a_hung_broker(settings: Settings, own_broker: Broker) -> None:
    """Before, a parameter delta the hung broker did not take within ``kafka.connect_timeout_s``
    made the trainer exit (a 60 s hang in ``make chaos``: a restart from the last snapshot,
    training again what it had applied since; a longer one: a crash loop)."""
    examples = MovieLensData(limit=N).examples()
    await produce_examples(settings, examples)
    tr = OnlineTrainer(settings, deepfm_config(dim=8, mlp=[32]))
    run = asyncio.create_task(tr.run())
    assert own_broker.proc is not None
    waited = 0.0
    try:
        deadline = time.monotonic() + 60
        while tr.publisher.sparse_version == 0:  # training and publishing
            assert time.monotonic() < deadline and not run.done()
            await asyncio.sleep(0.02)
        own_broker.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(140):  # 14 s: past the request timeout and the connect timeout
                await asyncio.sleep(0.1)
                waited = max(waited, _waiting(tr.publisher.model_id))
                assert not run.done(), run.exception()
        finally:
            own_broker.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 90
        while tr.examples_applied < N:
            assert time.monotonic() < deadline and not run.done(), tr.examples_applied
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # nothing more: none applied twice
    finally:
        own_broker.proc.send_signal(signal.SIGCONT)
        tr.stop_event.set()
    res = await asyncio.wait_for(run, 60)
    assert waited > 2.0, "no publish waited past the connect timeout: the test proves nothing"
    assert res["examples_applied"] == N, res
    assert _waiting(tr.publisher.model_id) == 0
