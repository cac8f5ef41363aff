"""A coroutine that runs for the app's lifetime, started and cancelled by the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.kafka import BrokerUnavailable

log = logging.getLogger(__name__)


class BackgroundLoop:
    """Subclasses implement ``_consume`` and name ``task_name``; ``stop`` never raises.

    ``_consume`` is restarted after ``retry_s`` whenever it ends or fails: serving keeps answering
    with what it has (current parameters, stored features) while the broker is away."""

    task_name = "background"
    retry_s: float = 2.0
    _task: asyncio.Task[None] | None = None

    async def _consume(self) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            try:
                await self._consume()
            except asyncio.CancelledError:
                raise
            except BrokerUnavailable as err:
                log.warning("%s: %s; retrying in %.1fs", self.task_name, err, self.retry_s)
            except Exception:  # noqa: BLE001 - a bad record or a bug must not stop serving
                log.exception("%s: consumer failed; restarting in %.1fs", self.task_name, self.retry_s)
            await asyncio.sleep(self.retry_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it to end, cancelling again if a cancellation was lost.

    Python 3.11's ``asyncio.wait_for`` drops a cancellation that arrives as the awaited call
    fails (it raises the call's error instead), and a retry loop that handles that error then
    runs on: one ``cancel()`` is not always enough.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.5)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
