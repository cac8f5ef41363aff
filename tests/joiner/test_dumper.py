"""The dumper: examples topic (with the joiner's at-least-once duplicates) -> hourly Parquet,
each example exactly once, flat columns; a flush that crashed before committing is redone."""

from __future__ import annotations

import pyarrow.compute as pc

from joiner import dumper
from joiner.app import run as run_joiner
from joiner.synth import ml_events
from joiner.types import JoinConfig
from services.kafka import create_topics
from services.settings import Settings
from tests.joiner.helpers import produce, read_examples, read_topic

CFG = JoinConfig(window_ms=120_000, negative_sample_rate=0.3)


async def test_dumper_writes_each_example_once_by_event_hour(settings: Settings) -> None:
    await create_topics(settings)
    await produce(settings, ml_events(800, start=60_000, seed=9))
    await run_joiner(settings, until_idle_s=0.5, config=CFG)
    raw = await read_topic(settings, settings.topics.examples)
    # Duplicates as a crashed joiner would leave them: exact copies, later in the topic.
    await produce(settings, [(settings.topics.examples, b"dup", v) for v in raw[:300]])
    root = settings.var_dir / "examples"
    totals = await dumper.run(settings, until_idle_s=1.0, flush_rows=1000)
    assert totals["duplicates"] == 300 and totals["examples"] == len(raw)
    table = dumper.read_examples(root)
    assert table.num_rows == len(raw)
    assert pc.count_distinct(table["example_id"]).as_py() == len(raw)
    expected = {e.example_id: e for e in await read_examples(settings)}
    for row in table.select(["example_id", "label_click", "sample_rate", "event_time_ms", "sparse_item", "dense_pop",
                             "sparse_user", "dt", "hour"]).to_pylist()[:200]:
        e = expected[row["example_id"]]
        assert row["label_click"] == e.labels["click"] and abs(row["sample_rate"] - e.sample_rate) < 1e-6
        assert row["sparse_item"] == list(e.features.sparse["item"].ids)
        assert row["sparse_user"] == [e.user_id]
        assert str(dumper.hour_dir(root, e.event_time_ms)).endswith(f"dt={row['dt']}/hour={row['hour']:02d}")
    # A flush that wrote files but crashed before committing: its files go, its rows come back once.
    before = sorted(p.name for p in root.glob("dt=*/hour=*/part-*.parquet"))
    ghost = root / "dt=2000-01-01" / "hour=00" / "part-9999999999-0000.parquet"
    ghost.parent.mkdir(parents=True)
    ghost.write_bytes(b"partial")
    await produce(settings, [(settings.topics.examples, b"dup", v) for v in raw[:10]])
    totals = await dumper.run(settings, until_idle_s=1.0)
    assert totals["duplicates"] == 10 and totals["examples"] == 0 and not ghost.exists()
    assert sorted(p.name for p in root.glob("dt=*/hour=*/part-*.parquet")) == before


def test_flatten_empty() -> None:
    assert dumper.flatten([], ["click"]).num_rows == 0
