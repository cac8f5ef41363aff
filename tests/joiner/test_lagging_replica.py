"""One serving replica's feature logs reach the joiner minutes behind the others' (its spool ships
late: it was cut off from the broker, restarted, or starved), while its users' clicks reach
``actions`` on time. In the pure core (no broker): every click is joined while the feature log
can still be joined, and none is ever turned into a negative example."""

from __future__ import annotations

import pytest

from joiner.core import JoinCore
from joiner.stores.memory import MemoryStore
from joiner.tiered import TieredState
from proto import Action, Candidate, FeatureLog
from tests.joiner.helpers import emitted_examples, join_config

T0 = 1_000_000_000_000
REQUESTS = 720  # one every 10 s for two hours, every other one served by the lagging replica


def _join(lag_s: int, **joiner: object) -> tuple[dict[str, float], dict[str, int]]:
    """Every request's item 1 clicked 20 s after it; the lagging replica's feature logs arrive
    ``lag_s`` of event time late. The click label emitted per clicked example id, and the counts."""
    cfg = join_config({"negative_sample_rate": 1.0, **joiner})
    core = JoinCore(TieredState(MemoryStore(), 1_000_000), cfg)
    core.load(0)
    events = []
    for n in range(REQUESTS):
        t = T0 + n * 10_000
        fl = FeatureLog(request_id=f"r{n}", event_time_ms=t, user_id=n % 7,
                        candidates=[Candidate(item_id=1), Candidate(item_id=2)])
        events.append((t + (lag_s * 1000 if n % 2 else 0), 0, fl))
        click = Action(request_id=f"r{n}", item_id=1, action_type="click", event_time_ms=t + 20_000)
        events.append((t + 20_000, 1, click))
    for _, kind, message in sorted(events, key=lambda e: (e[0], e[1])):
        (core.on_features if kind == 0 else core.on_action)(0, message)
        core.advance(0)
    core.advance(0, drain=True)
    clicked = {e.example_id: e.labels["click"] for e in emitted_examples(core.take(), cfg.labels)
               if e.example_id.endswith("/1")}
    return clicked, dict(core.counts)


@pytest.mark.parametrize("lag_s", [0, 400, 1_000, 1_800])
def test_a_lagging_replicas_clicks_are_joined_while_its_feature_logs_can_be(lag_s: int) -> None:
    clicked, counts = _join(lag_s)  # the defaults: refused past 900 + 5 + 900 s
    assert len(clicked) == REQUESTS and set(clicked.values()) == {1.0}, counts
    assert counts.get("orphan_actions", 0) == 0 and counts.get("expired_impressions", 0) == 0


def test_past_the_refusal_distance_its_impressions_are_refused_never_mislabelled() -> None:
    clicked, counts = _join(2_000)
    assert set(clicked.values()) == {1.0}, "no clicked impression emitted as a negative"
    assert counts["expired_impressions"] > 0 and counts["orphan_actions"] > 0
    # (the other replica's requests, and the lagging one's first ones, are all joined)
    assert len(clicked) == REQUESTS - counts["expired_impressions"] // 2


def test_a_grace_shorter_than_the_refusal_distance_mislabels_the_lagging_clicks() -> None:
    """Why the grace defaults to the refusal distance: with the old 300 s, every clicked
    impression of a replica 400 s late came out a negative."""
    clicked, counts = _join(400, orphan_grace_seconds=300)
    wrong = sum(1 for label in clicked.values() if label == 0.0)
    assert wrong > REQUESTS // 3 and counts["orphan_actions"] == wrong
