"""A one-process trainer and a set of ranks with the same group, each started beside the other
(by hand, on another machine: its own directory). The ranks read by manual assignment, so their
group shows no member, and only the trainers' claim group (trainer.claim) tells. Both wait and
publish nothing while both exist (a newcomer not even its untrained weights); when one leaves, the
other learns the rest, every example once. And another Kafka client in the ranks' group."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

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


async def _deltas(settings) -> int:
    return len(await read_topic(settings, settings.topics.param_deltas, timeout_s=1.0))


class _Ranks:
    """Two ranks of ``group`` (not stopped by idleness) writing their log into ``tmp_path``."""

    def __init__(self, settings, tmp_path: Path, group: str):
        self.settings, self.group, self.log = settings, group, tmp_path / "ranks.log"
        self.p = _spawn(settings, tmp_path, self.log, snapshot_s="1800", idle_s="600",
                        env={"DRIFTLINE_TRAINER__GROUP_ID": group})

    def logs(self) -> str:
        return self.log.read_text()

    def committed(self, records: int) -> Callable[[], Awaitable[bool]]:
        """Whether the ranks' offsets in their group (what they learned) sum to ``records``."""
        tps = [TopicPartition(self.settings.topics.examples, p) for p in range(self.settings.topics.partitions)]

        async def ok() -> bool:
            return sum(max(0, o) for o in (await committed_offsets(self.settings, self.group, tps)).values()) == records
        return ok

    def claimed_twice(self, trainer: OnlineTrainer) -> Callable[[], Awaitable[bool]]:
        """Whether the one-process trainer and the ranks (their log) both see the examples claimed twice."""
        async def ok() -> bool:
            return trainer.claim is not None and trainer.claim.state == SHARED and \
                f"group '{self.group}.claim.{self.settings.topics.examples}' holds partitions" in self.logs()
        return ok

    def stopped(self) -> dict[int, dict]:
        """A clean stop (SIGTERM), and each rank's result line."""
        self.p.send_signal(signal.SIGTERM)
        assert self.p.wait(timeout=60) == 0, self.logs()[-4000:]
        res = _results(self.log)
        assert sorted(res) == [0, 1], self.logs()[-3000:]
        return res


@contextlib.contextmanager
def _ranks(settings, tmp_path: Path, group: str) -> Iterator[_Ranks]:
    ranks = _Ranks(settings, tmp_path, group)
    try:
        yield ranks
    finally:
        if ranks.p.poll() is None:
            ranks.p.kill()


def _trainer(settings, group: str) -> OnlineTrainer:
    s = settings.updated(trainer=dict(group_id=group, batch_size=256, sync_interval_s=0.5, snapshot_interval_event_s=3600))
    return OnlineTrainer(s, deepfm_config(dim=8, mlp=[32]))


async def test_running_ranks_beside_another_client_and_then_a_one_process_trainer(settings, ml_examples,
                                                                                  tmp_path) -> None:
    """Ranks running; first **another Kafka client** (a consumer that is no trainer: a debugging
    session's console consumer, another team's job) subscribes to the examples in their group and
    is killed -9. It takes nothing from the ranks (they read by manual assignment), but while the
    group lists a member the broker refuses their commits (they commit with no generation), and
    tansu lists one killed -9 until the group's next rebalance (tansu quirk 10): the ranks go on
    learning (their snapshots hold their offsets), say so, expel it and commit again; nothing
    stops or restarts. Then **a one-process trainer with the same group** starts beside them (by
    hand, on another machine: its own directory): both wait and publish nothing while both exist;
    when it leaves, the ranks learn the rest, every example once."""
    group = f"driftline-trainer-{uuid.uuid4().hex[:8]}"
    third = N // 3
    first = await produce_examples(settings, ml_examples[:third])
    with _ranks(settings, tmp_path, group) as ranks:
        await _until("the ranks learned the first third", ranks.committed(first), ranks.logs)
        other = subprocess.Popen([sys.executable, "-c", OTHER_CONSUMER, settings.bootstrap_servers, group,
                                  settings.topics.examples], stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout is not None and (await asyncio.to_thread(other.stdout.readline)).strip() == "assigned"
            second = first + await produce_examples(settings, ml_examples[third:2 * third])
            await _until("the ranks say their commits are refused",
                         _logged(ranks, "are not taken, the broker refuses them"), ranks.logs)
        finally:
            other.kill()  # (-9: it stays listed in the group)
            other.wait()
        await _until("the ranks expelled it and committed what they learned", ranks.committed(second), ranks.logs)
        # (the broker shows a commit before its rank has written that it was taken: wait for the line)
        await _until("the ranks say their commits are taken again",
                     _logged(ranks, "the broker accepts the offset commits of"), ranks.logs)
        await asyncio.sleep(1.5)  # (their sync of it)

        newcomer = _trainer(settings.model_copy(update={"var_dir": tmp_path / "another-machine"}), group)
        running = asyncio.create_task(newcomer.run())
        await _until("the newcomer and the ranks see the examples claimed twice", ranks.claimed_twice(newcomer),
                     ranks.logs)
        published = await _deltas(settings)
        every = second + await produce_examples(settings, ml_examples[2 * third:])
        await asyncio.sleep(3.0)
        assert await ranks.committed(second)(), "the ranks went on learning beside another trainer"
        assert newcomer.examples_applied == 0

        newcomer.stop_event.set()  # (its clean stop publishes nothing either)
        result = await asyncio.wait_for(running, 60)
        assert result["examples_applied"] == 0, result
        assert await _deltas(settings) == published

        await _until("the ranks, alone again, learned the rest", ranks.committed(every), ranks.logs)
        res = ranks.stopped()
    assert "exited with" not in ranks.logs(), ranks.logs()[-3000:]  # (the launcher restarted nothing)
    assert sum(r["examples_applied"] for r in res.values()) == N and sum(r["duplicates"] for r in res.values()) == 0
    assert await _deltas(settings) > published


async def test_a_set_of_ranks_beside_a_one_process_trainer_publishes_nothing(settings, ml_examples, tmp_path) -> None:
    """The other way round: the ranks are the newcomer. They learn and publish nothing (not their
    untrained dense weights at the start, not at their clean stop); the first trainer pauses while
    they exist and then learns the rest."""
    group = f"driftline-trainer-{uuid.uuid4().hex[:8]}"
    await produce_examples(settings, ml_examples[:N // 2])
    first = _trainer(settings, group)
    running = asyncio.create_task(first.run())

    def learned(n: int) -> Callable[[], Awaitable[bool]]:
        async def ok() -> bool:
            return first.examples_applied == n
        return ok
    await _until("the first trainer learned the first half", learned(N // 2), lambda: "")
    await asyncio.sleep(1.5)  # (its sync of it)

    with _ranks(settings.model_copy(update={"var_dir": tmp_path / "another-machine"}), tmp_path, group) as ranks:
        await _until("the first trainer and the ranks see the examples claimed twice", ranks.claimed_twice(first),
                     ranks.logs)
        published = await _deltas(settings)
        await produce_examples(settings, ml_examples[N // 2:])
        await asyncio.sleep(3.0)
        assert first.examples_applied == N // 2
        res = ranks.stopped()
    assert sum(r["examples_applied"] for r in res.values()) == 0, res
    assert await _deltas(settings) == published

    await _until("the first trainer, alone again, learned the rest", learned(N), lambda: "")
    first.stop_event.set()
    result = await asyncio.wait_for(running, 60)
    assert result["examples_applied"] == N and result["duplicates"] == 0, result
    assert await _deltas(settings) > published


def _logged(ranks: _Ranks, text: str) -> Callable[[], Awaitable[bool]]:
    async def ok() -> bool:
        return text in ranks.logs()
    return ok


# another client's consumer in the group: says "assigned" once it holds partitions, then reads on
OTHER_CONSUMER = """
import asyncio, sys
from aiokafka import AIOKafkaConsumer
async def main(bootstrap, group, topic):
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, session_timeout_ms=6000,
                         heartbeat_interval_ms=1000, enable_auto_commit=False)
    await c.start()
    said = False
    while True:
        await c.getmany(timeout_ms=200)
        if c.assignment() and not said:
            print("assigned", flush=True)
            said = True
asyncio.run(main(*sys.argv[1:]))
"""
