"""The Faust joiner on the real broker: the offline reference's examples, takeover after kill -9."""

from __future__ import annotations

import time

from joiner.faust_app import run
from joiner.reference import offline_join
from joiner.synth import ml_events
from proto import FeatureLog
from services.kafka import create_topics
from services.settings import Settings
from tests.joiner.helpers import JOINER, as_map, join_config, produce, read_examples, ref_as_map

CFG = join_config()


async def test_e2e_matches_offline_reference(settings: Settings) -> None:
    events = ml_events(3000, start=20_000, seed=5)
    await create_topics(settings)
    await produce(settings, events)
    started = time.perf_counter()
    counts = await run(settings.updated(joiner=JOINER), until_idle_s=1.0)
    elapsed = time.perf_counter() - started
    examples = await read_examples(settings)
    expected = ref_as_map(offline_join(events, CFG, settings.topics.partitions))
    assert len(examples) == len(expected), "no duplicates without a crash"
    assert as_map(examples) == expected
    n_imp = sum(len(FeatureLog.FromString(v).candidates) for k, _, v in events if k == "features")
    assert counts["impressions"] == n_imp
    print(f"e2e: {counts['impressions'] / elapsed:.0f} impressions/s including start-up and drain")
