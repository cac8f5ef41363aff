"""A second one-process trainer joins the first one's consumer group (started by hand with the same
settings, on another machine: its own directory, no snapshot): neither learns part of the stream
nor publishes over the other. Both pause and publish nothing (the newcomer not even its
untrained weights) while they share the group; when the newcomer leaves, the first takes every
partition back and learns every example once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from prometheus_client import REGISTRY, generate_latest

from status.options import StatusSettings, Target
from status.scrape import Scraper
from tests.status.fakestack import MetricsServer
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.online import OnlineTrainer

from .test_online import read_topic


async def _until(what: str, ok: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.1)


async def _shown_on_the_status_page(url: str) -> bool:
    """Whether the status page, scraping ``url``, says the trainer's group is shared."""
    async with Scraper([Target("trainer", url)], StatusSettings()) as scraper:
        await scraper.scrape_once()
    return any("another consumer in the trainer's group" in p["problem"] for p in scraper.problems)


async def test_a_second_trainer_in_the_group_makes_both_wait_and_publish_nothing(settings, tmp_path) -> None:
    examples = MovieLensData(limit=2_000).examples()
    cfg = deepfm_config(dim=8, mlp=[32])
    s = settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=3600, batch_size=256,
                                      group_id=f"driftline-trainer-{uuid.uuid4().hex[:8]}"))
    await produce_examples(settings, examples[:1_000])
    first = OnlineTrainer(s, cfg)
    running = asyncio.create_task(first.run())
    await _until("the first trainer learned the first half", lambda: first.examples_applied == 1_000)
    await asyncio.sleep(1.5)  # (its sync of what it learned)

    second = OnlineTrainer(s.model_copy(update={"var_dir": tmp_path / "another-machine"}), cfg)
    joined = asyncio.create_task(second.run())
    await _until("both see the group shared", lambda: first.group_share.sharing and second.group_share.sharing)
    published = len(await read_topic(settings, settings.topics.param_deltas, timeout_s=1.0))
    assert REGISTRY.get_sample_value("driftline_trainer_group_partitions_elsewhere") > 0
    metrics = MetricsServer(render=lambda: generate_latest(REGISTRY))  # (this process's /metrics: both trainers')
    assert await _shown_on_the_status_page(metrics.url)
    await produce_examples(settings, examples[1_000:])
    await asyncio.sleep(4.0)
    assert (first.examples_applied, second.examples_applied) == (1_000, 0)

    second.stop_event.set()  # (its clean stop publishes nothing either)
    await asyncio.wait_for(joined, 60)
    assert len(await read_topic(settings, settings.topics.param_deltas, timeout_s=1.0)) == published

    await _until("the first trainer has the group to itself and learns the rest",
                 lambda: not first.group_share.sharing and first.examples_applied == 2_000)
    first.stop_event.set()
    result = await asyncio.wait_for(running, 60)
    assert result["examples_applied"] == 2_000 and result["duplicates"] == 0, result
    assert len(await read_topic(settings, settings.topics.param_deltas, timeout_s=1.0)) > published
    assert REGISTRY.get_sample_value("driftline_trainer_group_partitions_elsewhere") == 0
    assert not await _shown_on_the_status_page(metrics.url)
    metrics.stop()
