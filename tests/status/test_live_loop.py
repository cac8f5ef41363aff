"""Issue 7's acceptance, headless: `driftline up` brings the whole loop up and, within two minutes
of the banner, the status page in a real browser shows an online AUC above 0.5 and a served model
version above zero, with live charts and no console errors; the APIs agree; Ctrl-C stops it all."""

from __future__ import annotations

import time

import pytest

from tests.status.conftest import BrowserPage
from tests.test_loop import LoopStack, loop_stack  # noqa: F401 - the shared stack fixture


@pytest.mark.timeout(480)
def test_status_page_shows_the_loop_closing(loop_stack: LoopStack, browser_page: BrowserPage) -> None:  # noqa: F811
    s = loop_stack
    url = f"http://127.0.0.1:{s.status_port}/"
    assert url in s.text(), "the banner names the status page"
    page = browser_page.page
    page.goto(url, wait_until="load")
    started = time.monotonic()
    # The two numbers someone trying driftline waits for, as the page shows them.
    page.wait_for_function(
        """() => {
            const auc = parseFloat(document.getElementById('tile-auc').textContent);
            const version = document.getElementById('tile-version').textContent;
            const sparse = parseInt(version.split('/')[0]);
            return auc > 0.5 && sparse > 0;
        }""",
        timeout=120_000,
    )
    waited = time.monotonic() - started
    auc = float(page.text_content("#tile-auc"))
    sparse = int(page.text_content("#tile-version").split("/")[0])
    counts = page.evaluate("""() => Object.fromEntries(Object.entries(window.driftline.plots).map(
        ([id, u]) => [id, u.data.slice(1).map(ys => ys.filter(v => v != null).length)]))""")
    assert 0.5 < auc <= 1.0 and sparse > 0, (auc, sparse)
    assert waited < 120
    assert max(counts["auc"]) >= 1 and max(counts["version"]) >= 1, counts
    assert browser_page.errors == []
    # The APIs say the same: the trainer's online AUC and serving's model version.
    trainer_auc = s.metric("trainer", "driftline_trainer_auc", {"mode": "online"})
    assert trainer_auc is not None and trainer_auc > 0.5
    assert s.json("/readyz")["model_version"]["sparse_version"] > 0
