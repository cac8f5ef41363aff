"""What a user mistypes on a command line or in a setting is one line on stderr and exit code 2,
before anything starts: a model file that is missing or invalid, a flag out of its range, a
setting a flag refuses, and no broker behind the joiner. Each ran to a traceback (or, for a
negative or zero count, silently did nothing, or never ended) before. Real processes of the
``driftline`` command, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.ports import free_port


def _driftline(repo_root: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_") and k != "KAFKA_BOOTSTRAP_SERVERS"}
    base.update(DRIFTLINE_VAR_DIR=str(tmp_path / "var"), DRIFTLINE_METRICS_PORT="0",
                KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}", DRIFTLINE_KAFKA__CONNECT_TIMEOUT_S="2")
    base.update(env)
    return subprocess.run([sys.executable, "-m", "driftline.cli", *args], env=base, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def _one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("content, says", [
    (None, "not a model name (deepfm, lr), a ModelConfig JSON nor a project file"),
    ("{", "(top): Invalid JSON"),
    ('{"model_id": "x", "tables": []}', "(top): deepfm needs at least one embedding slot"),
], ids=["missing", "not-json", "invalid"])
def test_a_model_file_that_cannot_be_read_is_one_line(repo_root: Path, tmp_path: Path, content: str | None,
                                                       says: str) -> None:
    model = tmp_path / "model.json"
    if content is not None:
        model.write_text(content)
    for command in (["trainer", "batch"], ["trainer", "online"]):
        line = _one_line(_driftline(repo_root, tmp_path, *command, "--model", str(model)))
        assert line.startswith(f"driftline: model {model}: ") and says in line, line


def test_a_broken_project_file_named_as_the_model_is_one_line(repo_root: Path, tmp_path: Path) -> None:
    project = tmp_path / "driftline.toml"
    project.write_text('name = "x"\n[model\n')
    line = _one_line(_driftline(repo_root, tmp_path, "trainer", "batch", "--model", str(project)))
    assert line == f"driftline: {project}: Expected ']' at the end of a table declaration (at line 2, column 7)"


@pytest.mark.parametrize("args, line", [pytest.param(args, line, id=" ".join(args)) for args, line in [
    (["trainer", "batch", "--passes", "0"], "argument --passes: must be at least 1, got 0"),
    (["trainer", "batch", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["trainer", "batch", "--limit", "-5"], "argument --limit: must be at least 1, got -5"),
    (["trainer", "online", "--max-examples", "0"], "argument --max-examples: must be at least 1, got 0"),
    (["traffic", "--concurrency", "0"], "argument --concurrency: must be at least 1, got 0"),
    (["traffic", "--start-fraction", "2"], "argument --start-fraction: must be in [0, 1), got 2"),
    (["replay", "--speed", "-1"], "argument --speed: must be at least 0, got -1"),
    (["joiner", "--until-idle", "-3"], "argument --until-idle: must be at least 0, got -3"),
    (["eval", "--seeds", "-1", "--smoke", "baselines"], "argument --seeds: must be at least 0, got -1"),
    (["dumper", "--metrics-port", "70000"], "argument --metrics-port: must be a port in [0, 65535], got 70000"),
    (["serve", "--workers", "0"], "argument --workers: must be at least 1, got 0"),  # (was taken as 1)
]])
def test_a_flag_out_of_its_range_is_a_usage_error(repo_root: Path, tmp_path: Path, args: list[str], line: str) -> None:
    assert _one_line(_driftline(repo_root, tmp_path, *args)).endswith(f"error: {line}")


@pytest.mark.parametrize("args, env, line", [
    (["trainer", "online", "--batch-size", "0"], {},
     "driftline: settings: trainer.batch_size: Input should be greater than or equal to 1"),
    (["status", "--interval", "0"], {}, "driftline: settings: status.scrape_interval_s: Input should be greater than 0"),
    (["topics", "create"], {"DRIFTLINE_KAFKA__CONNECT_TIMEOUT_S": "-1"},
     "driftline: settings: kafka.connect_timeout_s: Input should be greater than 0"),
    (["eval", "--smoke", "baselines"], {"DRIFTLINE_EVAL__COLL_TEST_FRACTION": "1"},
     "driftline: settings: eval.coll_test_fraction: Input should be less than 1"),
], ids=["flag", "status-flag", "environment", "eval"])
def test_a_setting_refused_is_one_line_naming_it(repo_root: Path, tmp_path: Path, args: list[str],
                                                 env: dict[str, str], line: str) -> None:
    assert _one_line(_driftline(repo_root, tmp_path, *args, **env)) == line


def test_the_joiner_without_a_broker_says_so_in_one_line(repo_root: Path, tmp_path: Path) -> None:
    done = _driftline(repo_root, tmp_path, "joiner")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "cannot reach Kafka at 127.0.0.1:" in done.stderr.strip().splitlines()[-1]


#: each service's own entry point, with what it needs to reach its settings
_ENTRY_POINTS = {"joiner": [], "joiner.dumper": [], "serving": [], "status": [], "trainer": ["online"],
                 "producers.traffic": [], "evaluation": ["baselines"]}


def test_a_service_run_as_python_m_says_a_refused_setting_in_one_line(tmp_path: Path) -> None:
    """The services' own entry points (``python -m joiner``, as a user's own supervisor may run
    them) print a refused setting as ``driftline`` does, not as pydantic's traceback. (All at once:
    each start is mostly imports.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_")}
    env.update(DRIFTLINE_VAR_DIR=str(tmp_path / "var"), DRIFTLINE_KAFKA__SESSION_TIMEOUT_MS="soon")
    started = {m: subprocess.Popen([sys.executable, "-m", m, *args], env=env, cwd=Path(__file__).parents[1],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for m, args in _ENTRY_POINTS.items()}
    for module, proc in started.items():
        out, err = proc.communicate(timeout=120)
        line = _one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        assert line == (f"python -m {module}: settings: kafka.session_timeout_ms: Input should be a valid "
                        "integer, unable to parse string as an integer"), module
