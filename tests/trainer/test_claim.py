"""The trainers' claim group on the real broker (trainer.claim): alone, shared while a second
trainer claims the same examples under the same group, alone again when it leaves or is killed -9;
a trainer of another topic under the same group is no conflict."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

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


async def test_a_claim_whose_peer_is_killed_9_is_alone_again_without_a_hand(settings) -> None:
    topic, group = settings.topics.examples, f"driftline-trainer-{uuid.uuid4().hex[:8]}"
    await create_topics(settings, {topic: 4})
    first = Claim(settings, topic, group)
    await first.start()
    await _until("the first claim alone", lambda: first.state == ALONE)
    peer = subprocess.Popen([sys.executable, "-c", PEER, settings.bootstrap_servers, topic, group],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert peer.stdout is not None and (await asyncio.to_thread(peer.stdout.readline)).strip() == "shared"
        await _until("the first claim shared", lambda: first.state == SHARED)
    finally:
        peer.kill()  # (-9: no LeaveGroup; its session, 6 s, ends)
        peer.wait()
    await _until("the first claim alone again", lambda: first.state == ALONE, timeout_s=30.0)
    await first.stop()


# a second trainer's claim in another process: says "shared" once it sees the first
PEER = """
import asyncio, sys
sys.path.insert(0, ".")
from services.settings import Settings
from trainer.claim import SHARED, Claim
async def main(bootstrap, topic, group):
    c = Claim(Settings(kafka_bootstrap_servers=bootstrap), topic, group)
    await c.start()
    while c.state != SHARED:
        await asyncio.sleep(0.1)
    print("shared", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main(*sys.argv[1:]))
"""
