"""Regenerate ``docs/status.png``: the status page, live, in headless chromium.

    .venv/bin/python -m tests.status.make_screenshot            # the real loop (driftline up), ~3 min
    .venv/bin/python -m tests.status.make_screenshot --fake     # the fake stack of the tests, ~15 s

The real run starts ``driftline up`` on free ports (:class:`tests.test_loop.LoopStack`), serves
the status page against it, waits ``--wait`` seconds so the charts fill, takes the screenshot and
stops everything.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from driftline.stack import status_targets
from services.settings import Settings
from status.options import StatusSettings
from tests.status.conftest import CHROMIUM, CHROMIUM_ARGS, ENSURE_CHROMIUM, StatusServer

REPO = Path(__file__).resolve().parents[2]


def shoot(url: str, out: Path, wait_s: float) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, wait_until="load")
            page.wait_for_function("window.driftline.updates >= 1", timeout=30_000)
            time.sleep(wait_s)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fake", action="store_true", help="the tests' fake stack instead of driftline up")
    parser.add_argument("--wait", type=float, default=None, help="seconds of live data before the shot")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "status.png")
    parser.add_argument("--replay-limit", default="200000", help="ratings the real loop replays")
    args = parser.parse_args(argv)
    subprocess.run(["sh", str(ENSURE_CHROMIUM)], check=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    opts = StatusSettings(scrape_interval_s=2.0)
    if args.fake:
        from tests.status.fakestack import FakeStack

        stack = FakeStack()
        status = StatusServer(stack.targets(), opts.model_copy(update={"scrape_interval_s": 0.5, "rate_window_s": 2.0}))
        try:
            shoot(status.url + "/", args.out, 12 if args.wait is None else args.wait)
        finally:
            status.stop()
            stack.stop()
    else:
        from tests.loopstack import LoopStack

        with tempfile.TemporaryDirectory(prefix="driftline-status-") as tmp:
            loop = LoopStack.start(Path(tmp), REPO, "--replay-limit", args.replay_limit)
            try:
                settings = Settings(embedded={"metrics_port_base": loop.metrics_base},
                                    serving={"port": loop.serving_port})
                status = StatusServer([f"{t.name}={t.url}" for t in status_targets(settings)], opts)
                try:
                    shoot(status.url + "/", args.out, 150 if args.wait is None else args.wait)
                finally:
                    status.stop()
            finally:
                loop.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
