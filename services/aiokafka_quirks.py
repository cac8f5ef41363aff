"""Every aiokafka (0.14.0) bug driftline works around, here only, numbered like
:mod:`services.tansu_quirks`.

1. ``AIOKafkaConsumer.stop()`` raises ``CancelledError`` into its caller when the broker went
   away under a running consumer (a broker restart, a reset of the embedded one): the fetch
   task is backing off (``NodeNotReadyError``), ``stop()`` cancels it and awaits it, and its
   cancellation comes out of ``stop()`` (aio-libs/aiokafka#647, open). A service stopping at that
   moment would die of it instead of exiting cleanly. :func:`stop_consumer` stops the consumer
   and absorbs that one cancellation; a cancellation of the caller itself still propagates.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer

__all__ = ["stop_consumer"]

log = logging.getLogger(__name__)


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """``consumer.stop()`` without quirk 1's stray ``CancelledError``."""
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller is being cancelled: not ours to swallow
        log.info("consumer stopped while its fetch was backing off from an unreachable broker")
