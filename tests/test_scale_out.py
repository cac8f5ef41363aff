"""Scale-out of the joiner by partitions (docs/scale-out.md): two workers, one topic.

Two ``python -m joiner`` processes, ``--partitions 0,1`` and ``--partitions 2,3``, each with its
own ``--store``, join one replayed ml-1m slice. Each worker consumes exactly its partitions (its
impressions are the features records on them), and together they emit exactly the examples one
joiner would: the offline reference join of the same messages.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka.partitioner import DefaultPartitioner

from joiner.reference import offline_join
from joiner.types import JoinConfig
from producers.replay import replay, replay_events
from proto import FeatureLog
from services.settings import Settings
from tests.joiner.helpers import as_map, read_examples, ref_as_map

LIMIT = 6000
WORKERS = {"a": [0, 1], "b": [2, 3]}


def _env(settings: Settings, repo_root: Path) -> dict[str, str]:
    t = settings.topics
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_")}
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers,
        DRIFTLINE_VAR_DIR=str(settings.var_dir),
        DRIFTLINE_DATA_DIR=str(repo_root / "var" / "data"),
        DRIFTLINE_TOPICS__FEATURES=t.features, DRIFTLINE_TOPICS__ACTIONS=t.actions,
        DRIFTLINE_TOPICS__EXAMPLES=t.examples, DRIFTLINE_TOPICS__PARAM_DELTAS=t.param_deltas,
        DRIFTLINE_TOPICS__DEAD_LETTERS=t.dead_letters,
        DRIFTLINE_METRICS_PORT="0",
    )
    return env


def _totals(output: str) -> dict[str, int]:
    m = re.search(r"joiner stopped: (\{.*\})", output)
    assert m, output[-3000:]
    return ast.literal_eval(m.group(1))


@pytest.mark.timeout(300)
def test_two_joiner_workers_split_partitions_and_match_one_joiner(settings: Settings, repo_root: Path,
                                                                    tmp_path: Path) -> None:
    settings.data_dir = repo_root / "var" / "data"
    assert settings.topics.partitions == 4
    stats = asyncio.run(replay(settings, "ml-1m", speed=0, limit=LIMIT, progress=False))
    kinds = {settings.topics.features: "features", settings.topics.actions: "actions"}
    events = [(kinds[topic], key, value) for topic, key, value in replay_events(settings, "ml-1m", limit=LIMIT)]
    assert len(events) == stats["messages"]

    env = _env(settings, repo_root)
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "joiner", "--partitions", ",".join(map(str, parts)),
             "--store", f"rocksdb://{tmp_path / f'joiner-{name}'}", "--until-idle", "2"],
            env=env, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name, parts in WORKERS.items()
    }
    outputs = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:]
        outputs[name] = out

    # Each worker consumed exactly the impressions on its own partitions.
    part = DefaultPartitioner()
    all_parts = list(range(settings.topics.partitions))
    per_partition = dict.fromkeys(all_parts, 0)
    for kind, key, value in events:
        if kind == "features":
            per_partition[part(key, all_parts, all_parts)] += len(FeatureLog.FromString(value).candidates)
    for name, parts in WORKERS.items():
        assert f"partitions {parts}" in outputs[name], outputs[name][-2000:]
        totals = _totals(outputs[name])
        assert totals["impressions"] == sum(per_partition[p] for p in parts) > 0, (name, totals, per_partition)
    assert sum(_totals(o)["impressions"] for o in outputs.values()) == LIMIT

    # Together: exactly the single joiner's examples (the offline reference join of the same data).
    cfg = JoinConfig.from_settings(settings.joiner)
    expected = ref_as_map(offline_join(events, cfg, settings.topics.partitions))
    got = as_map(asyncio.run(read_examples(settings)))
    assert got == expected
    positives = sum(1 for _labels, rate, _ in expected.values() if rate == 1.0)
    assert positives > 1000 and len(expected) > positives  # positives and sampled negatives
    assert {Path(tmp_path / f"joiner-{n}").exists() for n in WORKERS} == {True}  # separate state stores
