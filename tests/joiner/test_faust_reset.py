"""The Faust joiner after a broker reset (tansu memory storage restarted): no crash loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from joiner.faust_app import run
from joiner.reference import offline_join
from joiner.synth import ml_events
from services.kafka import create_topics
from services.settings import Settings
from tests.conftest import KilledBroker, killed_broker
from tests.joiner.helpers import JOINER, as_map, join_config, produce, read_examples, ref_as_map
from tests.joiner.test_faust_joiner import _run_until_consumed


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledBroker]:
    yield from killed_broker(tmp_path_factory, "faust-reset-broker")


async def test_a_broker_reset_discards_the_local_state_instead_of_crash_looping(
        settings: Settings, broker: KilledBroker) -> None:
    """The state lived in the broker (its changelog): after a reset the worker starts from the
    new topics with an empty state, where Faust alone would refuse the stale local store forever
    (ConsistencyError: the persisted offset is ahead of the empty changelog)."""
    s = settings.updated(joiner=JOINER)
    await create_topics(settings)
    await produce(settings, ml_events(500, start=10_000, seed=3))
    await _run_until_consumed(s)
    broker.restart()
    events = ml_events(500, start=50_000, seed=4)
    await create_topics(settings)
    await produce(settings, events)
    counts = await run(s, until_idle_s=1.0)
    assert counts["impressions"] > 0
    assert as_map(await read_examples(settings)) == ref_as_map(offline_join(events, join_config(),
                                                                            settings.topics.partitions))
