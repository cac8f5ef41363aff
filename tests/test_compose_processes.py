"""``docker compose up`` as real processes (no Docker engine here): every driftline service of
``docker-compose.yml`` runs its own command with its own environment (:mod:`tests.composestack`:
only addresses, ports and volume paths are this machine's) on an embedded broker and Redis. Then
what a user would look at: examples on the ``examples`` topic, the trainer's online AUC, ``/rank``
and its served version on both replicas, every Prometheus scrape target and every metric the
Grafana dashboards query; host clients on the broker's and serving's published ports; and a
``docker compose stop`` + ``up`` on the same volume: the trainer goes on from what it learned.

Kafka and Redis keep running across the restart: ``docker compose up -d --build`` after an upgrade
recreates exactly the driftline containers (their image changed) and leaves Kafka's and Redis's
running, the restart users do most. A stopped and restarted Kafka container keeps its log in the
container, which the embedded broker (memory storage) cannot keep; a broker that lost everything
is tests/trainer's and tests/test_stack.py's case.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.composestack import ComposeProcesses, get, metric, samples
from tests.loopstack import poll_until
from tests.test_dashboards import dashboard_expressions, metric_names

# Environment on top of compose's own, each a setting the services already read: every command is
# compose's, unchanged. (None needed so far: the demo's own pace fits the test.)
OVERRIDES: dict[str, str] = {}

# Dashboard metrics a healthy run has no sample of: each counts a failure only when it happens
# (a labelled counter has no series before its first event). Each must still be declared.
FAILURE_COUNTERS = {
    "driftline_joiner_late_actions_total", "driftline_joiner_duplicate_actions_total",
    "driftline_joiner_input_gaps_total", "driftline_joiner_input_offsets_unread_total",
    "driftline_trainer_bad_examples_total", "driftline_trainer_duplicate_examples_total", "driftline_dead_letters_total",
    "driftline_serving_feature_log_refused_total", "driftline_serving_feature_store_errors_total",
    "driftline_serving_deltas_skipped_total", "driftline_serving_feature_loads_total",
}
# ... and of features the demo leaves off: the device cache (trainer.cache_rows), the N-rank mode
# switches (trainer.nproc > 1, dist_mode auto) and model.meta's tasks. Each must still be declared.
OFF_BY_DEFAULT = {
    "driftline_trainer_cache_rows_total", "driftline_trainer_dist_mode_switches_total",
    "driftline_trainer_meta_tasks_total", "driftline_trainer_meta_outer_steps_total",
    "driftline_trainer_place_click_ratio",  # a model with a position feature
}

ONE_SHOTS_TIMEOUT_S = 300.0
_T0 = time.monotonic()
TIMINGS: dict[str, float] = {}


def _mark(what: str) -> None:
    TIMINGS[what] = round(time.monotonic() - _T0, 1)
    print(f"[compose {TIMINGS[what]:6.1f} s] {what}", flush=True)


def wait_for(stack: ComposeProcesses, what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    """Poll ``check`` until truthy; fail with the services' logs (and any that exited)."""
    got = poll_until(what, check, timeout_s, lambda: f"exited: {stack.exited()}\n{stack.logs_tail()}")
    _mark(what)
    return got


def long_running(stack: ComposeProcesses) -> list[str]:
    return [n for n, s in stack.services.items() if s.get("restart") != "no"]


def up(stack: ComposeProcesses) -> None:
    stack.up()
    _mark(f"up #{stack.starts}: every service started")
    for name, spec in stack.services.items():
        if spec.get("restart") == "no" and name != "traffic":  # the traffic runs the whole replay
            code = stack.wait_completed(name, ONE_SHOTS_TIMEOUT_S)
            assert code == 0, stack.log_tail(name)
    _mark(f"up #{stack.starts}: one-shot jobs done")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Iterator[ComposeProcesses]:
    s = ComposeProcesses.create(repo_root, tmp_path_factory.mktemp("compose"), OVERRIDES)
    # The image's data dir is on the volume: there, the dataset cache the tests share (fetched
    # once for all of them: a fresh clone has none yet if this file runs first)
    from movielens.data import fetch

    shared = Path(os.environ["DRIFTLINE_DATA_DIR"]).resolve()
    fetch("ml-1m", shared, progress=False)
    data = Path(s.localize("topics", s.image.env["DRIFTLINE_DATA_DIR"]))
    data.parent.mkdir(parents=True, exist_ok=True)
    data.symlink_to(shared)
    _mark("start")
    s.start_infra()
    try:
        up(s)
        yield s
    finally:
        s.close()
        _mark("closed")
        print(json.dumps({"timings_s": TIMINGS, "ports": {f"{n}:{c}": h for (n, c), h in s.ports.items()}}))


def _serving_ports(stack: ComposeProcesses) -> list[tuple[str, int]]:
    return [(n, c) for (n, c) in stack.ports if stack.services[n]["command"][0] == "serve" and c != 9100]


def _readyz(stack: ComposeProcesses, name: str, port: int) -> dict | None:
    status, body = get(stack.url(name, port, "/readyz"))
    return json.loads(body) if status == 200 else None


def _examples_on_topic(stack: ComposeProcesses) -> int:
    from aiokafka.structs import TopicPartition

    from services import tansu_quirks
    from services.settings import Settings

    settings = Settings(kafka_bootstrap_servers=f"127.0.0.1:{stack.broker_port}")

    async def count() -> int:
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers)
        await c.start()
        try:
            await c.topics()
            tps = [TopicPartition(settings.topics.examples, p)
                   for p in sorted(c.partitions_for_topic(settings.topics.examples) or [])]
        finally:
            await c.stop()
        return sum((await tansu_quirks.log_end_offsets(settings, tps)).values())

    return asyncio.run(count())


def _rank(url: str, key: str | None) -> tuple[int, dict]:
    """POST /rank as the README's curl does: with compose's API key (serving binds 0.0.0.0)."""
    body = json.dumps({"user_id": 42, "candidates": [{"item_id": 1193}, {"item_id": 661}, {"item_id": 914}]})
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/rank", data=body.encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {"detail": err.read().decode()}


def _trainer_auc(stack: ComposeProcesses) -> float | None:
    return metric(stack.url("trainer", 9100, "/metrics"), "driftline_trainer_auc", {"mode": "online"})


def _examples_trained(stack: ComposeProcesses) -> float:
    """Examples the running trainer process trained on (its own counter: 0 after a restart)."""
    return metric(stack.url("trainer", 9100, "/metrics"), "driftline_trainer_examples_total", {"mode": "online"}) or 0.0


def _snapshot(stack: ComposeProcesses) -> dict:
    """The manifest of the trainer's newest snapshot on the volume."""
    from trainer.snapshots import read_manifest

    (latest,) = (stack.tmp / "volumes").glob("*/snapshots/*/LATEST")
    manifest = read_manifest(latest.parent)
    assert manifest is not None
    return manifest


@pytest.mark.timeout(600)
def test_what_a_user_looks_at(stack: ComposeProcesses, repo_root: Path) -> None:
    assert not stack.exited().keys() & set(long_running(stack)), stack.logs_tail()
    wait_for(stack, "examples on the examples topic", lambda: _examples_on_topic(stack) > 0, 240)
    auc = wait_for(stack, "online AUC > 0.5", lambda: (a := _trainer_auc(stack)) is not None and a > 0.5 and a, 240)
    assert 0.5 < auc <= 1.0
    servings = _serving_ports(stack)
    assert len(servings) == 2, servings  # serving-0 and serving-1
    first = {}
    for name, port in servings:
        ready = wait_for(stack, f"{name} ready", lambda n=name, p=port: _readyz(stack, n, p), 120)
        first[name] = ready["model_version"]["sparse_version"]
        status, answer = _rank(stack.url(name, port), stack.api_key(name))
        assert status == 200, (name, status, answer)
        assert [c["item_id"] for c in answer["items"]] and answer["model_version"]["model_id"], answer
    for name, port in servings:
        wait_for(stack, f"{name}'s served sparse version moves past {first[name]}",
                 lambda n=name, p=port: (r := _readyz(stack, n, p)) and r["model_version"]["sparse_version"] > first[n], 120)

    # Prometheus: every scrape target of deploy/prometheus/prometheus.yml answers /metrics
    config = yaml.safe_load((repo_root / "deploy" / "prometheus" / "prometheus.yml").read_text())
    bodies = {}
    for job in config["scrape_configs"]:
        path = job.get("metrics_path", "/metrics")
        for target in (t for sc in job["static_configs"] for t in sc["targets"]):
            host, port = target.rsplit(":", 1)
            assert (host, int(port)) in stack.ports, f"{job['job_name']}: {target} is no port a service binds"
            status, body = get(stack.url(host, int(port), path))
            assert status == 200, f"{job['job_name']}: {target} -> HTTP {status}"
            bodies[target] = body
    _mark("every Prometheus target answers")

    # Grafana: every metric a dashboard queries has a series on some target (a panel shows data),
    # admissions counted (the project file turns admission on)
    def missing() -> dict[str, list[str]]:
        for target in bodies:
            host, port = target.rsplit(":", 1)
            bodies[target] = get(stack.url(host, int(port), "/metrics"))[1]
        have = {n for b in bodies.values() for n, _, _ in samples(b)}
        declared = {line.split()[2] for b in bodies.values() for line in b.splitlines() if line.startswith("# TYPE ")}
        out: dict[str, list[str]] = {}
        for dashboard, exprs in dashboard_expressions(repo_root).items():
            for expr in exprs:
                for name in metric_names(expr):
                    family = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                    quiet = name in FAILURE_COUNTERS or name in OFF_BY_DEFAULT
                    ok = (family in declared or name in declared) if quiet else name in have
                    if not ok:
                        out.setdefault(name, []).append(f"{dashboard}: {expr}")
        return out

    deadline = time.monotonic() + 120
    while (gaps := missing()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not gaps, "queried by a dashboard, no series on any target:\n" + json.dumps(gaps, indent=1)
    _mark("every dashboard metric has data")
    admitted = sum(v for b in bodies.values() for n, _, v in samples(b) if n == "driftline_ps_admitted_total")
    assert admitted > 0, "no admissions: the admission panel is empty"
    assert not stack.exited().keys() & set(long_running(stack)), stack.exited()


@pytest.mark.timeout(300)
def test_host_clients_on_the_published_ports(stack: ComposeProcesses, repo_root: Path) -> None:
    """A client on the host, configured as the compose file tells it (Kafka's EXTERNAL listener,
    localhost:<published port>; serving's published port): the documented Kafka producers' click
    becomes an example the services join, and `driftline traffic` replays through serving."""
    import subprocess
    import sys

    from driftline.client import ActionProducer, FeatureLogProducer
    from driftline.project import load_project
    from services.settings import Settings
    from tests.joiner.helpers import read_examples

    kafka = stack.compose["services"]["kafka"]
    external = [a for a in kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",") if a.startswith("EXTERNAL://")]
    assert external == ["EXTERNAL://localhost:9092"], kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert "9092:9092" in kafka["ports"]
    # the published port is the broker's here: localhost:<port> as a host client would set it
    project = load_project(repo_root / "examples" / "movielens" / "driftline.toml")
    settings = Settings(**{**project.settings_overrides(), "kafka_bootstrap_servers": f"localhost:{stack.broker_port}"})
    # The replay runs at 600x: a second of wall time is ten minutes of event time, past the
    # joiner's window before a host click could join. `docker compose pause traffic` (SIGSTOP, as
    # its freezer does) holds the stream still; the click is stamped at the joiners' frontier.
    traffic = stack.containers["traffic"].proc
    assert traffic is not None and traffic.poll() is None

    def frontier() -> float | None:
        return max([v for j in ("joiner-0", "joiner-1") for n, lab, v in samples(get(stack.url(j, 9100, "/metrics"))[1])
                    if n == "driftline_joiner_watermark_ms" and lab["stream"] == "features"], default=None)

    # (under load the traffic can be this test's to start: the joiners export a watermark once they joined some)
    wait_for(stack, "the joiners' features watermarks", frontier, 120)
    traffic.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3)  # the joiners read what the traffic sent before the pause
        newest = frontier()
        assert newest is not None
        rid = f"host-client-{time.time_ns()}"

        async def produce() -> None:
            async with FeatureLogProducer(project.features, settings) as logs, ActionProducer(settings=settings) as acts:
                await logs.send(rid, [{"item_id": 1193}, {"item_id": 661}], user_id=42, event_time_ms=int(newest) + 1000)
                await acts.send(rid, 1193, "click", user_id=42, event_time_ms=int(newest) + 2000)

        asyncio.run(produce())
        joined = wait_for(stack, "the host producer's click joined into an example", lambda: [
            e for e in asyncio.run(read_examples(settings)) if e.request_id == rid and e.labels.get("click") == 1.0], 120)
    finally:
        traffic.send_signal(signal.SIGCONT)
    assert [e.item_id for e in joined] == [1193], joined

    # `driftline traffic` from the host, at serving-0's published port (the replay's first
    # ratings again: data times behind the stream's, which move no watermark)
    (port_spec,) = stack.services["serving-0"]["ports"]
    container = int(str(port_spec).split(":")[-1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIFTLINE_", "KAFKA_", "REDIS_"))}
    env["DRIFTLINE_DATA_DIR"] = os.environ["DRIFTLINE_DATA_DIR"]
    env["DRIFTLINE_SERVING__API_KEYS"] = stack.environment("serving-0")["DRIFTLINE_SERVING__API_KEYS"]  # (README)
    done = subprocess.run(
        [sys.executable, "-m", "driftline.cli", "traffic", "--dataset", "ml-1m", "--start-rating", "95019",
         "--limit", "30", "--speed", "0", "--url", f"http://localhost:{stack.host_port('serving-0', container)}",
         "--no-progress", "--metrics-port", "0", "--no-join-report"],  # (the compose traffic's actions join meanwhile)
        env=env, cwd=repo_root, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["requests"] > 0 and stats["rank_errors"] == 0, stats
    _mark("host clients")


@pytest.mark.timeout(300)
def test_redis_killed_keeps_its_features_and_flushed_gets_them_back(stack: ComposeProcesses) -> None:
    """kill -9 of Redis and its restart: compose's flags (an append-only file on its volume) bring
    the features back as they were, no load needed; FLUSHALL: the ``features`` service loads them
    again; killed with its file then damaged in the middle: its start script cuts the file (Redis
    alone would not start) and what the cut lost is loaded again. After each, both replicas know
    the user and call the store whole."""
    import redis

    servings = _serving_ports(stack)

    def lost_loads() -> float:
        value = metric(stack.url("feature-keeper", 9100, "/metrics"), "driftline_serving_feature_loads_total", {"reason": "lost"})
        return value or 0.0

    def whole() -> bool:
        for name, port in servings:
            ready = _readyz(stack, name, port)
            status, answer = _rank(stack.url(name, port), stack.api_key(name))
            if not (ready and ready["feature_store"] and not ready["feature_store_emptied"]
                    and status == 200 and answer["user_known"]):
                return False
        return True

    wait_for(stack, "the feature keeper reads the store whole",
             lambda: metric(stack.url("feature-keeper", 9100, "/metrics"), "driftline_serving_features_loaded") == 1.0, 60)
    before = lost_loads()
    stack.kill_redis()
    wait_for(stack, "Redis back after kill -9 with its features", whole, 120)
    time.sleep(3)  # (the feature keeper reads the marker every second)
    assert lost_loads() == before, "the restarted Redis had lost the features: compose's Redis does not persist"

    redis.Redis(port=stack.redis_port).flushall()
    wait_for(stack, "the feature keeper loads the flushed features again", lambda: lost_loads() > before, 60)
    wait_for(stack, "both replicas know the users again", whole, 60)

    def garble(data: Path) -> None:  # (the stand-in is Redis 6: one file; Redis 7's is checked by hand)
        aof = data / "appendonly.aof"
        raw = bytearray(aof.read_bytes())
        at = raw.index(b"\r\n*", len(raw) // 2) + 2  # a command's start (inside a value, bytes are only data)
        raw[at:at + 4] = b"####"
        aof.write_bytes(bytes(raw))

    stack.kill_redis(before_start=garble)
    wait_for(stack, "Redis starts on its cut file and both replicas know the users", whole, 120)
    assert len(list(stack.redis_data().glob("appendonly.aof.damaged-*"))) == 1
    assert "cut at the first bad command" in (stack.tmp / "logs" / "redis.log").read_text()
    assert not stack.exited().keys() & set(long_running(stack)), stack.exited()


@pytest.mark.timeout(600)
def test_a_restart_goes_on_from_what_the_trainer_learned(stack: ComposeProcesses) -> None:
    """``docker compose stop`` then ``up`` on the same volume: every service stops cleanly on
    SIGTERM within its grace period; the warm start skips (--unless-learned), the trainer restores
    its own snapshot and counts on, the traffic resumes after what it learned (--after-learned)."""
    wait_for(stack, "examples trained on", lambda: _examples_trained(stack), 60)

    def stop() -> dict:
        stopped = stack.stop()
        _mark(f"stopped #{stack.starts}")
        unclean = {n: (c.exit_code, "killed" if c.killed else f"{c.stop_s:.1f} s") for n, c in stopped.items()
                   if c.killed or c.exit_code != 0}
        assert not unclean, f"not stopped cleanly by SIGTERM: {unclean}\n{stack.logs_tail()}"
        return _snapshot(stack)

    learned = stop()
    assert learned["examples_applied"] > 0, learned  # the trainer's snapshot on its clean stop
    up(stack)
    this_start = f"=== start {stack.starts}:"
    warm = stack.log_tail("warm-start", 400).split(this_start)[-1]
    assert '"skipped"' in warm, warm

    def restored() -> dict[int, int] | None:
        """rank -> the examples it restored from the snapshot (once every rank has)."""
        log = stack.log_tail("trainer", 2000).split(this_start)[-1]
        got = {int(r): int(n) for r, w, n in re.findall(r"rank (\d+)/(\d+) restored snapshot \S+ .*?: (\d+) examples", log)}
        return got if len(got) == int(stack.environment("trainer").get("DRIFTLINE_TRAINER__NPROC", "1")) else None

    ranks = wait_for(stack, "the trainer restored its own snapshot", restored, 180)
    assert sum(ranks.values()) == learned["examples_applied"], (ranks, learned)
    wait_for(stack, "the traffic resumes after what the trainer learned", lambda: "the replay resumes at rating"
             in stack.log_tail("traffic", 400).split(this_start)[-1], 120)
    wait_for(stack, "the restarted trainer trains on", lambda: _examples_trained(stack) > 0, 180)
    again = stop()
    assert again["examples_applied"] > learned["examples_applied"], (learned, again)
    assert again["max_event_time_ms"] >= learned["max_event_time_ms"]
