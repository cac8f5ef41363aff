"""Real-time user features: a consumer of ``actions`` that records each user's recent clicks."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from proto import Action
from serving import metrics
from serving.background import BackgroundLoop
from serving.feature_store import FeatureStore, FeatureStoreError
from services.kafka import TypedConsumer
from services.settings import Settings

log = logging.getLogger(__name__)


class RecentClicks(BackgroundLoop):
    """Consume actions (one consumer group for all replicas: Redis is shared) into the store."""

    task_name = "recent-clicks"

    def __init__(self, settings: Settings, store: FeatureStore, click_actions: tuple[str, ...],
                 group_id: str = "serving-realtime", retry_s: float = 2.0) -> None:
        self.settings = settings
        self.store = store
        self.click_actions = set(click_actions)
        self.group_id = group_id
        self.retry_s = retry_s
        self.recorded = 0
        self._task: asyncio.Task[None] | None = None

    async def _consume(self) -> None:
        consumer: TypedConsumer[Action] = TypedConsumer(
            self.settings, "serving", Action, [self.settings.topics.actions], self.group_id,
            auto_offset_reset="latest",
        )
        try:
            await consumer.start()
            async for batch in consumer.batches(max_records=2_000, timeout_ms=200):
                clicks = [(r.value.user_id, r.value.item_id) for r in batch
                          if r.value.user_id and r.value.action_type in self.click_actions]
                while True:
                    try:
                        await self.store.record_clicks(clicks)
                        break
                    except FeatureStoreError as err:
                        log.warning("%s; retrying", err)
                        await asyncio.sleep(self.retry_s)
                self.recorded += len(clicks)
                metrics.REALTIME_UPDATES.inc(len(clicks))
                await consumer.commit()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(consumer.stop())
