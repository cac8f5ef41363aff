"""A coroutine that runs for the app's lifetime, started and cancelled by the lifespan."""

from __future__ import annotations

import asyncio
import contextlib


class BackgroundLoop:
    """Subclasses implement ``_run`` and name ``task_name``; ``stop`` never raises."""

    task_name = "background"
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
