"""A record that decodes fine and fails later is dead-lettered (kind ``failed``) and skipped, on
the real broker; the joiner and the dumper go on with the records after it, and never crash-loop."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from joiner import dumper
from joiner.core import JoinCore
from joiner.faust_app import run as run_joiner
from proto import Action, Candidate, DeadLetter, Example, FeatureLog
from services import example_batch
from services.kafka import create_topics
from services.settings import Settings
from tests.joiner.helpers import JOINER, as_map, join_config, produce, read_examples, read_topic, ref_as_map
from tests.joiner.reference import offline_join
from tests.joiner.synth import ml_events
from tests.joiner.test_dumper import batches

CFG = join_config()
BOOM = "boom"


def _failed(service: str, topic: str) -> float:
    return REGISTRY.get_sample_value("driftline_dead_letters_total",
                                     {"service": service, "topic": topic, "kind": "failed"}) or 0.0


@pytest.mark.parametrize("kind", ["features", "actions"])
async def test_joiner_dead_letters_a_record_the_join_fails_on(settings: Settings, monkeypatch, kind: str) -> None:
    """A fake stands in for a bug in our own join logic: on the poison record it moves the
    partition's watermarks far ahead (as a half-done update would) and then raises. The join of
    the rest must be the reference join without that record: the half-done update rolled back,
    the records before it in the same batch committed, the ones after it joined."""
    real = JoinCore.on_features if kind == "features" else JoinCore.on_action

    def poisoned(self: JoinCore, p: int, m: object, ts_ms: int = 0) -> None:
        if m.request_id == BOOM:  # type: ignore[attr-defined]
            for i in range(5):
                self.wmf[p].observe(2**62 + i)
                self.wma[p].observe(2**62 + i)
            self.wf[p] = self.wa[p] = 2**62
            raise KeyError("a bug in the join")
        real(self, p, m, ts_ms)

    monkeypatch.setattr(JoinCore, "on_features" if kind == "features" else "on_action", poisoned)
    events = ml_events(1500, start=70_000, seed=8)
    if kind == "features":
        poison = FeatureLog(request_id=BOOM, event_time_ms=1_000, user_id=1,
                            candidates=[Candidate(item_id=1)]).SerializeToString()
    else:
        poison = Action(request_id=BOOM, item_id=1, action_type="click", event_time_ms=1_000).SerializeToString()
    at = len(events) // 3
    await create_topics(settings)
    await produce(settings, events[:at] + [(kind, BOOM.encode(), poison)] + events[at:])
    before = _failed("joiner", getattr(settings.topics, kind))
    counts = await run_joiner(settings.updated(joiner=JOINER), until_idle_s=0.5)
    assert counts["failed_records"] == 1
    assert _failed("joiner", getattr(settings.topics, kind)) - before == 1
    assert as_map(await read_examples(settings)) == ref_as_map(offline_join(events, CFG, settings.topics.partitions))
    letters = [DeadLetter.FromString(v) for v in await read_topic(settings, settings.topics.dead_letters)]
    assert [(d.value, d.consumer, d.reason) for d in letters] == [
        (poison, "joiner", "failed: KeyError: 'a bug in the join'")]
    # Committed past it: a restart does not meet it again.
    counts = await run_joiner(settings.updated(joiner=JOINER), until_idle_s=0.5)
    assert counts.get("failed_records", 0) == 0


async def test_dumper_dead_letters_an_example_it_cannot_file(settings: Settings) -> None:
    """event_time_ms = 2**63 - 1 passes validation but has no calendar hour (``hour_dir``
    raised ValueError on every restart): dead-lettered (a batch of just it), and the examples of
    its batch and after it written."""
    await create_topics(settings)
    poison = Example(example_id="p/1", request_id="p", item_id=1, user_id=1, event_time_ms=2**63 - 1,
                     sample_rate=1.0, labels={"click": 1.0})
    example_batch.decode(example_batch.encode(example_batch.from_examples([poison])))  # passes validation
    t0 = 1_700_000_000_000
    good = [Example(example_id=f"g/{i}", request_id="g", item_id=i, user_id=1, event_time_ms=t0 + i,
                    sample_rate=1.0, labels={"click": 0.0}) for i in range(20)]
    topic = settings.topics.examples
    await produce(settings, batches(topic, good[:10] + [poison] + good[10:], 7))  # poison in a batch of good ones
    before = _failed("joiner-dumper", topic)
    root = settings.var_dir / "examples"
    totals = await dumper.run(settings.updated(dumper=dict(flush_rows=5)), until_idle_s=1.0)
    assert totals["failed"] == 1 and totals["examples"] == 20
    assert _failed("joiner-dumper", topic) - before == 1
    assert sorted(dumper.read_examples(root)["example_id"].to_pylist()) == sorted(e.example_id for e in good)
    letters = [DeadLetter.FromString(v) for v in await read_topic(settings, settings.topics.dead_letters)]
    assert len(letters) == 1 and example_batch.to_examples(example_batch.decode(letters[0].value)) == [poison]
    assert letters[0].reason.startswith("failed: ") and letters[0].consumer == "joiner-dumper"
    # The restart does not meet it again.
    totals = await dumper.run(settings, until_idle_s=0.5)
    assert totals["failed"] == 0 and totals["examples"] == 0
