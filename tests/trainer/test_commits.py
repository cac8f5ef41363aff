"""The committer's retry rules (trainer.commits), against a stand-in for the consumer's commit
(the broker's side is tests/trainer/distributed/test_claim_ranks.py's): a member's failed commit
stops the run after ``timeout_s``; a non-member's refused commits are retried in the background
with the departed members expelled, and a stop waits ``timeout_s`` at most for them."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import CommitFailedError
from prometheus_client import REGISTRY

from trainer import commits
from trainer.commits import Committer


class _Consumer:
    """Refuses the first ``refusals`` commits (None: all), then records them."""

    group_id = "g"

    def __init__(self, refusals: int | None):
        self.refusals, self.tries, self.committed = refusals, 0, []

    async def commit(self, offsets) -> None:
        self.tries += 1
        if self.refusals is None or self.tries <= self.refusals:
            raise CommitFailedError("the group has a member")
        self.committed.append({tp.partition: o for tp, o in offsets.items()})


async def _no_reset() -> bool:
    return False


def _committer(consumer: _Consumer, offsets: dict, member: bool, expelled: list) -> Committer:
    async def expel() -> None:
        expelled.append(True)
    return Committer(consumer, "examples", lambda: offsets, _no_reset, 0.2, lambda *_: None, member=member,
                     expel=None if member else expel)


def _refused() -> float | None:
    return REGISTRY.get_sample_value("driftline_trainer_offset_commits_refused")


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch) -> None:
    monkeypatch.setattr(commits, "REFUSED_RETRY_S", 0.02)


async def test_a_non_members_refused_commits_are_retried_with_the_newest_offsets_and_departed_members_expelled() -> None:
    consumer, offsets, expelled = _Consumer(refusals=20), {0: 5}, []
    c = _committer(consumer, offsets, member=False, expelled=expelled)
    c.request()
    await asyncio.sleep(0.1)
    assert _refused() == 1 and consumer.committed == []
    offsets[0] = 9  # (learned meanwhile: the retries take the newest)
    c.request()  # (one commit in flight: this one only asks again)
    for _ in range(200):
        if consumer.committed:
            break
        await asyncio.sleep(0.02)
    assert consumer.committed[0] == {0: 9} and _refused() == 0
    await c.flush()
    assert expelled == [True]  # refused for longer than timeout_s: expelled once (then EXPEL_EVERY_S apart)


async def test_a_stop_gives_up_a_commit_the_group_keeps_refusing(caplog) -> None:
    consumer, expelled = _Consumer(refusals=None), []
    c = _committer(consumer, {0: 5}, member=False, expelled=expelled)
    c.request()
    await asyncio.wait_for(c.flush(), 5)  # (not for ever)
    assert consumer.committed == [] and "stopping with the offsets of examples not committed" in caplog.text


async def test_a_members_failed_commit_stops_the_run_after_its_timeout() -> None:
    consumer = _Consumer(refusals=None)
    c = _committer(consumer, {0: 5}, member=True, expelled=[])
    c.request()
    with pytest.raises(CommitFailedError):
        await asyncio.wait_for(c.flush(), 5)
