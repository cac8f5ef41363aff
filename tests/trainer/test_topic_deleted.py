"""The examples topic deleted under a running trainer (an operator's ``kafka-topics --delete``), on
the real broker: tansu goes on taking and serving the topic's new records with the topic out of its
metadata, and answers every offset commit UnknownTopicOrPartition, which aiokafka retries for ever
(tansu quirk 11). The trainer must not hang there: it goes on training, shows that its commits are
not taken, and a SIGTERM stops it cleanly (it waited for ever before)."""

from __future__ import annotations

import asyncio
import signal
import time

from aiokafka import TopicPartition

from services import tansu_quirks
from services.kafka import connected_admin, producer, start_client
from services.ports import free_port
from tests.composestack import metric
from tests.trainer.test_online import _spawn, small_cfg
from trainer import snapshots
from trainer.data import MovieLensData, example_records, produce_examples

N = 4_000


def _metric(port: int, name: str) -> float:
    """A sample of the trainer's /metrics (0 while it does not answer)."""
    return metric(f"http://127.0.0.1:{port}/metrics", name) or 0.0


async def test_a_trainer_whose_topic_is_deleted_goes_on_says_so_and_stops_cleanly(settings, tmp_path):
    examples = MovieLensData(limit=N).examples()
    (tmp_path / "model.json").write_text(small_cfg().model_dump_json())
    topic = settings.topics.examples
    tps = [TopicPartition(topic, p) for p in range(settings.topics.partitions)]
    first = await produce_examples(settings, examples[:N // 2], chunk=250)
    log, port = tmp_path / "trainer.log", free_port()
    p = _spawn(settings, tmp_path, log, idle_s="600", DRIFTLINE_METRICS_PORT=str(port),
               DRIFTLINE_KAFKA__CONNECT_TIMEOUT_S="3")  # (each commit's bound, and a stop's wait for one)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and sum(
                (await tansu_quirks.committed_offsets(settings, settings.trainer.group_id, tps)).values()) < first:
            await asyncio.sleep(0.5)
        assert _metric(port, "driftline_trainer_examples_total") == N // 2, log.read_text()[-3000:]
        out = producer(settings)  # (started while the topic exists: it knows its partitions)
        await start_client(out, settings)
        try:
            async with connected_admin(settings) as admin:
                await admin.delete_topics([topic])
                assert topic not in await admin.list_topics()
            await asyncio.sleep(2)
            # the ghost's new records, past the trainer's positions (those before them it skips: quirk 11)
            records = example_records(examples[N // 2:], list(range(settings.topics.partitions)), chunk=250)
            await asyncio.gather(*[await out.send(topic, value, partition=part) for part, value in records])
        finally:
            await out.stop()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _metric(port, "driftline_trainer_offset_commits_refused"):
            assert p.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.5)
        learned = _metric(port, "driftline_trainer_examples_total")
        assert _metric(port, "driftline_trainer_offset_commits_refused") == 1, log.read_text()[-3000:]
        assert learned > N // 2  # it trained on the ghost meanwhile
        assert "the broker does not answer them" in log.read_text()
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]
        stopped_s = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert stopped_s < 20, stopped_s
    assert "stopping with the offsets of" in log.read_text()
    final = snapshots.read_manifest(settings.var_dir / "snapshots" / "deepfm")
    assert final["examples_applied"] == learned  # the last snapshot holds what it learned
