"""`driftline up` on the embedded default: broker, Redis, replay; Ctrl-C leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from proto import Action, FeatureLog
from services.in_use import IN_USE_EXIT, OWNER_FILE
from services.kafka import TypedConsumer
from services.ports import free_port, port_is_open
from services.settings import Settings
from tests.loopstack import LoopStack, alive, descendants, free_port_block


def _env(tmp_path: Path, repo_root: Path, broker_port: int, redis_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")}
    env.update(
        DRIFTLINE_VAR_DIR=str(tmp_path / "var"),
        DRIFTLINE_DATA_DIR=str(repo_root / "var" / "data"),
        DRIFTLINE_EMBEDDED__BROKER_PORT=str(broker_port),
        DRIFTLINE_EMBEDDED__REDIS_PORT=str(redis_port),
        DRIFTLINE_SERVING__PORT=str(free_port()),
        DRIFTLINE_STATUS__PORT=str(free_port()),
        # (20000 + broker_port % 20000 once collided with an outgoing connection's ephemeral port)
        DRIFTLINE_EMBEDDED__METRICS_PORT_BASE=str(free_port_block(8)),
    )
    return env


@pytest.mark.timeout(240)
def test_up_runs_broker_redis_and_replay_then_stops_cleanly(tmp_path: Path, repo_root: Path) -> None:
    """``make up``'s ``up --config examples/movielens/driftline.toml`` (the demo as a project file)
    runs the whole demo and Ctrl-C stops all of it. Plain ``up`` (the built-in demo) is the
    shared stack of ``tests/test_loop.py``, whose teardown checks the same clean stop."""
    config = ["--config", "examples/movielens/driftline.toml"]
    broker_port, redis_port = free_port(), free_port()
    env = _env(tmp_path, repo_root, broker_port, redis_port)
    up = subprocess.Popen(
        [sys.executable, "-m", "driftline.cli", "up", *config, "--replay-limit", "20000", "--speed", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=repo_root,
    )
    try:
        deadline = time.monotonic() + 120
        banner = ""
        assert up.stdout is not None
        while "driftline is up" not in banner and time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            banner += line
        assert "driftline is up" in banner, banner
        assert port_is_open("127.0.0.1", broker_port) and port_is_open("127.0.0.1", redis_port)
        _a_second_up_on_the_var_dir_is_refused(tmp_path, repo_root, config, up.pid)
        with socket.create_connection(("127.0.0.1", redis_port)) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(16).startswith(b"+PONG")

        settings = Settings(kafka_bootstrap_servers=f"127.0.0.1:{broker_port}")

        async def read_back() -> tuple[list, list]:
            logs: list = []
            actions: list = []
            async with TypedConsumer(settings, "t", FeatureLog, [settings.topics.features], "t-f") as c:
                for _ in range(60):
                    logs += await c.poll(timeout_ms=500)
                    if len(logs) >= 100:
                        break
            async with TypedConsumer(settings, "t", Action, [settings.topics.actions], "t-a") as c:
                for _ in range(60):
                    actions += await c.poll(timeout_ms=500)
                    if len(actions) >= 100:
                        break
            return logs, actions

        logs, actions = asyncio.run(read_back())
        assert len(logs) >= 100 and len(actions) >= 100
        assert all(r.value.candidates for r in logs)
        assert all(r.value.action_type == "click" for r in actions)

        family = descendants(up.pid)
        assert len(family) >= 2  # broker and redis at least
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
        assert up.returncode == 0, rest
        assert "driftline stopped." in rest
        time.sleep(0.3)
        assert not [pid for pid in family if alive(pid)], "processes left behind"
        assert not port_is_open("127.0.0.1", broker_port)
        assert (tmp_path / "var" / "log" / "broker.log").exists()
        assert (tmp_path / "var" / "log" / "replay.log").exists()
        assert (tmp_path / "var" / "snapshots" / "movielens" / "LATEST").exists()  # the warm start, the file's model
    finally:
        if up.poll() is None:
            up.kill()


def _a_second_up_on_the_var_dir_is_refused(tmp_path: Path, repo_root: Path, config: list[str], first: int) -> None:
    """The same command again with other ports, the same var dir (two project files side by side,
    say): it used to start a second stack there, a second Redis on the first's append-only file, a
    trainer that restored the first's snapshot and wrote its own beside it, and a joiner and a
    dumper crash-looping on RocksDB's locks. Now one line, and nothing of the first's touched."""
    var = tmp_path / "var"

    def infra() -> tuple[object, dict[str, int]]:
        """The first's broker in its supervisor state, and the supervisor's "--- <time> starting
        <command>" lines in the broker's and Redis's logs (neither restarts in a healthy run)."""
        state = json.loads((var / "run" / "supervisor.json").read_text())
        return state.get("broker", {}).get("pid"), {
            name: len(re.findall(r"^--- \S+ \S+ starting ", (var / "log" / name).read_text(errors="replace"), re.M))
            for name in ("broker.log", "redis.log")}
    before = infra()
    done = subprocess.run([sys.executable, "-m", "driftline.cli", "up", *config, "--replay-limit", "20000"],
                          env=_env(tmp_path, repo_root, free_port(), free_port()), capture_output=True, text=True,
                          timeout=60, cwd=repo_root)
    assert done.returncode == IN_USE_EXIT, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"driftline: the var dir {var} is in use by pid {first} (") and last.endswith(
        "stop that process, or give this one its own with var_dir (DRIFTLINE_VAR_DIR)"), last
    assert "Traceback" not in done.stderr
    assert infra() == before and before[0] is not None


def test_port_in_use_is_one_actionable_line(tmp_path: Path, repo_root: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = _env(tmp_path, repo_root, port, free_port())
        done = subprocess.run(
            [sys.executable, "-m", "driftline.cli", "up", "--no-replay"],
            env=env, capture_output=True, text=True, timeout=60, cwd=repo_root,
        )
    assert done.returncode == IN_USE_EXIT
    err = done.stderr.strip().splitlines()
    assert err[-1].startswith("driftline: port 127.0.0.1:") and "DRIFTLINE_EMBEDDED__BROKER_PORT" in err[-1]
    assert "Traceback" not in done.stderr


def test_a_taken_metrics_port_is_one_line_before_anything_starts(tmp_path: Path, repo_root: Path) -> None:
    """Any port up listens on, the services' /metrics ports included: one line naming the port and
    the setting that moves it, and nothing started (it used to be a joiner restarting every 30 s)."""
    env = _env(tmp_path, repo_root, free_port(), free_port())
    joiner_metrics = int(env["DRIFTLINE_EMBEDDED__METRICS_PORT_BASE"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", joiner_metrics))
        busy.listen()
        done = subprocess.run([sys.executable, "-m", "driftline.cli", "up", "--no-replay"],
                              env=env, capture_output=True, text=True, timeout=60, cwd=repo_root)
    assert done.returncode == IN_USE_EXIT, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"driftline: port 127.0.0.1:{joiner_metrics} (the joiner's /metrics) is in use: stop what listens "
        "there, or move it with embedded.metrics_port_base (DRIFTLINE_EMBEDDED__METRICS_PORT_BASE)")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "var" / "log" / "broker.log").exists()  # nothing was started


def test_a_service_on_a_taken_port_exits_once_with_one_line(tmp_path: Path, repo_root: Path) -> None:
    """Run alone (as compose runs it), a service whose /metrics port is taken says so in one line
    and exits IN_USE_EXIT, which neither the supervisor nor a restart policy should loop on."""
    env = _env(tmp_path, repo_root, free_port(), free_port())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env["DRIFTLINE_METRICS_PORT"] = str(busy.getsockname()[1])
        done = subprocess.run([sys.executable, "-m", "driftline.cli", "dumper"],
                              env=env, capture_output=True, text=True, timeout=60, cwd=repo_root)
    assert done.returncode == IN_USE_EXIT, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("move it with metrics_port (DRIFTLINE_METRICS_PORT)")
    assert "Traceback" not in done.stderr


def test_broker_down_is_one_actionable_line(tmp_path: Path, repo_root: Path) -> None:
    env = _env(tmp_path, repo_root, free_port(), free_port())
    env["KAFKA_BOOTSTRAP_SERVERS"] = f"127.0.0.1:{free_port()}"
    env["DRIFTLINE_KAFKA__CONNECT_TIMEOUT_S"] = "3"
    done = subprocess.run(
        [sys.executable, "-m", "driftline.cli", "replay", "--limit", "10", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=60, cwd=repo_root,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "cannot reach Kafka at" in done.stderr and "KAFKA_BOOTSTRAP_SERVERS" in done.stderr


def _own_model(path: Path) -> Path:
    """A model with no users and no MovieLens slot: items, a position and a dense feature."""
    path.write_text(json.dumps({
        "model_id": "own", "kind": "lr", "linear": {"item_id": "w", "pos": "w"}, "mlp": [],
        "dense_features": ["hour"],
        "tables": [{"name": "w", "dim": 1, "optimizer": {"kind": "adagrad", "lr": 0.05},
                    "initializer": {"kind": "zeros"}}]}))
    return path


@pytest.mark.timeout(300)
def test_up_with_your_own_model_leaves_movielens_out(tmp_path: Path, repo_root: Path) -> None:
    """`up --model FILE`: no MovieLens download, warm start, demo features or replay; the stack
    trains and serves that model, and /rank takes its features."""
    data = tmp_path / "data"
    model = _own_model(tmp_path / "own.json")
    stack = LoopStack.start(tmp_path, repo_root, "--model", str(model), env={"DRIFTLINE_DATA_DIR": str(data)})
    try:
        assert f"model  {model}" in stack.text() or str(model) in stack.text()
        stack.wait_for("serving ready", lambda: stack.get(stack.serving_url + "/readyz")[0] == 200, 120)
        body = {"candidates": [{"item_id": 1, "features": {"sparse": {"pos": [0]}, "dense": {"hour": 9.0}}},
                               {"item_id": 2, "features": {"sparse": {"pos": [1]}, "dense": {"hour": 9.0}}}]}
        r = httpx.post(stack.serving_url + "/rank", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["model_version"]["model_id"] == "own"
        r = httpx.post(stack.serving_url + "/rank", json={"candidates": [{"item_id": 1}]}, timeout=30)
        assert r.status_code == 422 and "'hour' missing" in r.json()["message"]
        with socket.create_connection(("127.0.0.1", stack.redis_port)) as s:
            s.sendall(b"DBSIZE\r\n")
            assert s.recv(64).startswith(b":0\r\n")  # no MovieLens features (nor anything else)
    finally:
        code = stack.stop()
    assert code == 0, stack.text()
    assert not data.exists()  # nothing downloaded
    logs = {p.name for p in stack.log_dir.glob("*.log")}
    assert {"trainer.log", "serving.log", "joiner.log"} <= logs
    assert not logs & {"warm-start.log", "features-load.log", "feature-keeper.log", "replay.log"}, logs


@pytest.mark.timeout(300)
def test_up_with_a_project_file_keeps_its_feature_files_loaded(tmp_path: Path, repo_root: Path) -> None:
    """``[store] items_file``: ``up --config`` loads it into Redis, and again after Redis lost it (the
    feature keeper; a FLUSHALL here); a file that is not there is one line before anything starts."""
    from driftline.project_template import write_template

    config = tmp_path / "project" / "driftline.toml"
    config.parent.mkdir()
    write_template(config)
    config.write_text(config.read_text().replace("movielens = false", 'movielens = false\nitems_file = "items.csv"', 1))
    env = _env(tmp_path, repo_root, free_port(), free_port())
    done = subprocess.run([sys.executable, "-m", "driftline.cli", "up", "--config", str(config)],
                          env=env, capture_output=True, text=True, timeout=60, cwd=repo_root)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"[store] names {config.parent / 'items.csv'}, which is not a file")

    (config.parent / "items.csv").write_text("item_id,category\n1,shoes\n2,hats\n3,shoes\n")
    stack = LoopStack.start(tmp_path, repo_root, "--config", str(config), env={"DRIFTLINE_DATA_DIR": str(tmp_path / "data")})

    client = redis.Redis(host="127.0.0.1", port=stack.redis_port, socket_timeout=5)

    def items() -> int:  # the three items' keys (serving writes keys of its own too)
        return len(client.keys(f"{Settings().serving.redis_prefix}:i:*"))

    try:
        assert "items.csv (kept loaded)" in stack.text(), stack.text()
        stack.wait_for("the items in Redis", lambda: items() == 3, 120)
        assert client.flushall()
        stack.wait_for("the feature keeper loading them again", lambda: items() == 3, 60)
    finally:
        client.close()
        code = stack.stop()
    assert code == 0, stack.text()
    assert {"features-load.log", "feature-keeper.log"} <= {p.name for p in stack.log_dir.glob("*.log")}
    assert "lost" in (stack.log_dir / "feature-keeper.log").read_text()


def test_up_with_a_bad_model_file_is_one_actionable_line(tmp_path: Path, repo_root: Path) -> None:
    env = _env(tmp_path, repo_root, free_port(), free_port())
    bad = tmp_path / "model.json"
    bad.write_text('{"model_id": "x", "tables": []}')
    for model in (str(bad), str(tmp_path / "missing.json")):  # (what is wrong: tests/test_cli_errors.py)
        done = subprocess.run([sys.executable, "-m", "driftline.cli", "up", "--model", model],
                              env=env, capture_output=True, text=True, timeout=60, cwd=repo_root)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"driftline: --model {model}: ")


def test_a_snapshot_learned_online_is_never_replaced_by_a_warm_start(tmp_path: Path, repo_root: Path) -> None:
    """The next `up` keeps a snapshot the online trainer learned into and resumes the replay after
    its newest event time; a warm start's own snapshot (nothing learned online) is replaced."""
    from driftline.project import named_config
    from driftline.stack import _warm_start, warm_start_cut
    from movielens.data import fetch, first_rating_after
    from trainer import snapshots

    class Recorder:  # stands in for the supervisor: what would be started
        def __init__(self) -> None:
            self.started: list[str] = []

        def start(self, spec) -> None:  # type: ignore[no-untyped-def]
            self.started.append(spec.name)

    settings = Settings(var_dir=tmp_path / "var", data_dir=repo_root / "var" / "data")
    fetch(settings.replay.dataset, settings.data_dir)
    config = named_config(settings.trainer.model)
    snap = settings.snapshot_root / config.model_id
    newest_ms = 975_000_000_000  # ml-1m's event times run from 2000-04-25 to 2003-02-28
    for applied, expect_kept in ((0, False), (12_345, True)):
        snapshots.save(snap, config, {}, {}, {"examples_applied": applied, "max_event_time_ms": newest_ms})
        sup = Recorder()
        start = _warm_start(settings, sup, "epoch-2", external_broker=False, fraction=0.1)  # type: ignore[arg-type]
        if expect_kept:
            assert sup.started == [] and (snap / "LATEST").exists()
            assert start == first_rating_after(settings.replay.dataset, settings.data_dir, newest_ms) \
                > warm_start_cut(settings, 0.1)[1]
        else:
            assert sup.started == ["warm-start"] and not snap.exists() and start is None


def test_a_warm_start_on_every_start_keeps_what_the_online_trainer_learned(tmp_path: Path, repo_root: Path) -> None:
    """docker compose runs its warm start and its traffic on every `up`: `trainer batch
    --unless-learned` leaves a snapshot the online trainer learned into as it is, and `traffic
    --after-learned` starts after the newest event time it learned."""
    from driftline.project import named_config
    from movielens.data import fetch, first_rating_after
    from producers.traffic import after_learned
    from trainer import snapshots

    settings = Settings(var_dir=tmp_path / "var", data_dir=repo_root / "var" / "data")
    fetch(settings.replay.dataset, settings.data_dir)
    config = named_config(settings.trainer.model)
    snap = settings.snapshot_root / config.model_id
    assert after_learned(settings, settings.replay.dataset) is None  # nothing learned yet: --start-rating
    snapshots.save(snap, config, {}, {}, {"examples_applied": 777, "max_event_time_ms": 975_000_000_000})
    before = sorted(p.name for p in snap.iterdir())
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_")}
    env.update(DRIFTLINE_VAR_DIR=str(settings.var_dir), DRIFTLINE_DATA_DIR=str(settings.data_dir))
    done = subprocess.run([sys.executable, "-m", "driftline.cli", "trainer", "batch", "--movielens", "--limit", "2000",
                           "--snapshot", "--unless-learned", "--quiet"], capture_output=True, text=True, env=env,
                          cwd=repo_root, timeout=180)
    assert done.returncode == 0 and '"skipped"' in done.stdout, done.stdout + done.stderr[-2000:]
    assert sorted(p.name for p in snap.iterdir() if p.name != OWNER_FILE) == before  # (its lock file aside)
    assert after_learned(settings, settings.replay.dataset) == first_rating_after(
        settings.replay.dataset, settings.data_dir, 975_000_000_000)
