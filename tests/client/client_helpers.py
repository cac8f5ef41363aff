"""Helpers of the client tests: a served LR model of given features, a topic read back decoded."""

from __future__ import annotations

import time

from aiokafka import AIOKafkaConsumer

from ps import AdagradConfig, InitializerConfig, TableConfig
from services.codecs import codec_for
from services.kafka import start_client
from services.settings import Settings
from serving.model import TrainerModel
from trainer.config import ModelConfig


def served_model(slots: list[str], dense: list[str]) -> TrainerModel:
    table = TableConfig(name="w", dim=1, optimizer=AdagradConfig(lr=0.05), initializer=InitializerConfig(kind="zeros"))
    return TrainerModel(config=ModelConfig(model_id="client", kind="lr", linear={s: "w" for s in slots},
                                           tables=[table], mlp=[], dense_features=dense))


async def read_topic(settings: Settings, topic: str, message_type: type, count: int,
                     timeout: float = 20.0) -> list[tuple[bytes, int, object]]:
    """(key, partition, decoded message) of the first ``count`` records of ``topic``."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await start_client(consumer, settings)
    out: list[tuple[bytes, int, object]] = []
    try:
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                out += [(r.key, r.partition, codec_for(message_type).decode(r.value)) for r in records]
    finally:
        await consumer.stop()
    return out
