"""The online trainer's offset commits to its consumer group, in the background.

A batch's offsets are committed after the batch is applied, in batch order: the trainer asks for a
commit after each batch (:meth:`Committer.request`) and one commit is in flight at a time, each
taking the newest applied offsets. The broker round trip stays off the path that hands the next
batch to the training thread: awaited there, it left the thread idle between steps.

The committed offsets only matter without a snapshot (a restart seeks to its snapshot's offsets,
which the committed ones are ahead of). Offsets read from a broker whose data was reset are never
committed into the new broker's group: every commit first asks whether a reset happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError


class Committer:
    """Commits ``offsets()`` (``{partition: next offset}`` of ``topic``) through ``consumer``;
    ``reset_noticed()``: whether the broker's data was reset (then nothing more is committed);
    ``stage(name, seconds)`` accounts the time."""

    def __init__(self, consumer, topic: str, offsets: Callable[[], dict[int, int]],
                 reset_noticed: Callable[[], Awaitable[bool]], timeout_s: float,
                 stage: Callable[[str, float], None]):
        self.consumer, self.topic, self._offsets = consumer, topic, offsets
        self._reset_noticed, self.timeout_s, self._stage = reset_noticed, timeout_s, stage
        self._task: asyncio.Task | None = None
        self._wanted = False

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
                    await self.consumer.commit({TopicPartition(self.topic, q): o for q, o in self._offsets().items()})
                    break
                except KafkaError:
                    # the group is gone with the broker's data (a reset), or rejoining (after one, or
                    # a rebalance): the member keeps its partitions, so the next try commits
                    if await self._reset_noticed():
                        return
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.5)
            self._stage("commit", time.perf_counter() - t0)

    async def flush(self) -> None:
        """Wait until every requested commit is done (raises a failed commit)."""
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
