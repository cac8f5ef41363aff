"""The real producer path end to end: `driftline replay` traffic through the joiner on the broker
equals the offline reference join of the same messages."""

from __future__ import annotations

from joiner.faust_app import run
from producers.replay import replay, replay_events
from services.settings import Settings
from tests.joiner.helpers import as_map, join_config, read_examples, ref_as_map
from tests.joiner.reference import offline_join

JOINER = {"window_seconds": 600, "seed": 3}
CFG = join_config(JOINER)


async def test_replayed_ml1m_slice_joins_to_the_offline_reference(settings: Settings) -> None:
    stats = await replay(settings, "ml-1m", speed=0, limit=4000, progress=False)
    kinds = {settings.topics.features: "features", settings.topics.actions: "actions"}
    events = [(kinds[topic], key, value) for topic, key, value in replay_events(settings, "ml-1m", limit=4000)]
    assert len(events) == stats["messages"]
    counts = await run(settings.updated(joiner=JOINER), until_idle_s=1.0)
    assert counts["impressions"] == 4000
    expected = ref_as_map(offline_join(events, CFG, settings.topics.partitions))
    examples = await read_examples(settings)
    assert as_map(examples) == expected
    positives = sum(1 for labels, rate, _ in expected.values() if rate == 1.0)
    assert positives > 1000 and len(expected) > positives  # both positives and sampled negatives
