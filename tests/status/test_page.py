"""The status app over real HTTP, and its page in a real headless chromium (driven by playwright)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from services.ports import free_port
from tests.status.conftest import BrowserPage
from tests.status.fakestack import FakeStack

CHART_IDS = ["auc", "recent-auc", "rps", "latency", "sync", "tables", "version", "examples", "rank-rate", "rank-comm", "lag",
             "wm-lag", "places"]


@pytest.fixture
def fake_stack():
    stack = FakeStack()
    yield stack
    stack.stop()


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_endpoints_over_http_with_one_service_down(fake_stack, status_server) -> None:
    down = f"dumper=http://127.0.0.1:{free_port()}/metrics"
    srv = status_server([*fake_stack.targets(), down], scrape_interval_s=0.2, rate_window_s=1.0)
    with httpx.Client(base_url=srv.url, timeout=5) as client:
        api = _wait(lambda: (j := client.get("/api/series").json()) and len(j["t"]) >= 8 and j, 10, "8 scrapes")
        up = {t["name"]: t["up"] for t in api["targets"]}
        assert up == {"joiner": True, "trainer": True, "serving": True, "dumper": False}
        s = api["series"]
        assert any(v is not None and v > 0 for v in s["rank_rps"])
        assert any(v is not None for v in s["rank_p99_ms"])
        assert s["model_version:sparse"][-1] is not None
        assert set(k for k in s if k.startswith("table_rows:")) == {"table_rows:user_id", "table_rows:movie_id",
                                                                      "table_rows:genre", "table_rows:age"}

        page = client.get("/")
        assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
        assert "https://" not in page.text.replace("https://github.com", "")  # no CDN: works offline
        for path in ("/static/uPlot.iife.min.js", "/static/uPlot.min.css", "/static/status.js", "/static/status.css"):
            assert client.get(path).status_code == 200, path
        own = client.get("/metrics").text
        assert 'driftline_status_scrapes_total{target="serving"}' in own
        assert 'driftline_status_scrape_errors_total{kind="connect",target="dumper"}' in own
        assert 'driftline_status_target_up{target="dumper"} 0.0' in own
        assert client.get("/healthz").json() == {"ok": True}
        assert api["problems"] == []  # (the dumper is down: its badge says so)


def test_page_in_headless_chromium_has_live_charts_and_no_console_errors(fake_stack, status_server,
                                                                        browser_page: BrowserPage,
                                                                        tmp_path: Path) -> None:
    srv = status_server(fake_stack.targets(), scrape_interval_s=0.5, rate_window_s=2.0)
    page = browser_page.page
    page.goto(srv.url + "/", wait_until="load")
    assert page.title() == "driftline · live status"
    # Every chart gets data points, and they keep coming (the page polls live).
    page.wait_for_function(
        f"{CHART_IDS!r}.every(id => +(document.getElementById('chart-' + id).dataset.points || 0) >= 5)",
        timeout=30_000,
    )
    before = page.evaluate("window.driftline.updates")
    page.wait_for_function(f"window.driftline.updates >= {before + 2}", timeout=10_000)
    # The uPlot instances themselves hold the data (x and at least one y series with values).
    counts = page.evaluate("""() => Object.fromEntries(Object.entries(window.driftline.plots).map(
        ([id, u]) => [id, {x: u.data[0].length,
                           y: u.data.slice(1).map(ys => ys.filter(v => v != null).length)}]))""")
    assert set(counts) == set(CHART_IDS)
    for chart_id, c in counts.items():
        assert c["x"] >= 5 and max(c["y"]) >= 5, (chart_id, c)
    # the AUC chart: the model's line and the counting baseline's, both with points
    assert len(counts["auc"]["y"]) == 2 and min(counts["auc"]["y"]) >= 5, counts["auc"]
    labels = page.evaluate("() => window.driftline.plots['auc'].series.slice(1).map(s => s.label)")
    assert labels == ["deepfm", "deepfm: counting clicks"], labels
    labels = page.evaluate("() => window.driftline.plots['recent-auc'].series.slice(1).map(s => s.label)")
    assert labels == ["deepfm", "deepfm: counting recent clicks"], labels
    assert page.locator("canvas").count() >= len(CHART_IDS)
    assert page.locator(".badge.up").count() == 3
    auc = float(page.text_content("#tile-auc"))
    assert 0.5 < auc < 1
    assert page.text_content("#tile-version").strip() != "– / –"
    assert page.text_content("#tile-event-time").startswith("2000-12")
    # What is wrong now: hidden while nothing is, a line per fault flag while it is up.
    assert page.locator("#problems").is_hidden()
    fake_stack.faults(True)
    page.wait_for_function("document.querySelectorAll('#problems li').length === 2", timeout=10_000)
    assert page.locator("#problems").is_visible()
    lines = page.locator("#problems li").all_text_contents()
    assert lines[0].startswith("trainer: another consumer in the trainer's group holds 2 partitions"), lines
    assert lines[1].startswith("serving: the feature store lost the loaded features"), lines
    shot = Path(os.environ.get("DRIFTLINE_STATUS_SCREENSHOT", tmp_path / "status.png"))
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    fake_stack.faults(False)
    page.wait_for_function("document.getElementById('problems').hidden", timeout=10_000)
    assert browser_page.errors == []
