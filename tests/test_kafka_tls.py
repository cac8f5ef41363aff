"""``kafka.security_protocol = SSL`` end to end: every kind of client the project makes talks to
a real broker over mutual TLS with the options of :mod:`services.kafka_security` alone (the CA
file, a client certificate, its encrypted key and the key's password), and a client without them
is refused. The broker is the embedded tansu behind a TLS front (tests/kafka_tls.py: tansu cannot
serve TLS itself)."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from driftline.client.kafka import ActionProducer
from driftline.embedded import tansu_command, wait_for_port
from joiner import faust_reset
from proto import Action
from services import broker_reset, tansu_quirks
from services.kafka import BrokerUnavailable, TypedConsumer, create_topics, producer, start_client
from services.kafka_security import KafkaSecurityError
from services.ports import free_port
from services.settings import KafkaClientSettings, Settings
from tests.conftest import _start, _stop
from tests.kafka_tls import KEY_PASSWORD, Certificates, TLSFront, make_certificates


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_broker(certs: Certificates, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSFront]:
    """A tansu broker on a plaintext port that advertises the TLS front's, and the front."""
    port = free_port()
    front = TLSFront(certs, port)
    argv = tansu_command("127.0.0.1", port)
    argv[argv.index("--advertised-listener-url") + 1] = f"tcp://127.0.0.1:{front.port}"
    proc: subprocess.Popen = _start(argv, tmp_path_factory.mktemp("tls-broker") / "tansu.log")
    try:
        wait_for_port("127.0.0.1", port, 20, "broker", proc)
        yield front
    finally:
        _stop(proc)
        front.close()


def tls_settings(front: TLSFront, certs: Certificates, tmp_path: Path, **kafka: object) -> Settings:
    options = dict(security_protocol="SSL", ssl_cafile=certs.ca, ssl_certfile=certs.client_cert,
                   ssl_keyfile=certs.client_key, ssl_key_password=KEY_PASSWORD, connect_timeout_s=15)
    return Settings(kafka_bootstrap_servers=f"127.0.0.1:{front.port}", var_dir=tmp_path / "var",
                    kafka=KafkaClientSettings(**{**options, **kafka}))


async def test_every_client_works_over_mutual_tls(tls_broker: TLSFront, certs: Certificates, tmp_path: Path) -> None:
    s = tls_settings(tls_broker, certs, tmp_path)
    topic, group = f"tls-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    handshakes = tls_broker.handshakes
    assert await create_topics(s, {topic: 1, s.topics.dead_letters: 1}) == [topic, s.topics.dead_letters]  # admin
    epoch = await broker_reset.ensure_broker_epoch(s)  # producer + consumer
    assert await broker_reset.read_broker_epoch(s) == epoch
    async with ActionProducer([], s, topic=topic) as actions:  # the client library
        await actions.send_many([{"request_id": f"r{i}", "item_id": i, "action_type": "click"} for i in range(3)])
    p = producer(s)
    await start_client(p, s)
    try:
        await p.send_and_wait(topic, Action(request_id="r3", item_id=3, action_type="click",
                                            event_time_ms=1).SerializeToString(), key=b"r3", partition=0)
    finally:
        await p.stop()
    tp = TopicPartition(topic, 0)
    async with TypedConsumer(s, "tls-test", Action, [topic], group) as consumer:  # + its dead-letter producer
        got: list = []
        for _ in range(60):
            got += await consumer.poll(timeout_ms=500)
            if len(got) >= 4:
                break
        await consumer.commit()
    assert sorted(r.value.request_id for r in got) == ["r0", "r1", "r2", "r3"]
    assert await tansu_quirks.committed_offsets(s, group, [tp]) == {tp: 4}  # admin (quirks)
    assert await tansu_quirks.log_end_offsets(s, [tp]) == {tp: 4}
    assert [k for k, _ in (await faust_reset.changelog_records(s, [tp]))[tp]] == [b"r0", b"r1", b"r2", b"r3"]
    watch = broker_reset.EpochWatch(s, "tls-test", epoch)
    assert await watch.start() == epoch
    try:
        assert await watch.check() is None
    finally:
        await watch.stop()
    assert tls_broker.handshakes > handshakes


async def test_a_client_without_tls_or_its_certificate_is_refused(tls_broker: TLSFront, certs: Certificates,
                                                                   tmp_path: Path) -> None:
    """The front really checks: plaintext, no client certificate, or the system's CAs (which do not
    know the test CA) each fail with BrokerUnavailable naming the TLS settings."""
    plain = Settings(kafka_bootstrap_servers=f"127.0.0.1:{tls_broker.port}",
                     kafka=KafkaClientSettings(connect_timeout_s=3, request_timeout_ms=3000))
    no_cert = tls_settings(tls_broker, certs, tmp_path, ssl_certfile=None, ssl_keyfile=None, ssl_key_password=None,
                           connect_timeout_s=3)
    system_cas = tls_settings(tls_broker, certs, tmp_path, ssl_cafile=None, connect_timeout_s=3)
    for s in (plain, no_cert, system_cas):
        with pytest.raises(BrokerUnavailable) as refused:
            await create_topics(s, {"never": 1})
        assert f"127.0.0.1:{tls_broker.port}" in str(refused.value)
    assert "over SSL: check the broker address and kafka.security_protocol, kafka.ssl_*" in str(refused.value)


def test_a_wrong_key_password_is_one_line_without_the_password(certs: Certificates, tmp_path: Path) -> None:
    from services.kafka_security import security_options

    s = Settings(kafka=KafkaClientSettings(security_protocol="SSL", ssl_cafile=certs.ca, ssl_certfile=certs.client_cert,
                                           ssl_keyfile=certs.client_key, ssl_key_password="not-" + KEY_PASSWORD))
    with pytest.raises(KafkaSecurityError) as err:
        security_options(s)
    message = str(err.value)
    assert "ssl_keyfile=" in message and "kafka.ssl_key_password" in message and "\n" not in message
    assert KEY_PASSWORD not in message and "not-" + KEY_PASSWORD not in message
    with pytest.raises(KafkaSecurityError):  # no password: an error, never OpenSSL's prompt on the terminal
        security_options(s.updated(kafka={"ssl_key_password": None}))


async def test_the_faust_joiner_works_over_mutual_tls(tls_broker: TLSFront, certs: Certificates, tmp_path: Path) -> None:
    """One Faust worker (its consumer, producer, changelog and the quirks' true end offsets) joins
    features and actions over TLS and writes its examples."""
    from joiner.faust_app import run
    from tests.joiner.helpers import JOINER, produce
    from tests.joiner.synth import ml_events

    s = tls_settings(tls_broker, certs, tmp_path)
    s = s.updated(topics={name: f"{name}-tls" for name in ("features", "actions", "examples", "dead_letters")},
                  joiner={**JOINER, "group_id": "joiner-tls"})
    events = ml_events(300, start=60_000, seed=9)
    await create_topics(s)
    await produce(s, events)
    counts = await asyncio.wait_for(run(s, until_idle_s=1.0), 180)
    assert counts["impressions"] > 0 and counts["positives"] > 0
    tps = [TopicPartition(s.topics.examples, p) for p in range(s.topics.partitions)]
    assert sum((await tansu_quirks.log_end_offsets(s, tps)).values()) > 0
