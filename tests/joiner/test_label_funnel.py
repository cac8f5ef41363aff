"""Several action types, and a model that learns the later one (clicks, then purchases): with
``positive_emit = "immediate"`` an impression is emitted when the learned label joins it
(``joiner.immediate_label``, which a project sets to its ``[model] label``), not at the first
action of any type, which would give every clicked-then-bought impression ``purchase = 0``.
In the pure core, then the Faust worker on the real broker; the project's wiring at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from driftline.project import load_project
from joiner.core import JoinCore
from joiner.stores.memory import MemoryStore
from joiner.tiered import TieredState
from proto import Action, Candidate, FeatureLog
from services.kafka import create_topics
from services.settings import JoinerSettings, Settings
from tests.joiner.helpers import emitted_examples, join_config, produce, read_examples, run_until_consumed

T0 = 1_000_000_000_000
FUNNEL = {"click": "click", "purchase": "purchase"}


class Stream:
    """One partition of the pure core; what each step emitted."""

    def __init__(self, **joiner: object) -> None:
        self.cfg = join_config({"negative_sample_rate": 1.0, "label_map": FUNNEL, **joiner})
        self.core = JoinCore(TieredState(MemoryStore(), 1_000_000), self.cfg)
        self.core.load(0)

    def features(self, rid: str, t_s: float) -> list:
        fl = FeatureLog(request_id=rid, event_time_ms=T0 + int(t_s * 1000), user_id=1,
                        candidates=[Candidate(item_id=1), Candidate(item_id=2)])
        self.core.on_features(0, fl)
        return self._step()

    def action(self, rid: str, kind: str, t_s: float) -> list:
        self.core.on_action(0, Action(request_id=rid, item_id=1, action_type=kind,
                                      event_time_ms=T0 + int(t_s * 1000)))
        return self._step()

    def close(self) -> list:
        self.core.advance(0, drain=True)
        return emitted_examples(self.core.take(), self.cfg.labels)

    def _step(self) -> list:
        self.core.advance(0)
        return [(e.example_id, dict(e.labels), e.sample_rate)
                for e in emitted_examples(self.core.take(), self.cfg.labels)]


def test_a_purchase_after_the_click_is_in_the_example_emitted_at_the_purchase() -> None:
    s = Stream(immediate_label="purchase")
    assert s.features("r", 0) == []
    assert s.action("r", "click", 5) == [], "the click alone emits nothing yet"
    assert s.action("r", "purchase", 60) == [("r/1", {"click": 1.0, "purchase": 1.0}, 1.0)]
    assert [e.example_id for e in s.close()] == ["r/2"]  # the other candidate: a negative at close
    assert s.core.counts["extra_labels"] == 0


def test_a_click_without_purchase_is_emitted_at_its_windows_close_with_the_click() -> None:
    s = Stream(immediate_label="purchase")
    s.features("r", 0)
    s.action("r", "click", 5)
    # the action watermark (the 3rd newest time: joiner.watermark_outliers = 2) passes r's window
    late = [e for t in (3_000, 3_001, 3_002) for e in s.action("later", "click", t)]
    assert late == [("r/1", {"click": 1.0, "purchase": 0.0}, 1.0), ("r/2", {"click": 0.0, "purchase": 0.0}, 1.0)]


def test_a_purchase_that_came_before_its_features_is_emitted_with_them() -> None:
    s = Stream(immediate_label="purchase")
    assert s.action("r", "purchase", 30) == []
    assert s.features("r", 0) == [("r/1", {"click": 0.0, "purchase": 1.0}, 1.0)]


def test_without_it_the_first_action_emits_and_the_purchase_is_dropped() -> None:
    """What a purchase model got before: every clicked-then-bought impression as not bought."""
    s = Stream()  # immediate_label None: any label's join emits
    s.features("r", 0)
    assert s.action("r", "click", 5) == [("r/1", {"click": 1.0, "purchase": 0.0}, 1.0)]
    assert s.action("r", "purchase", 60) == []
    assert s.core.counts["extra_labels"] == 1


async def test_the_worker_on_the_real_broker_emits_the_purchase_with_the_click(settings: Settings) -> None:
    """40 requests; every item 1 clicked, every other one then bought: the bought ones reach the
    examples topic with both labels (the windows stay open: nothing else is emitted yet)."""
    s = settings.updated(joiner={"label_map": FUNNEL, "immediate_label": "purchase", "window_seconds": 600})
    events: list[tuple[str, bytes, bytes]] = []
    for n in range(40):
        rid, t = f"r{n}", T0 + n * 1000
        fl = FeatureLog(request_id=rid, event_time_ms=t, user_id=n,
                        candidates=[Candidate(item_id=1), Candidate(item_id=2)])
        events.append(("features", rid.encode(), fl.SerializeToString()))
        kinds = ("click", "purchase") if n % 2 else ("click",)
        for i, kind in enumerate(kinds):
            a = Action(request_id=rid, item_id=1, action_type=kind, event_time_ms=t + 5_000 + i * 30_000)
            events.append(("actions", rid.encode(), a.SerializeToString()))
    await create_topics(settings)
    await produce(settings, events)
    counts = await run_until_consumed(s)
    got = {e.example_id: dict(e.labels) for e in await read_examples(settings)}
    assert got == {f"r{n}/1": {"click": 1.0, "purchase": 1.0} for n in range(1, 40, 2)}, counts
    assert not counts.get("extra_labels"), counts


def test_the_immediate_label_must_be_a_label() -> None:
    with pytest.raises(ValidationError, match=r"immediate_label 'buy' \(a project file's \[model\] label\) is no label_map value"):
        JoinerSettings(label_map=FUNNEL, immediate_label="buy")


def test_a_project_sets_it_to_the_label_its_model_learns(tmp_path: Path) -> None:
    path = tmp_path / "driftline.toml"
    path.write_text('name = "shop"\n[[features]]\nname = "item_id"\nsource = "candidate"\n'
                    '[labels]\nclick = "click"\npurchase = "purchase"\n[model]\nlabel = "purchase"\n')
    project = load_project(path)
    assert project.settings_overrides()["joiner"]["immediate_label"] == "purchase"
    assert project.resolved_settings().joiner.immediate_label == "purchase"
