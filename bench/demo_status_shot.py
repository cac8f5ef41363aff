"""``make up``'s demo (``driftline up --config examples/movielens/driftline.toml``) on free ports
for WAIT seconds after its banner, the trainer's online AUC every 10 s, then a screenshot of its
status page; last line: JSON. Run from a checkout (the checkout's code runs):

    .venv/bin/python bench/demo_status_shot.py OUT.png 120

``docs/status-demo-*.png`` (issue 29: the online AUC after 2 minutes of the demo with the plain
DeepFM, with its first-order weights learned example by example, and with its embeddings too, the
served model) came from it.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path.cwd()
sys.path.insert(0, str(REPO))
from tests.loopstack import LoopStack
from tests.status.make_screenshot import CHROMIUM, CHROMIUM_ARGS

out, wait = Path(sys.argv[1]), float(sys.argv[2])
with tempfile.TemporaryDirectory(prefix="shot-") as tmp:
    loop = LoopStack.start(Path(tmp), REPO, "--config", "examples/movielens/driftline.toml", timeout_s=600)
    t0 = time.time()
    series = []
    try:
        while time.time() - t0 < wait:
            time.sleep(10)
            try:
                series.append((round(time.time() - t0), loop.metric("trainer", "driftline_trainer_auc", {"mode": "online"}),
                               loop.metric("trainer", "driftline_trainer_examples_total", {})))
            except Exception as e:  # noqa: BLE001 - the stack may not answer yet: the row records what it said
                series.append((round(time.time() - t0), repr(e)[:80], None))
            print(series[-1], flush=True)
        from playwright.sync_api import sync_playwright
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = b.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{loop.status_port}/", wait_until="load")
            page.wait_for_function("window.driftline.updates >= 1", timeout=30_000)
            time.sleep(8)
            page.screenshot(path=str(out), full_page=True)
            b.close()
        print(json.dumps({"auc_online": loop.metric("trainer", "driftline_trainer_auc", {"mode": "online"}), "series": series}))
    finally:
        loop.stop()
