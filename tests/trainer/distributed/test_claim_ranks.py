"""A one-process trainer started beside a running set of ranks with the same group (by hand, on
another machine: its own directory): the ranks read by manual assignment, so their group shows no
member, and only the trainers' claim group (trainer.claim) tells. Both wait and publish nothing
(the newcomer not even its untrained weights) while both exist; when the newcomer leaves, the
ranks learn the rest, every example once."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition

from services.tansu_quirks import committed_offsets
from trainer.claim import SHARED
from trainer.config import deepfm_config
from trainer.data import produce_examples
from trainer.online import OnlineTrainer

from ..test_online import read_topic
from .test_ranks import N, _results, _spawn


async def _until(what: str, ok: Callable[[], Awaitable[bool]], logs: Callable[[], str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await ok():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}\n{logs()[-3000:]}"
        await asyncio.sleep(0.2)


async def test_a_one_process_trainer_beside_a_set_of_ranks_makes_both_wait(settings, ml_examples, tmp_path) -> None:
    group = f"driftline-trainer-{uuid.uuid4().hex[:8]}"
    tps = [TopicPartition(settings.topics.examples, p) for p in range(settings.topics.partitions)]
    log = tmp_path / "ranks.log"
    logs = lambda: log.read_text()  # noqa: E731 - read when a wait fails

    async def committed(records: int) -> bool:  # the ranks' offsets in the group: what they learned
        return sum(max(0, o) for o in (await committed_offsets(settings, group, tps)).values()) == records

    async def deltas() -> int:
        return len(await read_topic(settings, settings.topics.param_deltas, timeout_s=1.0))

    half = await produce_examples(settings, ml_examples[:N // 2])
    ranks = _spawn(settings, tmp_path, log, snapshot_s="1800", idle_s="600", env={"DRIFTLINE_TRAINER__GROUP_ID": group})
    try:
        await _until("the ranks learned the first half", lambda: committed(half), logs)
        await asyncio.sleep(1.5)  # (their sync of it)

        s = settings.updated(trainer=dict(group_id=group, batch_size=256, sync_interval_s=0.5,
                                          snapshot_interval_event_s=3600))
        s = s.model_copy(update={"var_dir": tmp_path / "another-machine"})
        newcomer = OnlineTrainer(s, deepfm_config(dim=8, mlp=[32]))
        running = asyncio.create_task(newcomer.run())

        async def both_see_it() -> bool:
            return newcomer.claim is not None and newcomer.claim.state == SHARED and \
                f"group '{group}.claim.{settings.topics.examples}' holds partitions" in logs()
        await _until("the newcomer and the ranks see the examples claimed twice", both_see_it, logs)
        published = await deltas()
        rest = await produce_examples(settings, ml_examples[N // 2:])
        await asyncio.sleep(5.0)
        assert await committed(half), "the ranks went on learning beside another trainer"
        assert newcomer.examples_applied == 0

        newcomer.stop_event.set()  # (its clean stop publishes nothing either)
        result = await asyncio.wait_for(running, 60)
        assert result["examples_applied"] == 0, result
        assert await deltas() == published

        await _until("the ranks, alone again, learned the rest", lambda: committed(half + rest), logs)
        ranks.send_signal(signal.SIGTERM)
        assert ranks.wait(timeout=60) == 0, logs()[-4000:]
    finally:
        if ranks.poll() is None:
            ranks.kill()
    res = _results(log)
    assert sorted(res) == [0, 1], logs()[-3000:]
    assert sum(r["examples_applied"] for r in res.values()) == N and sum(r["duplicates"] for r in res.values()) == 0
    assert await deltas() > published


async def test_a_set_of_ranks_beside_a_one_process_trainer_publishes_nothing(settings, ml_examples, tmp_path) -> None:
    """The other way round: the ranks are the newcomer. They learn nothing and publish nothing (not
    their untrained dense weights at the start, not at their clean stop); the first trainer pauses
    while they exist and then learns the rest."""
    group = f"driftline-trainer-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "ranks.log"
    logs = lambda: log.read_text()  # noqa: E731 - read when a wait fails

    async def deltas() -> int:
        return len(await read_topic(settings, settings.topics.param_deltas, timeout_s=1.0))

    await produce_examples(settings, ml_examples[:N // 2])
    s = settings.updated(trainer=dict(group_id=group, batch_size=256, sync_interval_s=0.5, snapshot_interval_event_s=3600))
    first = OnlineTrainer(s, deepfm_config(dim=8, mlp=[32]))
    running = asyncio.create_task(first.run())

    async def learned(n: int) -> bool:
        return first.examples_applied == n
    await _until("the first trainer learned the first half", lambda: learned(N // 2), lambda: "")
    await asyncio.sleep(1.5)  # (its sync of it)

    var = tmp_path / "another-machine"
    ranks = _spawn(settings.model_copy(update={"var_dir": var}), tmp_path, log, snapshot_s="1800", idle_s="600",
                   env={"DRIFTLINE_TRAINER__GROUP_ID": group})
    try:
        async def both_see_it() -> bool:
            return first.claim is not None and first.claim.state == SHARED and \
                f"group '{group}.claim.{settings.topics.examples}' holds partitions" in logs()
        await _until("the first trainer and the ranks see the examples claimed twice", both_see_it, logs)
        published = await deltas()
        await produce_examples(settings, ml_examples[N // 2:])
        await asyncio.sleep(5.0)
        assert first.examples_applied == N // 2
        ranks.send_signal(signal.SIGTERM)
        assert ranks.wait(timeout=60) == 0, logs()[-4000:]
    finally:
        if ranks.poll() is None:
            ranks.kill()
    res = _results(log)
    assert sorted(res) == [0, 1] and sum(r["examples_applied"] for r in res.values()) == 0, logs()[-3000:]
    assert await deltas() == published

    await _until("the first trainer, alone again, learned the rest", lambda: learned(N), lambda: "")
    first.stop_event.set()
    result = await asyncio.wait_for(running, 60)
    assert result["examples_applied"] == N and result["duplicates"] == 0, result
    assert await deltas() > published
