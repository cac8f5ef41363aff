"""Fixtures of the status page's tests: a status app on a real port, and Debian's chromium."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from services.ports import free_port
from services.settings import Settings
from status.app import create_app
from status.options import StatusSettings, parse_target

ENSURE_CHROMIUM = Path(__file__).with_name("ensure_chromium.sh")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


class StatusServer:
    """The status app served by uvicorn on a thread, on a free port."""

    def __init__(self, targets: list[str], opts: StatusSettings) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(Settings(), [parse_target(t) for t in targets], opts)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("status server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def status_server() -> Iterator[Callable[..., StatusServer]]:
    started: list[StatusServer] = []

    def start(targets: list[str], **opts: object) -> StatusServer:
        s = StatusServer(targets, StatusSettings(**opts))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def chromium() -> str:
    """/usr/bin/chromium, installed with apt-get when missing; skips only when that install fails."""
    try:
        proc = subprocess.run(["sh", str(ENSURE_CHROMIUM)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("apt-get install chromium timed out after 15 min")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        pytest.skip(f"chromium missing and `apt-get install -y chromium` failed: {' | '.join(tail)}")
    return CHROMIUM


@dataclass
class BrowserPage:
    """A headless-chromium page and every console error, page error and failed request it saw."""

    page: Any
    errors: list[str] = field(default_factory=list)


@pytest.fixture
def browser_page(chromium: str) -> Iterator[BrowserPage]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright pip package is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            seen = BrowserPage(page)
            page.on("console", lambda m: seen.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: seen.errors.append(f"pageerror: {e}"))
            page.on("requestfailed", lambda r: seen.errors.append(f"requestfailed: {r.url}"))
            yield seen
        finally:
            browser.close()
