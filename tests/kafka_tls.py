"""A TLS listener for the embedded broker, for the tests of ``kafka.security_protocol`` SSL.

tansu 0.6.0 cannot serve TLS itself (``--cert`` and ``--key`` cannot be given together), so a TLS
terminator stands in front of it, as stunnel or a load balancer would in front of a broker:
:class:`TLSFront` accepts TLS (a client certificate signed by the test CA required) and forwards
the bytes to the broker, which advertises the front's address. :func:`make_certificates` writes
the CA, the server's certificate for 127.0.0.1 and a client certificate whose key is encrypted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from services.ports import free_port

#: the client key's password (:func:`make_certificates`)
KEY_PASSWORD = "key-secret-0451"


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path  # encrypted with KEY_PASSWORD


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(where: Path) -> Certificates:
    """A test CA and the certificates it signs, under ``where`` (EC keys: fast to make)."""
    where.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    _openssl("req", "-x509", *ec, "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=driftline test CA", cwd=where)
    (where / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("req", *ec, "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=where)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext", cwd=where)
    _openssl("req", *ec, "-passout", f"pass:{KEY_PASSWORD}", "-keyout", "client.key", "-out", "client.csr",
             "-subj", "/CN=driftline client", cwd=where)
    _openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "client.pem", "-days", "2", cwd=where)
    return Certificates(where / "ca.pem", where / "server.pem", where / "server.key", where / "client.pem",
                        where / "client.key")


class TLSFront:
    """Accepts TLS on ``port`` (client certificates of ``certs.ca`` required) and forwards each
    connection to ``127.0.0.1:target_port``, in a thread of its own; ``close()`` stops it."""

    def __init__(self, certs: Certificates, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.handshakes = 0  # connections whose TLS handshake (client certificate included) passed
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
        context.load_cert_chain(str(certs.server_cert), str(certs.server_key))
        context.verify_mode = ssl.CERT_REQUIRED
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(context, started), daemon=True, name="tls-front")
        self._thread.start()
        if not started.wait(20):
            raise RuntimeError("the TLS front did not start")

    def _run(self, context: ssl.SSLContext, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._forward, "127.0.0.1", self.port, ssl=context))
        started.set()
        self._loop.run_forever()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                with contextlib.suppress(OSError, ssl.SSLError, RuntimeError):
                    dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
