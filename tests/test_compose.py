"""docker-compose.yml, checked as far as a machine without Docker allows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from driftline.cli import build_parser
from services.settings import Settings


def _compose(repo_root: Path) -> dict:
    return yaml.safe_load((repo_root / "docker-compose.yml").read_text())


def _driftline_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("image") == "driftline:latest"}


def test_official_images_for_the_infrastructure(repo_root: Path) -> None:
    services = _compose(repo_root)["services"]
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft
    assert services["redis"]["image"].startswith("redis:")
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")


def test_each_service_command_is_a_real_entry_point(repo_root: Path) -> None:
    ours = _driftline_services(_compose(repo_root))
    assert {"topics", "warm-start", "traffic", "joiner-0", "joiner-1", "dumper", "trainer", "serving-0"} <= set(ours)
    # The joiner workers form one group: Faust assigns the partitions, none is pinned.
    assert all("--partitions" not in ours[w]["command"] for w in ("joiner-0", "joiner-1"))
    parser = build_parser()
    for name, service in ours.items():
        command = service["command"]
        entrypoint = service.get("entrypoint")
        if entrypoint is not None:
            # A module run directly (`python -m producers.traffic`): its --help must list each flag.
            assert entrypoint[:2] == ["python", "-m"] and len(entrypoint) == 3, f"{name}: {entrypoint}"
            helptext = subprocess.run([sys.executable, "-m", entrypoint[2], "--help"], capture_output=True,
                                      text=True, cwd=repo_root, timeout=120)
            assert helptext.returncode == 0, helptext.stderr
            for flag in (c for c in command if c.startswith("--")):
                assert flag in helptext.stdout, f"{name}: {flag} is not a flag of `python -m {entrypoint[2]}`"
            continue
        args, rest = parser.parse_known_args(command)  # SystemExit on an unknown subcommand
        assert callable(args.func), name
        if not hasattr(args, "args"):
            assert not rest, f"{name}: unknown flags {rest}"
            continue
        # A service parses its own flags: each one the compose file passes must be in its --help.
        helptext = subprocess.run(
            [sys.executable, "-m", "driftline.cli", command[0], *[c for c in command[1:] if not c.startswith("-")][:1], "--help"]
            if command[0] in ("trainer", "features") else [sys.executable, "-m", "driftline.cli", command[0], "--help"],
            capture_output=True, text=True, cwd=repo_root, timeout=120,
        )
        assert helptext.returncode == 0, helptext.stderr
        for flag in (c for c in command[1:] if c.startswith("--")):
            assert flag in helptext.stdout, f"{name}: {flag} is not a flag of `driftline {command[0]}`"
    dockerfile = (repo_root / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["driftline"]' in dockerfile


def _reads(env_var: str) -> bool:
    """Whether our settings read this variable (by building Settings with it set)."""
    fields = Settings.model_fields
    if env_var in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL"):
        return True
    if not env_var.startswith("DRIFTLINE_"):
        return False
    path = env_var.removeprefix("DRIFTLINE_").lower().split("__")
    if path[0] not in fields:
        return False
    if len(path) == 1:
        return True
    section = fields[path[0]].annotation
    return len(path) == 2 and path[1] in getattr(section, "model_fields", {})


def test_every_environment_variable_is_one_our_settings_read(repo_root: Path) -> None:
    for name, service in _driftline_services(_compose(repo_root)).items():
        for env_var in service.get("environment", {}):
            assert _reads(env_var), f"{name}: {env_var} is not a driftline setting"


def test_prometheus_scrapes_every_driftline_service(repo_root: Path) -> None:
    config = yaml.safe_load((repo_root / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    long_running = {n for n, s in _driftline_services(_compose(repo_root)).items() if s.get("restart") != "no"}
    assert long_running <= targets


@pytest.mark.skipif(not shutil.which("docker"), reason="no docker client")
def test_docker_compose_config_validates(repo_root: Path) -> None:
    done = subprocess.run(["docker", "compose", "config", "-q"], cwd=repo_root, capture_output=True, text=True)
    if done.returncode != 0 and ("is not a docker command" in done.stderr or "unknown" in done.stderr.lower()):
        pytest.skip("docker compose plugin not installed")
    assert done.returncode == 0, done.stderr


def test_compose_file_matches_the_compose_spec_schema(repo_root: Path) -> None:
    """`docker compose config` needs the v2 plugin, which neither Debian bookworm nor PyPI has here;
    the Compose Specification's own JSON schema (vendored, deploy/schema/README.md) checks the same
    structure: unknown keys, wrong types, bad depends_on conditions, malformed ports and volumes."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((repo_root / "deploy" / "schema" / "compose-spec.json").read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(_compose(repo_root))]
    assert not errors, "\n".join(errors)
    # and the check bites: a typo'd key and a wrong type are both reported
    broken = _compose(repo_root)
    broken["services"]["redis"]["restrat"] = "always"
    broken["services"]["redis"]["ports"] = 6379
    assert len(list(validator.iter_errors(broken))) >= 2


def test_every_path_compose_mounts_exists(repo_root: Path) -> None:
    for name, service in _compose(repo_root)["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (repo_root / source).exists(), f"{name}: {source} does not exist"


def test_services_start_after_what_they_need(repo_root: Path) -> None:
    services = _compose(repo_root)["services"]
    for name in ("trainer", "serving-0", "serving-1"):
        assert services[name]["depends_on"]["warm-start"]["condition"] == "service_completed_successfully", name
    for name in ("serving-0", "serving-1"):
        assert services[name]["depends_on"]["features-load"]["condition"] == "service_completed_successfully", name
    assert services["feature-keeper"]["depends_on"]["features-load"]["condition"] == "service_completed_successfully"
    assert services["feature-keeper"]["restart"] == "unless-stopped" and "--watch" in services["feature-keeper"]["command"]
    assert "serving-0" in services["traffic"]["depends_on"]


def test_the_image_installs_and_runs_every_service_command(repo_root: Path, tmp_path: Path) -> None:
    """What `docker build` would make, without Docker: the context the Dockerfile's COPYs give
    (parsed with dockerfile-parse), installed the way its `pip install .` does (built and installed,
    not editable; the dependencies are this venv's), then `driftline --help` and every compose
    service's command with `--help` run from that install alone, the repository off the path. A
    package the Dockerfile forgets to copy fails here."""
    import sysconfig

    from dockerfile_parse import DockerfileParser

    parsed = DockerfileParser(fileobj=(repo_root / "Dockerfile").open("rb"))
    workdir = Path("/")
    context = tmp_path / "image"
    copied = 0
    for step in parsed.structure:
        if step["instruction"] == "WORKDIR":
            workdir = workdir / step["value"]
        if step["instruction"] != "COPY":
            continue
        *sources, dest = step["value"].split()
        assert not any(s.startswith("--") for s in sources), f"COPY flags are not handled here: {step['value']}"
        target = context / (workdir / dest).relative_to("/")
        for source in sources:
            src = repo_root / source
            out = target / src.name if dest.endswith("/") or len(sources) > 1 else target
            out.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
            else:
                shutil.copy2(src, out)
            copied += 1
    import tomllib

    app = context / workdir.relative_to("/")
    packages = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    missing = [p.rstrip("*") for p in packages if not (app / p.rstrip("*")).is_dir()]
    assert not missing, f"packages pyproject.toml installs that the Dockerfile does not COPY: {missing}"
    installs = [s["value"] for s in parsed.structure if s["instruction"] == "RUN" and "pip install" in s["value"]]
    assert any(v.rstrip().endswith(" .") for v in installs), installs  # the project itself, from the workdir
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                            "--target", str(site), str(app)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    # -S: no site-packages processing, so this venv's editable install of the repository is not on
    # the path; its dependencies are (PYTHONPATH), after the image's own install.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIFTLINE_", "PYTHON"))}
    env["PYTHONPATH"] = f"{site}:{sysconfig.get_paths()['purelib']}"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, cwd=tmp_path,
                              env=env, timeout=180)

    where = run("-c", "import driftline; print(driftline.__file__)")
    assert where.returncode == 0 and where.stdout.startswith(str(site)), (where.stdout, where.stderr[-2000:])
    helps = {"driftline --help": run("-m", "driftline.cli", "--help")}
    for name, service in _driftline_services(_compose(repo_root)).items():
        command, entrypoint = service["command"], service.get("entrypoint")
        if entrypoint is not None:
            helps[name] = run("-m", entrypoint[2], "--help")
        else:
            words = [command[0], *[c for c in command[1:2] if not c.startswith("-")]]
            helps[name] = run("-m", "driftline.cli", *words, "--help")
    failed = {name: r.stderr.strip().splitlines()[-1:] for name, r in helps.items() if r.returncode != 0}
    assert not failed, f"{copied} paths copied; commands that fail from the image's install: {failed}"


def test_compose_waits_as_long_as_up_for_each_service_to_stop(repo_root: Path) -> None:
    """A stop writes the trainer's last snapshot and drains serving's spool: compose must not
    SIGKILL a service sooner than ``driftline up`` would (compose's default is 10 s)."""
    from driftline.stack import APP_SERVICES
    from driftline.supervisor import ServiceSpec
    from tests.composestack import DEFAULT_STOP_GRACE_S, duration_s

    ours = _driftline_services(_compose(repo_root))
    settings = Settings()
    default = ServiceSpec("x", []).stop_timeout_s
    checked = []
    for app in APP_SERVICES:
        up_wait = app.stop_timeout_s(settings) if app.stop_timeout_s else default
        for name, service in ours.items():
            if name == app.name or name.startswith(f"{app.name}-"):
                compose_wait = duration_s(service.get("stop_grace_period"), DEFAULT_STOP_GRACE_S)
                assert compose_wait >= up_wait, f"{name}: compose waits {compose_wait} s, up {up_wait} s"
                checked.append(name)
    assert {"trainer", "serving-0", "joiner-0"} <= set(checked)
