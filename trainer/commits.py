"""The online trainer's offset commits to its consumer group, in the background.

A batch's offsets are committed after the batch is applied, in batch order: the trainer asks for a
commit after each batch (:meth:`Committer.request`) and one commit is in flight at a time, each
taking the newest applied offsets. The broker round trip stays off the path that hands the next
batch to the training thread: awaited there, it left the thread idle between steps.

The committed offsets only matter without a snapshot (a restart seeks to its snapshot's offsets,
which the committed ones are ahead of). Offsets read from a broker whose data was reset are never
committed into the new broker's group: every commit first asks whether a reset happened.

**A consumer that is no member** (the ranks read by manual assignment) commits with no generation,
which the broker accepts only while the group has no member. A member there (another team's
consumer with the trainer's group id, a debugging session, or a one-process trainer killed -9 that
the broker still lists: tansu quirk 10) makes every commit fail, for as long as it stays. That is
not this trainer's failure and retrying soon does not help: the commits are retried in the
background every :data:`REFUSED_RETRY_S` while training goes on (the snapshots hold the offsets),
said once and shown (``driftline_trainer_offset_commits_refused``); now and then (``expel``, rank
0's) the departed members are expelled by a join (quirk 10's workaround), and a clean stop waits at
most ``timeout_s`` for the last commit.

**A commit that does not come back**: aiokafka retries a commit for ever while the broker answers
with a retriable error, and it does when the examples topic was deleted under the trainer
(UnknownTopicOrPartition: tansu quirk 11). Each try is bounded by ``timeout_s``; one that timed out
is retried in the background as a refused one is, shown the same way, so neither training nor a
clean stop waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from .metrics import COMMITS_REFUSED

log = logging.getLogger(__name__)

REFUSED_RETRY_S = 2.0  # between tries of a commit the group refuses (a consumer that is no member)
EXPEL_EVERY_S = 30.0  # between two expulsions of departed members while refused (each a rebalance)


class Committer:
    """Commits ``offsets()`` (``{partition: next offset}`` of ``topic``) through ``consumer``;
    ``reset_noticed()``: whether the broker's data was reset (then nothing more is committed);
    ``stage(name, seconds)`` accounts the time."""

    def __init__(self, consumer, topic: str, offsets: Callable[[], dict[int, int]],
                 reset_noticed: Callable[[], Awaitable[bool]], timeout_s: float,
                 stage: Callable[[str, float], None], *, member: bool = True,
                 expel: Callable[[], Awaitable[object]] | None = None):
        """``member``: whether ``consumer`` is a member of its group (False: manually assigned);
        ``expel``: for a consumer that is none, what expels the group's departed members."""
        self.consumer, self.topic, self._offsets = consumer, topic, offsets
        self._reset_noticed, self.timeout_s, self._stage = reset_noticed, timeout_s, stage
        self.member, self._expel = member, expel
        self._task: asyncio.Task | None = None
        self._wanted = False
        self.refused_since: float | None = None  # (monotonic) the group refuses this non-member's commits
        self._expelled_at: float | None = None
        self._stopping_at: float | None = None  # (monotonic) the clean stop's flush began
        COMMITS_REFUSED.set(0)

    def request(self) -> None:
        """Commit the applied offsets in the background, one commit in flight at a time (the next
        one takes the newest offsets)."""
        self._wanted = True
        if self._task is None or self._task.done():
            self.raise_failed()
            self._task = asyncio.create_task(self._commit())

    def raise_failed(self) -> None:
        """Raise the error of a commit that failed (a rebalance): it stops the run."""
        if self._task is not None and self._task.done():
            self._task.result()

    async def _commit(self) -> None:
        while self._wanted:
            self._wanted = False
            # offsets read from a broker whose data is gone must not land in the new data's group
            if await self._reset_noticed():
                return
            t0 = time.perf_counter()
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    commit = self.consumer.commit({TopicPartition(self.topic, q): o for q, o in self._offsets().items()})
                    await asyncio.wait_for(commit, self.timeout_s)
                    break
                except (KafkaError, TimeoutError) as err:
                    # the group is gone with the broker's data (a reset), or rejoining (after one, or
                    # a rebalance): the member keeps its partitions, so the next try commits
                    if await self._reset_noticed():
                        return
                    if isinstance(err, TimeoutError) or (not self.member and isinstance(err, CommitFailedError)):
                        if await self._refused(timed_out=isinstance(err, TimeoutError)):
                            return
                        continue
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.5)
            self._accepted()
            self._stage("commit", time.perf_counter() - t0)

    async def _refused(self, timed_out: bool = False) -> bool:
        """The group refused a commit of this non-member (or a commit ``timed_out``): said once,
        waited out a while, the departed members expelled now and then. Whether to give the commit
        up (a stop waited ``timeout_s`` for it)."""
        now = time.monotonic()
        why = "the broker does not answer them: it is unreachable, or the topic was deleted under the trainer " \
            "(tansu quirk 11)" if timed_out else \
            f"the broker refuses them: group {self.consumer.group_id!r} has a member (a consumer that is no trainer, " \
            "or one gone without leaving)"
        if self.refused_since is None:
            self.refused_since = now
            COMMITS_REFUSED.set(1)
            log.warning("the offset commits of %s are not taken, %s; training goes on, the snapshots hold the "
                        "offsets, and the commits are retried", self.topic, why)
        if self._stopping_at is not None and now - self._stopping_at >= self.timeout_s:
            log.error("stopping with the offsets of %s not committed (%s); the last snapshot holds them", self.topic, why)
            return True
        if not timed_out and self._expel is not None and self._stopping_at is None and \
                now - self.refused_since >= self.timeout_s and \
                (self._expelled_at is None or now - self._expelled_at >= EXPEL_EVERY_S):
            self._expelled_at = now
            try:
                await self._expel()
            except KafkaError as err:
                log.warning("expelling the departed members of group %r failed: %r", self.consumer.group_id, err)
        await asyncio.sleep(REFUSED_RETRY_S)
        return False

    def _accepted(self) -> None:
        if self.refused_since is not None:
            log.warning("the broker accepts the offset commits of %s again (refused for %.0f s)", self.topic,
                        time.monotonic() - self.refused_since)
            self.refused_since, self._expelled_at = None, None
            COMMITS_REFUSED.set(0)

    async def flush(self) -> None:
        """Wait until every requested commit is done (raises a failed commit; one the group refuses
        is given up after ``timeout_s``)."""
        self._stopping_at = time.monotonic()
        if self._task is not None:  # it loops while commits were requested meanwhile
            await self._task

    async def drop(self) -> None:
        """After a broker reset: end a commit of the old offsets (waiting for the lost group)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, KafkaError):
                pass
            self._task = None

    def cancel(self) -> None:
        """Stopping mid-run: commit nothing more."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
