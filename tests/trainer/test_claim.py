"""The trainers' claim group on the real broker (trainer.claim): alone, shared while a second
trainer claims the same examples under the same group, alone again when it leaves; a trainer of
another topic under the same group is no conflict."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from prometheus_client import REGISTRY

from services.kafka import create_topics
from trainer.claim import ALONE, SHARED, UNKNOWN, Claim


async def _until(what: str, ok: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.1)


async def test_a_second_claim_on_the_same_topic_and_group_is_seen_by_both(settings) -> None:
    topic, other = settings.topics.examples, f"{settings.topics.examples}-other"
    await create_topics(settings, {topic: 4, other: 4})
    group = f"driftline-trainer-{uuid.uuid4().hex[:8]}"
    first = Claim(settings, topic, group)
    assert first.state == UNKNOWN  # (not started: it does not know yet)
    await first.start()
    await _until("the first claim alone", lambda: first.state == ALONE)
    assert REGISTRY.get_sample_value("driftline_trainer_claim_partitions_elsewhere") == 0

    elsewhere = Claim(settings, other, group)  # another topic, same group: no conflict
    second = Claim(settings, topic, group)
    await elsewhere.start()
    await second.start()
    await _until("both claims of the topic shared", lambda: first.state == second.state == SHARED)
    assert REGISTRY.get_sample_value("driftline_trainer_claim_partitions_elsewhere") > 0
    await _until("the other topic's claim alone", lambda: elsewhere.state == ALONE)

    await second.stop()
    await _until("the first claim alone again", lambda: first.state == ALONE)
    assert REGISTRY.get_sample_value("driftline_trainer_claim_partitions_elsewhere") == 0
    await elsewhere.stop()
    await first.stop()
