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
            except Exception:
                log.exception("%s: consumer failed; restarting in %.1fs", self.task_name, self.retry_s)
            raise_if_cancelled()
            await asyncio.sleep(self.retry_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the running task was asked to stop, also when the cancellation
    itself was lost: Python 3.11's ``asyncio.wait_for`` raises the awaited call's error instead of
    the cancellation when both arrive together, and a retry loop that handles the error would
    otherwise run on. Retry loops call this before they sleep."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(task: asyncio.Task[None], nudge_s: float = 5.0) -> None:
    """Cancel ``task`` and wait for it to end (its clean-up included), cancelling again every
    ``nudge_s`` in case a cancellation was lost where no retry loop checks for it."""
    task.cancel()
    while not (await asyncio.wait([task], timeout=nudge_s))[0]:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
