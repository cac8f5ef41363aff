"""API keys on serving (serving/auth.py, services/api_keys.py), over real HTTP: every route of the
app (read from its routes, included routers' too, so a new endpoint is covered the day it is added) without a key,
with a wrong one and with each configured key in either header; the refusal to start on a
non-loopback host without a key (the real ``driftline serve`` / ``python -m serving``); key
rotation through the key file; the outcome counter; no key in the logs; the clients that send it."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import replica_settings, running
from starlette.routing import Route

from services.api_keys import configured_keys
from services.ports import free_port
from services.settings import Settings
from serving.app import create_app
from serving.auth import MISSING, WRONG

KEYS = ["key-new-0f3a9c", "key-old-77b1e2"]  # two at once: a rotation in progress
WRONG_KEY = "key-new-0f3a9d"  # one character off the first
#: the two ways of exposing the metrics and the docs: the defaults (open), and both protected
CONFIGS = {"defaults": {}, "protected": {"protect_metrics": True, "protect_docs": True}}
#: routes that never ask for a key
OPEN = {"/healthz", "/readyz", "/ping"}
DOCS = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
#: (name, headers): a request without a key, with a wrong one, and with each key in each header
VARIANTS = {
    "none": {},
    "wrong-bearer": {"Authorization": f"Bearer {WRONG_KEY}"},
    "wrong-x-api-key": {"X-API-Key": WRONG_KEY},
    "bearer-first-key": {"Authorization": f"Bearer {KEYS[0]}"},
    "x-api-key-second-key": {"X-API-Key": KEYS[1]},
}
BODIES = {"/rank": {"user_id": 1, "candidates": [{"item_id": 1}]},
          "/actions": {"actions": [{"request_id": "r-auth", "item_id": 1, "action_type": "click"}]}}


def _routes(config: str) -> list[tuple[str, str]]:
    """(path, method) of every route the app of ``config`` has (HEAD stands in for nothing)."""
    app = create_app(Settings().updated(serving={"api_keys": KEYS, **CONFIGS[config]}))
    # iter_route_contexts: the routes of included routers too (app.routes holds a router as one entry)
    return sorted((c.path, min(c.methods - {"HEAD"})) for c in iter_route_contexts(app.routes) if isinstance(c.route, Route))


def _protected(config: str, path: str) -> bool:
    if path in OPEN:
        return False
    if path == "/metrics":
        return bool(CONFIGS[config].get("protect_metrics"))
    if path in DOCS:
        return bool(CONFIGS[config].get("protect_docs"))
    return True  # everything else, a new endpoint included


@pytest.fixture(scope="module")
def module_settings(broker, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings of this module's replicas: the built-in FM on the session broker and Redis."""
    tmp = tmp_path_factory.mktemp("auth")
    return replica_settings(Settings(kafka_bootstrap_servers=broker.bootstrap, redis_url=redis_url, var_dir=tmp / "var"),
                            f"auth{time.time_ns()}", tmp / "snapshots")


def _replica(settings: Settings, name: str, **serving: object) -> Settings:
    """``settings`` for one replica of this module: its own feature-log spool (one per process)."""
    return settings.updated(serving={"spool_dir": settings.var_dir / f"spool-{name}", **serving})


@pytest.fixture(scope="module")
def servers(module_settings: Settings) -> Iterator[dict[str, str]]:
    """One running replica per configuration, started on first use: config -> base URL."""
    with ExitStack() as stack:

        class Lazy(dict):
            def __missing__(self, config: str) -> str:
                s = _replica(module_settings, config, api_keys=KEYS, **CONFIGS[config])
                self[config] = stack.enter_context(running(create_app(s)))
                return self[config]

        yield Lazy()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("config,path,method", [(c, p, m) for c in CONFIGS for p, m in _routes(c)])
def test_every_route_by_key(servers: dict[str, str], config: str, path: str, method: str, variant: str) -> None:
    r = httpx.request(method, servers[config] + path, headers=VARIANTS[variant], json=BODIES.get(path, {})
                      if method == "POST" else None, timeout=30)
    if not _protected(config, path) or variant.endswith("-key") and not variant.startswith("wrong"):
        assert r.status_code not in (401, 403), (r.status_code, r.text)
        if path in OPEN or path == "/metrics":
            assert r.status_code in (200, 503), r.text  # /readyz: no model loaded here
        return
    if variant == "none":
        assert r.status_code == 401, r.text
        assert r.json() == {"message": MISSING, "detail": MISSING}  # the app's error body
        assert r.headers["www-authenticate"] == "Bearer"
    else:
        assert r.status_code == 403, r.text
        assert r.json() == {"message": WRONG, "detail": WRONG}


def _auth_counts(base: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers=headers, timeout=30).text
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "driftline_serving_auth" for s in f.samples if s.name.endswith("_total")}


def test_each_outcome_is_counted(servers: dict[str, str], module_settings: Settings) -> None:
    base = servers["defaults"]
    before = _auth_counts(base)
    for headers in ({}, {"X-API-Key": WRONG_KEY}, {"Authorization": "Bearer " + KEYS[1]}):
        httpx.post(base + "/actions", json=BODIES["/actions"], headers=headers, timeout=30)
    after = _auth_counts(base)
    for outcome in ("missing", "wrong", "ok"):
        assert after.get(outcome, 0) - before.get(outcome, 0) == 1, (outcome, before, after)
    # no key configured: every request passes, counted as anonymous
    with running(create_app(_replica(module_settings, "open"))) as open_base:
        start = _auth_counts(open_base).get("anonymous", 0)
        # (a 503 asks to retry: the broker did not acknowledge in time, as on a loaded machine)
        codes = [httpx.post(open_base + "/actions", json=BODIES["/actions"], timeout=30).status_code]
        while codes[-1] == 503 and len(codes) < 5:
            codes.append(httpx.post(open_base + "/actions", json=BODIES["/actions"], timeout=30).status_code)
        assert codes[-1] == 202, codes
        assert _auth_counts(open_base)["anonymous"] - start == len(codes)


def test_no_key_in_the_logs(servers: dict[str, str], caplog: pytest.LogCaptureFixture,
                            capfd: pytest.CaptureFixture) -> None:
    base = servers["defaults"]
    with caplog.at_level(logging.DEBUG):
        for headers in ({"Authorization": f"Bearer {WRONG_KEY}"}, {"X-API-Key": WRONG_KEY},
                        {"Authorization": f"Bearer {KEYS[0]}"}):
            httpx.post(base + "/rank", json=BODIES["/rank"], headers=headers, timeout=30)
    logged = caplog.text + "".join(capfd.readouterr())
    for secret in (WRONG_KEY, *KEYS):
        assert secret not in logged
    # nor do the settings print it (a service that logs its settings)
    assert all(k not in repr(Settings.model_validate({"serving": {"api_keys": KEYS}})) for k in KEYS)


def test_keys_from_the_environment_and_a_file_are_unioned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys").write_text("file-key-1\n\n  file-key-2 \n")
    monkeypatch.setenv("DRIFTLINE_SERVING__API_KEYS", '["k1","k2"]')
    monkeypatch.setenv("DRIFTLINE_SERVING__API_KEYS_FILE", str(tmp_path / "keys"))
    assert configured_keys(Settings().serving) == ("k1", "k2", "file-key-1", "file-key-2")


def _status(base: str, key: str) -> int:
    return httpx.post(base + "/actions", json=BODIES["/actions"], headers={"X-API-Key": key}, timeout=30).status_code


def _eventually(check, timeout_s: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _replace(path: Path, text: str) -> None:
    """Write ``path`` as a secret's update does: a new file renamed over the old."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_rotation_through_the_key_file(module_settings: Settings, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """The file is re-read when it changes (at most every serving.auth.FILE_CHECK_S): the new key
    is added, the clients move, the old key goes; an emptied file keeps the keys it had."""
    keys = tmp_path / "api-keys"
    keys.write_text("old-key\n")
    app = create_app(_replica(module_settings, "file", api_keys_file=keys))
    with caplog.at_level(logging.INFO), running(app) as base:
        # eventually: a loaded machine's first actions can meet a producer still connecting (503)
        assert _eventually(lambda: _status(base, "old-key") == 202) and _status(base, "new-key") == 403
        _replace(keys, "new-key\nold-key\n")
        assert _eventually(lambda: _status(base, "new-key") == 202)
        assert _eventually(lambda: _status(base, "old-key") == 202)  # both, while the clients move
        _replace(keys, "new-key\n")
        assert _eventually(lambda: _status(base, "old-key") == 403)
        _replace(keys, "")  # a broken secret mount: neither opens serving nor locks it
        assert _eventually(lambda: _status(base, "new-key") == 202 and "holds no key" in caplog.text)
        assert _status(base, "") == 401
    assert "old-key" not in caplog.text and "new-key" not in caplog.text


def test_clients_send_the_key(servers: dict[str, str], module_settings: Settings) -> None:
    """The Python client (its api_key, else the settings') and the status page's scrape."""
    from driftline.client import RankClient, Rejected
    from status.options import Target, with_serving_key
    from status.scrape import Scraper

    base = servers["protected"]
    action = [{"request_id": "r-client", "item_id": 1, "action_type": "click"}]
    with RankClient([], base, api_key=KEYS[1]) as client:
        assert client.actions(action) == 1
    with RankClient([], base, api_key=WRONG_KEY) as client, pytest.raises(Rejected) as err:
        client.actions(action)
    assert err.value.status == 403 and err.value.message == WRONG

    async def scrape(settings: Settings) -> bool:
        host, port = base.removeprefix("http://").split(":")
        settings = settings.updated(serving={"host": host, "port": int(port)})
        targets = with_serving_key([Target("replica", base + "/metrics")], settings)
        async with Scraper(targets, settings.status) as scraper:
            await scraper.scrape_once()
            return scraper.states[0].up

    assert asyncio.run(scrape(module_settings.updated(serving={"api_keys": KEYS})))
    assert not asyncio.run(scrape(module_settings))  # protected /metrics, no key: down


def _serve(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_SERVING__")}
    return subprocess.Popen([sys.executable, "-m", *argv], env={**clean, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("entry", [["driftline.cli", "serve"], ["serving"]])
def test_refuses_to_start_on_all_addresses_without_a_key(entry: list[str]) -> None:
    proc = _serve([*entry, "--host", "0.0.0.0", "--port", str(free_port()), "--workers", "1"], {})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "DRIFTLINE_SERVING__API_KEYS=" in err and "DRIFTLINE_SERVING__ALLOW_ANONYMOUS=true" in err, err


def test_allow_anonymous_starts_on_all_addresses(module_settings: Settings) -> None:
    port = free_port()
    proc = _serve(["serving", "--host", "0.0.0.0", "--port", str(port), "--workers", "1"], {
        "DRIFTLINE_SERVING__ALLOW_ANONYMOUS": "true", "DRIFTLINE_SERVING__MODEL": "fm",
        "KAFKA_BOOTSTRAP_SERVERS": module_settings.bootstrap_servers, "REDIS_URL": module_settings.redis,
        "DRIFTLINE_VAR_DIR": str(module_settings.var_dir), "DRIFTLINE_LOG_LEVEL": "WARNING"})
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.communicate()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        assert _eventually(healthy, 120)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_up_hands_a_projects_keys_to_its_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``up --config`` applies the project file to the environment every service inherits: a
    ``[settings.serving] api_keys`` reaches serving, the traffic and the status page alike."""
    from driftline.project import apply_to_environ, load_project
    from services.api_keys import client_headers

    (tmp_path / "driftline.toml").write_text('name = "keyed"\n[[features]]\nname = "user_id"\nsource = "context"\n'
                                            '[settings.serving]\napi_keys = ["project-key-9"]\n')
    environ: dict[str, str] = {}
    apply_to_environ(load_project(tmp_path / "driftline.toml"), environ)
    monkeypatch.setenv("DRIFTLINE_SERVING__API_KEYS", environ["DRIFTLINE_SERVING__API_KEYS"])
    assert client_headers(Settings().serving) == {"Authorization": "Bearer project-key-9"}


def test_compose_serving_has_a_key_and_the_traffic_sends_it(repo_root: Path) -> None:
    """Serving binds 0.0.0.0 in docker-compose.yml: without a key it would refuse to start."""
    import json
    import re

    import yaml

    from services.api_keys import startup_refusal

    services = yaml.safe_load((repo_root / "docker-compose.yml").read_text())["services"]
    for name in ("serving-0", "serving-1", "traffic"):
        value = services[name]["environment"]["DRIFTLINE_SERVING__API_KEYS"]
        default = re.fullmatch(r"\$\{DRIFTLINE_SERVING__API_KEYS:-(.+)\}", value)  # the host's, else this
        assert default is not None, (name, value)
        options = Settings.model_validate({"serving": {"api_keys": json.loads(default.group(1)), "host": "0.0.0.0"}}).serving
        assert startup_refusal(options) is None and configured_keys(options) == ("driftline-demo-key",)
