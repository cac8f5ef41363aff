"""Kafka security settings reach every Kafka client, and the password is never shown.

* Every place the project's code makes a Kafka client passes the options of
  :mod:`services.kafka_security`: found by walking the code, so a client written without them fails.
* Clients built from SASL settings carry them (producer, consumer, admin client, the client
  library, the Faust joiner's app, producer and worker consumer), without starting them.
* Against the embedded broker, which knows no SASL, every client kind tries SASL (the broker says
  it has no such mechanism) and fails with one line; the password is in no log record, error or
  ``repr`` (serving's answers: tests/serving/test_kafka_secrets.py).
* The settings refuse contradictions with one line, and read the password from a file; a project
  file's ``[settings.kafka]`` is applied like any other section.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import sys
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from prometheus_client import REGISTRY

from driftline.project import load_project
from driftline.project_template import TEMPLATE
from services.settings import KafkaClientSettings, Settings

ROOT = Path(__file__).parents[1]
PASSWORD = "pw-Zebra-4417-never-printed"
#: the aiokafka classes that open connections to Kafka
CLIENT_CLASSES = {"AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient", "AIOKafkaClient"}
#: other Kafka client libraries: the project's code must not use them (they would bypass the options)
OTHER_CLIENT_LIBRARIES = {"kafka", "confluent_kafka"}


def _project_modules() -> list[Path]:
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = sorted({g.rstrip("*") for g in find["include"]})
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def _calls(node: ast.expr, name: str) -> bool:
    """``node`` is a call of a function named ``name`` (``name(...)`` or ``x.name(...)``)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name)


def kafka_clients(source: str, where: str) -> list[tuple[str, str, bool]]:
    """``(where:line, what, secured)`` for every Kafka client the source makes: an aiokafka client
    class called with ``**security_options(...)`` among its arguments, or ``faust.App`` (or an
    ``App`` imported from faust) with ``broker_credentials=faust_credentials(...)``; an import of
    another Kafka client library counts as an unsecured client.

    >>> kafka_clients("from aiokafka import AIOKafkaProducer\\nAIOKafkaProducer(bootstrap_servers=b)", "m.py")
    [('m.py:2', 'AIOKafkaProducer', False)]
    >>> kafka_clients("aiokafka.AIOKafkaConsumer(t, **options, **security_options(s))", "m.py")
    [('m.py:1', 'AIOKafkaConsumer', True)]
    >>> kafka_clients("import faust\\nfaust.App('id', broker_credentials=None)", "m.py")
    [('m.py:2', 'faust.App', False)]
    >>> kafka_clients("from faust import App as A\\nA('id', broker_credentials=faust_credentials(s))", "m.py")
    [('m.py:2', 'faust.App', True)]
    >>> kafka_clients("from confluent_kafka import Producer", "m.py")
    [('m.py:1', 'import confluent_kafka', False)]
    """
    tree = ast.parse(source, where)
    faust_apps = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "faust"
                  for a in n.names if a.name == "App"}
    found = []
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(at, f"import {m}", False) for m in modules if m.split(".")[0] in OTHER_CLIENT_LIBRARIES]
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in CLIENT_CLASSES:
            found.append((at, name, any(k.arg is None and _calls(k.value, "security_options") for k in node.keywords)))
        elif (isinstance(f, ast.Attribute) and f.attr == "App" and isinstance(f.value, ast.Name) and f.value.id == "faust") \
                or (isinstance(f, ast.Name) and f.id in faust_apps):
            found.append((at, "faust.App", any(k.arg == "broker_credentials" and _calls(k.value, "faust_credentials")
                                               for k in node.keywords)))
    return found


def test_every_kafka_client_in_the_code_takes_the_security_options() -> None:
    found = [c for path in _project_modules() for c in kafka_clients(path.read_text(), str(path.relative_to(ROOT)))]
    assert [c for c in found if not c[2]] == [], "Kafka clients made without services.kafka_security's options"
    # the walk sees them all: services.kafka (producer, admin, typed consumer), the quirks' readers
    # and admin, the broker epoch's readers, the joiner's re-seed reader and its Faust app, the
    # trainers' claim
    where = sorted({c[0].split(":")[0] for c in found})
    assert where == ["joiner/faust_app.py", "joiner/faust_reset.py", "services/broker_reset.py", "services/kafka.py",
                     "services/tansu_quirks.py", "trainer/claim.py"]
    assert len(found) >= 9


def sasl_settings(base: Settings, **kafka: object) -> Settings:
    options = dict(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256", sasl_username="driftline",
                   sasl_password=PASSWORD, connect_timeout_s=5)
    return base.model_copy(update={"kafka": KafkaClientSettings(**{**options, **kafka})})


def _carries_sasl(client: object, mechanism: str = "SCRAM-SHA-256") -> None:
    """An aiokafka producer's / consumer's / admin client's connection options."""
    c = getattr(client, "client", None) or client._client
    assert (c._security_protocol, c._sasl_mechanism, c._sasl_plain_username, c._sasl_plain_password) == \
        ("SASL_PLAINTEXT", mechanism, "driftline", PASSWORD)


async def test_clients_built_from_the_settings_carry_them(tmp_path: Path) -> None:
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    from joiner.faust_app import JoinerApp
    from proto import Action
    from services.kafka import TypedConsumer, admin_client, producer

    s = sasl_settings(Settings(var_dir=tmp_path / "var"))
    p, admin = producer(s), admin_client(s)
    consumer = TypedConsumer(s, "t", Action, ["actions"], "g")
    japp = JoinerApp(s, "e1")
    worker_consumer = japp.app.consumer._thread._create_worker_consumer(japp.app.transport)
    faust_producer = japp.app.producer._new_producer()
    try:
        for client in (p, admin, consumer.consumer, worker_consumer, faust_producer):
            _carries_sasl(client)
        assert credentials_to_aiokafka_auth(japp.app.conf.broker_credentials, japp.app.conf.ssl_context) == {
            "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
            "sasl_plain_username": "driftline", "sasl_plain_password": PASSWORD, "ssl_context": None}
    finally:
        await asyncio.gather(p.stop(), admin.close(), consumer.consumer.stop(), worker_consumer.stop(),
                             faust_producer.stop())

    plain = Settings(var_dir=tmp_path / "plain")
    p = producer(plain)
    assert (p.client._security_protocol, p.client._sasl_plain_username) == ("PLAINTEXT", None)
    await p.stop()


def _only_line(text: str) -> str:
    assert "\n" not in text.strip(), text
    return text


async def test_sasl_against_a_broker_without_it_fails_in_one_line_without_the_password(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """Each kind of client tries SASL against the embedded broker (no SASL: it refuses the mechanism)."""
    from driftline.client.kafka import ActionProducer
    from joiner import faust_reset
    from proto import Action
    from services import broker_reset, tansu_quirks
    from services.kafka import BrokerUnavailable, TypedConsumer, create_topics, producer, start_client

    s = sasl_settings(settings)
    tp = TopicPartition(settings.topics.actions, 0)
    attempts = {
        "admin (create_topics)": create_topics(s),
        "producer": start_client(producer(s), s),
        "typed consumer": start_client(TypedConsumer(s, "t", Action, [tp.topic], "g").consumer, s),
        "client library": ActionProducer([], s).start(),
        "quirks: committed offsets (admin)": tansu_quirks.committed_offsets(s, "g", [tp]),
        "quirks: broker epoch (consumer)": broker_reset.read_broker_epoch(s),
        "quirks: log-end offsets (consumer)": tansu_quirks.log_end_offsets(s, [tp]),
        "quirks: epoch watch (consumer)": broker_reset.EpochWatch(s, "t", "e").start(),
        "joiner re-seed (consumer)": faust_reset.changelog_records(s, [tp]),
    }
    caplog.set_level(logging.DEBUG)
    failures = REGISTRY.get_sample_value("driftline_kafka_connect_failures_total",
                                         {"security_protocol": "SASL_PLAINTEXT"}) or 0.0
    errors = []
    for what, attempt in attempts.items():
        caplog.clear()
        with pytest.raises(Exception) as failed:
            await asyncio.wait_for(attempt, 30)
        assert "UnsupportedSaslMechanism" in caplog.text, f"{what} did not try SASL: {caplog.text[-2000:]}"
        assert PASSWORD not in caplog.text, what
        errors.append(failed.value)
    unavailable = [e for e in errors if isinstance(e, BrokerUnavailable)]
    # the services' start-ups (the broker epoch's reader is the joiner's first Kafka call): one
    # line naming the broker, how, and who
    assert len(unavailable) == 5
    assert REGISTRY.get_sample_value("driftline_kafka_connect_failures_total",
                                     {"security_protocol": "SASL_PLAINTEXT"}) - failures == 5
    for e in unavailable:
        assert _only_line(str(e)).startswith(f"cannot reach Kafka at {settings.bootstrap_servers} over SASL_PLAINTEXT "
                                             "as driftline (SCRAM-SHA-256): check")
    shown = [str(e) for e in errors] + [repr(e) for e in errors] + [
        repr(s), str(s), repr(s.kafka), s.model_dump_json(), str(s.model_dump()), str(s.kafka.sasl_password)]
    assert not [x for x in shown if PASSWORD in x]
    assert s.kafka.sasl_password_value() == PASSWORD


def test_settings_refuse_contradictions_in_one_line(tmp_path: Path) -> None:
    def refused(**kafka: object) -> str:
        with pytest.raises(ValueError) as err:
            KafkaClientSettings(**kafka)
        assert PASSWORD not in str(err.value)
        return err.value.errors()[0]["msg"]

    assert "SASL_SSL needs kafka.sasl_username" in refused(security_protocol="SASL_SSL", sasl_password=PASSWORD)
    assert "needs kafka.sasl_password or kafka.sasl_password_file" in refused(security_protocol="SASL_PLAINTEXT",
                                                                              sasl_username="u")
    assert "kafka.sasl_password is set but kafka.security_protocol is PLAINTEXT" in refused(sasl_password=PASSWORD)
    assert "kafka.ssl_cafile is set but kafka.security_protocol is SASL_PLAINTEXT: TLS is off" in refused(
        security_protocol="SASL_PLAINTEXT", sasl_username="u", sasl_password=PASSWORD, ssl_cafile=tmp_path)
    assert f"kafka.ssl_cafile {tmp_path / 'ca.pem'}: no such file" in refused(security_protocol="SSL",
                                                                           ssl_cafile=tmp_path / "ca.pem")
    assert "need kafka.ssl_certfile" in refused(security_protocol="SSL", ssl_keyfile=tmp_path / "k.pem")
    assert "are both set: set one" in refused(security_protocol="SASL_SSL", sasl_username="u", sasl_password=PASSWORD,
                                 sasl_password_file=tmp_path / "pw")
    assert "Input should be 'PLAINTEXT', 'SSL', 'SASL_PLAINTEXT' or 'SASL_SSL'" in refused(security_protocol="TLS")
    empty = tmp_path / "empty"
    empty.write_text("")
    assert "is empty" in refused(security_protocol="SASL_SSL", sasl_username="u", sasl_password_file=empty)


def test_the_password_from_a_file_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "kafka_password"
    secret.write_text(PASSWORD + "\n")  # as `echo pw > file` writes a Docker secret
    monkeypatch.setenv("DRIFTLINE_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("DRIFTLINE_KAFKA__SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("DRIFTLINE_KAFKA__SASL_USERNAME", "driftline")
    monkeypatch.setenv("DRIFTLINE_KAFKA__SASL_PASSWORD_FILE", str(secret))
    from services.kafka_security import faust_credentials, security_options

    s = Settings()
    options = security_options(s)
    assert (options["security_protocol"], options["sasl_mechanism"], options["sasl_plain_password"]) == \
        ("SASL_SSL", "SCRAM-SHA-512", PASSWORD)
    assert options["ssl_context"].check_hostname  # the system's CAs, and the broker's name checked
    credentials = faust_credentials(s)
    assert (credentials.protocol.value, credentials.mechanism.value, credentials.password) == \
        ("SASL_SSL", "SCRAM-SHA-512", PASSWORD)
    assert PASSWORD not in repr(credentials) and PASSWORD not in repr(s)
    secret.write_text("rotated\n")
    assert security_options(s)["sasl_plain_password"] == "rotated"  # read when a client is made

    monkeypatch.setenv("DRIFTLINE_KAFKA__SASL_PASSWORD", PASSWORD)  # and the file: refused, one line
    import subprocess

    done = subprocess.run([sys.executable, "-m", "driftline.cli", "up", "--no-replay"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == ("driftline: settings: kafka.sasl_password and kafka.sasl_password_file are "
                                   "both set: set one")
    assert PASSWORD not in done.stderr


def test_a_project_file_sets_the_kafka_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[settings.kafka]`` in driftline.toml; the password stays out of the file (the environment,
    or a file), and the section alone is not refused for the setting the environment adds."""
    path = tmp_path / "driftline.toml"
    path.write_text(TEMPLATE + '\n[settings.kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-256"'
                               '\nsasl_username = "driftline"\n')
    project = load_project(path)
    monkeypatch.setenv("DRIFTLINE_KAFKA__SASL_PASSWORD", PASSWORD)
    k = project.resolved_settings().kafka
    assert (k.security_protocol, k.sasl_mechanism, k.sasl_username, k.sasl_password_value()) == \
        ("SASL_SSL", "SCRAM-SHA-256", "driftline", PASSWORD)
    assert project.settings_env()["DRIFTLINE_KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL"  # what `up` hands its services
    monkeypatch.delenv("DRIFTLINE_KAFKA__SASL_PASSWORD")
    with pytest.raises(ValueError, match="needs kafka.sasl_password or kafka.sasl_password_file"):
        project.resolved_settings()
    path.write_text(TEMPLATE + '\n[settings.kafka]\nsecurity_protocol = "SASL"\n')
    from driftline.project import ProjectError

    with pytest.raises(ProjectError, match="Input should be 'PLAINTEXT'"):
        load_project(path)
