"""Real-time user features: a consumer of ``actions`` that records each user's recent clicks.

One consumer group for all replicas (Redis is shared), committing after each batch is in Redis:
at least once, so a batch read again after a crash, or an action a client sent twice, is handed to
the store again, which records each action once (:meth:`FeatureStore.record_clicks`).
A group without committed offsets starts at the end of the topic (old clicks are not "recent"),
except after a broker reset: the reset took the group's offsets with it, and every action on the
new topic is new, so the reader then starts at the new topic's beginning. A reset is seen live
(:class:`serving.broker_epoch.SharedEpoch`, checked before every commit, so no offset of the new
topic is committed by a reader that has not noticed) and across restarts: the epoch whose actions
were last recorded is kept in Redis beside the clicks. Actions that were on the old topic and not
read yet are lost with it, counted in ``driftline_broker_reset_lost_total{service="serving"}``.

A click that decodes but cannot be recorded (Redis refuses it, e.g. the user's key holds another
type) is written to ``dead-letters`` with the reason and skipped: one record never stops the
reader. Redis down, or refusing every write for now (full at its ``maxmemory`` under
``noeviction``, turned into a replica, unable to persist), is no record's fault: the reader waits
and records the clicks once it takes writes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from proto import Action
from services import metrics as shared_metrics
from services.codecs import processing_failed
from services.kafka import Record, TypedConsumer
from services.settings import Settings
from services.unanswered_commits import UnansweredCommits
from serving import metrics
from serving.background import BackgroundLoop, raise_if_cancelled
from serving.broker_epoch import SharedEpoch
from serving.feature_store import Click, FeatureStore, FeatureStoreError, click_tag
from serving.redis_state import refuses_all_writes

log = logging.getLogger(__name__)
T = TypeVar("T")

_EPOCH_MARKER = "realtime-epoch"


class RecentClicks(BackgroundLoop):
    """Consume actions (one consumer group for all replicas: Redis is shared) into the store."""

    task_name = "recent-clicks"

    def __init__(self, settings: Settings, store: FeatureStore, click_actions: tuple[str, ...],
                 group_id: str = "serving-realtime", retry_s: float = 2.0, service: str = "serving",
                 epochs: SharedEpoch | None = None) -> None:
        self.settings = settings
        self.store = store
        self.click_actions = set(click_actions)
        self.group_id = group_id
        self.retry_s = retry_s
        self.service = service
        self.epochs = epochs if epochs is not None else SharedEpoch(settings, service)
        self._own_epochs = epochs is None
        self.recorded = 0
        self.failed = 0
        #: a broker reset was seen: a partition without committed offsets starts at the beginning
        self.from_beginning = False
        self._lag: dict[int, int] = {}
        self.commits = UnansweredCommits(service, settings.kafka.connect_timeout_s)
        self._task: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        await super().stop()
        if self._own_epochs:
            await self.epochs.stop()

    async def _consume(self) -> None:
        epoch = await self.epochs.current(0)
        marker = await self._marker()
        if epoch is not None and marker is not None and marker != epoch and not self.from_beginning:
            log.warning("recent clicks: the broker was reset since actions were last recorded (epoch "
                        "%s, now %s): reading the new actions topic from its start", marker, epoch)
            self.from_beginning = True
        consumer: TypedConsumer[Action] = TypedConsumer(
            self.settings, self.service, Action, [self.settings.topics.actions], self.group_id,
            auto_offset_reset="earliest" if self.from_beginning else "latest",
        )
        try:
            await consumer.start()
            while True:
                batch = await consumer.poll(timeout_ms=200, max_records=2_000)
                self._note_lag(consumer, batch)
                # Before a commit always (an offset of the new topic committed by a reader that has
                # not noticed the reset would skip actions), else at most once a second.
                current = await self.epochs.current(0 if batch else 1.0)
                if epoch is None:
                    epoch = current
                elif current is not None and current != epoch:
                    self._reset(epoch, current)
                    return  # reconnect: the new consumer starts at the new topic's beginning
                if not batch:
                    continue
                letters = await self._record(consumer, batch)
                if letters:
                    await asyncio.gather(*letters)
                # (bounded: one the broker never answers would stop the reader for ever)
                if not await self.commits.commit(consumer.commit):
                    continue  # the clicks are recorded; a later commit carries these offsets
                if epoch is not None and marker != epoch and await self._set_marker(epoch):
                    marker = epoch
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(consumer.stop())

    def _reset(self, old: str, new: str) -> None:
        lost = sum(self._lag.values())
        if lost:
            shared_metrics.BROKER_RESET_LOST.labels(self.service, self.settings.topics.actions).inc(lost)
        log.warning("recent clicks: the broker's data was reset (epoch %s -> %s; %d actions not yet "
                    "read are lost with it): reading the new actions topic from its start", old, new, lost)
        self._lag.clear()
        self.from_beginning = True

    def _note_lag(self, consumer: TypedConsumer[Action], records: list[Record[Action]]) -> None:
        self._lag.update(consumer.lag_after(records))

    async def _record(self, consumer: TypedConsumer[Action], batch: list[Record[Action]]) -> list[asyncio.Future]:
        """Record the batch's clicks; return the dead letters of the records that failed (to await
        before committing). Redis being down is retried until it is back, never dead-lettered."""
        clicked = [r for r in batch if r.value.action_type in self.click_actions]
        owners = [r for r in clicked if r.value.user_id]
        if len(owners) < len(clicked):
            metrics.REALTIME_WITHOUT_USER.inc(len(clicked) - len(owners))
        clicks = [Click(a.user_id, a.item_id, click_tag(a.request_id, a.item_id, a.action_type))
                  for a in (r.value for r in owners)]
        try:
            refused = await self._with_retry(clicks)
        except MemoryError:
            raise  # the process's, not the clicks': the loop reconnects and reads them again
        except Exception as err:  # noqa: BLE001 - retried click by click below
            log.warning("recent clicks: a batch failed (%r); recording its clicks one by one", err)
            refused = []
            for i, click in enumerate(clicks):
                try:
                    refused += [(i, e) for _, e in await self._with_retry([click])]
                except MemoryError:
                    raise
                except Exception as one:  # noqa: BLE001 - this click is dead-lettered with its error
                    refused.append((i, one))
        letters = []
        for i, err in refused:
            self.failed += 1
            r = owners[i]
            letters.append(await consumer.dead_letter(dataclasses.replace(r, value=r.raw), processing_failed(err)))
        self._count(len(clicks) - len(refused))
        return letters

    async def _with_retry(self, clicks: list[Click]) -> list[tuple[int, Exception]]:
        """Record ``clicks``; the ones Redis refused for their own sake, as (index, error). Redis
        down, or taking no writes for now (full, a replica: :func:`refuses_all_writes`), is
        waited out: those clicks are recorded once it takes writes again."""
        todo = list(range(len(clicks)))
        refused: list[tuple[int, Exception]] = []
        while todo:
            answered = await self._until_stored(functools.partial(self.store.record_clicks, [clicks[i] for i in todo]))
            refused += [(todo[i], err) for i, err in answered if not refuses_all_writes(err)]
            waiting = [(todo[i], err) for i, err in answered if refuses_all_writes(err)]
            if waiting:
                metrics.REALTIME_WAITS.inc()
                log.warning("recent clicks: Redis takes no writes for now (%s); %d clicks wait for it",
                            waiting[0][1], len(waiting))
                raise_if_cancelled()
                await asyncio.sleep(self.retry_s)
            todo = [i for i, _ in waiting]
        return sorted(refused, key=lambda r: r[0])

    async def _until_stored(self, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()`` until the store answers (Redis down is waited out, never an error)."""
        while True:
            try:
                return await call()
            except FeatureStoreError as err:
                log.warning("%s; retrying", err)
                raise_if_cancelled()
                await asyncio.sleep(self.retry_s)

    def _count(self, n: int) -> None:
        self.recorded += n
        metrics.REALTIME_UPDATES.inc(n)

    async def _marker(self) -> str | None:
        return await self._until_stored(lambda: self.store.get_marker(_EPOCH_MARKER))

    async def _set_marker(self, epoch: str) -> bool:
        try:
            await self.store.set_marker(_EPOCH_MARKER, epoch)
            return True
        except FeatureStoreError:
            return False  # written after the next commit
