"""A full disk pauses the dumper's input instead of failing its writes; freeing space resumes it.

The dumper's Parquet directory lives on a 32 MB tmpfs of its own (``small_disk``, tests/conftest.py), filled to below ``disk.pause_below_bytes``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import REGISTRY

from joiner import dumper
from proto import Example
from services.kafka import create_topics
from services.settings import Settings
from tests.conftest import fill_disk
from tests.joiner.helpers import produce
from tests.joiner.test_dumper import batches


def _paused() -> float | None:
    return REGISTRY.get_sample_value("driftline_disk_paused", {"service": dumper.SERVICE})


async def test_a_full_disk_pauses_the_dumper_until_space_is_freed(settings: Settings, small_disk: Path) -> None:
    await create_topics(settings)
    joined = [Example(example_id=f"d/{i}", request_id="d", item_id=i, user_id=1, event_time_ms=1_700_000_000_000 + i,
                      sample_rate=1.0) for i in range(300)]
    await produce(settings, batches(settings.topics.examples, joined, 50))
    s = settings
    fill = fill_disk(small_disk, 4 << 20)  # 16 MB pause threshold, 4 MB left
    out = small_disk / "examples"
    stop = asyncio.Event()
    run = asyncio.create_task(dumper.run(s.updated(dumper=dict(flush_rows=10, flush_interval_s=0.5),
                                                   disk=dict(pause_below_bytes=16 << 20, check_s=0.2)),
                                         out_dir=out, stop=stop))
    try:
        deadline = time.monotonic() + 30
        while _paused() != 1.0:
            assert time.monotonic() < deadline and not run.done(), "the dumper did not pause"
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)
        assert not list(out.glob("dt=*/hour=*/part-*.parquet")), "written while the disk was full"
        fill.unlink()
        deadline = time.monotonic() + 30
        while (table := dumper.read_examples(out) if out.exists() else None) is None or table.num_rows < len(joined):
            assert time.monotonic() < deadline and not run.done(), "the dumper did not resume"
            await asyncio.sleep(0.2)
        assert _paused() == 0.0 and table.num_rows == len(joined)
        assert REGISTRY.get_sample_value("driftline_disk_free_bytes", {"service": dumper.SERVICE}) > 16 << 20
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
