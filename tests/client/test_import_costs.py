"""What the client side pays for imports.

The client package, the project file and the services that only read configuration (the joiner,
the dumper, the status page, the replay) must not load torch or numba (~2.5 s of CPU per process):
``ps`` imports its tables on first use, the manifest readers live in ``trainer.manifest``.

An async request must not try to import anything: httpcore imports ``sniffio`` inside every
async request, and where it is missing (anyio >= 4.11 no longer brings it) Python searches the
whole path again each time (encode/httpcore#1103), doubling the client's CPU per request
(pyproject.toml pins sniffio for it). The async client is the traffic replay's and
``driftline.client``'s; this fails the day a dependency change brings such an import back."""

from __future__ import annotations

import asyncio
import importlib.abc
import subprocess
import sys

import httpx

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class _Missed(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: asked only for a module no other finder found."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        self.names.append(fullname)


async def _requests(n: int) -> list[str]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    missed = _Missed()
    async with server, httpx.AsyncClient() as client:
        assert (await client.get(url)).text == "ok"  # the first request may import what it needs
        sys.meta_path.append(missed)
        try:
            for _ in range(n):
                assert (await client.post(url, json={"n": 1})).text == "ok"
        finally:
            sys.meta_path.remove(missed)
    return missed.names


def test_an_async_request_tries_no_import() -> None:
    assert asyncio.run(_requests(20)) == []


def test_the_client_and_the_configuration_load_neither_torch_nor_numba() -> None:
    code = ("import sys, driftline.client, driftline.project, producers.traffic, status.app, joiner.worker, joiner.dumper, "
            "trainer.manifest; print(sorted({'torch', 'numba'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
