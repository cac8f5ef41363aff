"""Every aiokafka (0.14.0) bug driftline works around, here only, numbered like
:mod:`services.tansu_quirks`.

1. ``AIOKafkaConsumer.stop()`` raises ``CancelledError`` into its caller when the broker went
   away under a running consumer (a broker restart, a reset of the embedded one): the fetch
   task is backing off (``NodeNotReadyError``), ``stop()`` cancels it and awaits it, and its
   cancellation comes out of ``stop()`` (aio-libs/aiokafka#647, open). A service stopping at that
   moment would die of it instead of exiting cleanly. :func:`stop_consumer` stops the consumer
   and absorbs that one cancellation; a cancellation of the caller itself still propagates.
2. Every lz4 batch is compressed at level 9 (LZ4 HC, ``aiokafka.codec.lz4_encode``'s default),
   with no option for the level. For serving that is ~50-300 us of CPU per 3-6 KB feature log
   on the request's event loop, against ~7 us at level 1 for a 3.1x instead of 3.7x smaller
   batch. :func:`set_lz4_level` replaces the batch builders' reference to the encoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from aiokafka import AIOKafkaConsumer
from aiokafka.codec import lz4_encode

__all__ = ["set_lz4_level", "stop_consumer"]

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


def set_lz4_level(level: int) -> None:
    """Compress this process's lz4 producer batches at ``level`` (aiokafka's default: 9).

    aiokafka compresses every lz4 batch with ``aiokafka.codec.lz4_encode`` at its default level 9
    (LZ4 HC) and offers no option for it. For serving that is ~0.07 ms of CPU per ``/rank``'s
    feature log on the requests' event loop (0.2-0.3 ms for a 6 KB log alone), against ~0.01 ms
    at level 1, for a 3.1x instead of 3.7x smaller batch (``bench/profile_serving.py``). The frame is the same KIP-57 lz4 frame at every
    level, so every consumer decodes it as before; only the batch builders' reference to the
    encoder is replaced (the C one, and the pure-Python one aiokafka falls back to).

    >>> set_lz4_level(1)
    >>> from aiokafka.record._crecords import default_records
    >>> default_records.lz4_encode(bytes(1000)) == lz4_encode(bytes(1000), 1)
    True
    """
    import aiokafka.record.default_records as python_records

    encode = functools.partial(lz4_encode, level=level)
    modules = [python_records]
    with contextlib.suppress(ImportError):  # aiokafka without its C extension
        from aiokafka.record._crecords import default_records as c_records
        modules.append(c_records)
    for module in modules:
        if hasattr(module, "lz4_encode"):
            module.lz4_encode = encode
