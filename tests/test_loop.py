"""The whole loop under ``driftline up`` (:class:`tests.loopstack.LoopStack`); the ``loop_stack``
fixture shares one running stack between the tests of a session (the files in
``tests/conftest.py``'s ``LOOP_STACK_FILES`` import it; they run one after the other, and the
stack stops after the last of them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.loopstack import LoopStack, alive, descendants

_SHARED: dict[str, LoopStack] = {}
# Enough traffic for the loop to close (examples of both labels, a few syncs) and every
# service's metrics to be live, small enough for a test.
LOOP_ARGS = ("--replay-limit", "40000", "--speed", "0")


@pytest.fixture(scope="session")
def loop_stack(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Iterator[LoopStack]:
    """One ``driftline up`` per session, shared by every module that imports this fixture."""
    if "stack" not in _SHARED:
        _SHARED["stack"] = LoopStack.start(tmp_path_factory.mktemp("loop"), repo_root, *LOOP_ARGS)
    yield _SHARED["stack"]
    stop_shared_stack()


def stop_shared_stack() -> None:
    """Stop the shared stack (if it runs) and check it stopped cleanly, as tests/test_stack.py
    checks for ``make up``. ``tests/conftest.py`` calls it after the last test that uses it."""
    stack = _SHARED.pop("stack", None)
    if stack is not None:
        family = descendants(stack.proc.pid)
        code = stack.stop()
        assert code == 0 and "driftline stopped." in stack.text(), stack.text()[-3000:]
        time.sleep(0.3)
        assert not [pid for pid in family if alive(pid)], "processes left behind"


def _trainer_auc(stack: LoopStack) -> float | None:
    return stack.metric("trainer", "driftline_trainer_auc", {"mode": "online"})


@pytest.mark.timeout(420)
def test_the_loop_closes_through_serving(loop_stack: LoopStack) -> None:
    """Traffic goes through serving, examples join, the online AUC beats chance, versions tick."""
    s = loop_stack
    assert "ranking API docs" in s.text() and "status page" in s.text() and "logs" in s.text()
    ready = s.wait_for("serving ready", lambda: s.get(s.serving_url + "/readyz")[0] == 200, 60)
    assert ready
    s.wait_for("/rank traffic", lambda: (s.metric("serving", "driftline_serving_requests_total",
                                                  {"endpoint": "/rank", "status": "200"}) or 0) > 100, 120)
    s.wait_for("/actions traffic", lambda: (s.metric("serving", "driftline_serving_actions_produced_total") or 0) > 50, 60)
    s.wait_for("examples joined", lambda: (s.metric("joiner", "driftline_joiner_examples_produced_total") or 0) > 200, 120)
    time.sleep(3)  # the trainer has had examples to choke on, if it does
    s.wait_for("negatives emitted", lambda: (s.metric("joiner", "driftline_joiner_negatives_total",
                                                      {"outcome": "emitted"}) or 0) > 0, 120)
    auc = s.wait_for("online AUC > 0.5", lambda: (a := _trainer_auc(s)) is not None and a > 0.5 and a, 120)
    assert 0.5 < auc <= 1.0
    version = s.wait_for("served sparse version > 0",
                         lambda: s.json("/readyz")["model_version"]["sparse_version"], 90)
    assert version > 0
    assert s.metric("trainer", "driftline_trainer_bad_examples_total") in (None, 0.0), s.logs_tail()


@pytest.mark.timeout(300)
def test_feature_logs_come_from_serving_with_data_event_time(loop_stack: LoopStack) -> None:
    """The FeatureLogs on the topic are serving's (its request ids, its model), stamped with the
    data's event time; the actions carry the request ids serving returned."""
    from proto import Action, FeatureLog
    from services.kafka import TypedConsumer

    settings = loop_stack.settings()

    async def read(topic: str, message: type, n: int, drain: bool = False) -> list:
        """At least ``n`` records; with ``drain``, everything on the topic so far."""
        got: list = []
        empty = 0
        async with TypedConsumer(settings, "t", message, [topic], f"t-{topic}-{time.monotonic_ns()}") as c:
            for _ in range(400):
                batch = await c.poll(timeout_ms=500)
                got += batch
                empty = 0 if batch else empty + 1
                if len(got) >= n and (not drain or empty >= 2):
                    break
        return [r.value for r in got]

    # The first actions, then every FeatureLog so far: each click's request was served (and
    # spooled) before it and its log shipped since, so its id is among them, whatever partitions
    # the reads started on. (Logs first, then actions raced the shipper: a click read after the
    # drain could name a request whose log was still in the spool.)
    actions = asyncio.run(read(settings.topics.actions, Action, 200))
    logs = asyncio.run(read(settings.topics.features, FeatureLog, 200, drain=True))
    assert len(logs) >= 200 and len(actions) >= 200, (len(logs), len(actions))
    models = {f.model_version.model_id for f in logs}
    assert models == {"deepfm"}, models  # serving's model, not "replay"
    ids = [f.request_id for f in logs if len(f.request_id) != 32]
    assert not ids, ids[:5]  # serving's uuid4().hex, not the replay's u<user>-t<ms>
    logged = {f.request_id for f in logs}
    referring = sum(a.request_id in logged for a in actions)
    assert referring >= 0.9 * len(actions), f"{referring}/{len(actions)} clicks refer to a request id serving logged"
    year_2000, year_2004 = 946_684_800_000, 1_072_915_200_000
    data_time = all(year_2000 <= f.event_time_ms < year_2004 for f in logs)
    stats = loop_stack.log_dir / "replay.log"
    assert data_time, f"FeatureLog event time is not the data's\n{stats.read_text()[-2000:]}"
    assert all(year_2000 <= a.event_time_ms < year_2004 for a in actions), [a.event_time_ms for a in actions[:5]]
