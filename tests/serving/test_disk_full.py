"""Serving on a nearly full disk: a 200 means the feature log is on disk, so with its spool's disk
below ``disk.pause_below_bytes`` ``/rank`` answers 503 with the reason (nothing half-written, no
RocksDB error), ``/readyz`` says so (a balancer moves the traffic), the gauges show it, and freed
space brings it back by itself. The spool lives on a 32 MB tmpfs (``small_disk``)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client import REGISTRY

from services.settings import Settings
from serving.app import create_app
from tests.conftest import fill_disk
from tests.serving.serving_helpers import running, wait_ready


def _rank(request_id: str) -> dict:
    return {"request_id": request_id, "user_id": 1, "candidates": [{"item_id": i} for i in (1, 2, 3)]}


def test_a_full_spool_disk_is_a_503_with_the_reason_until_space_is_freed(filled_store: Settings,
                                                                         small_disk: Path) -> None:
    settings = filled_store.updated(serving=dict(spool_dir=small_disk / "spool"),
                                    disk=dict(pause_below_bytes=16 << 20, check_s=0.2))
    with running(create_app(settings)) as base:
        wait_ready(base)
        assert httpx.post(f"{base}/rank", json=_rank("before"), timeout=30).status_code == 200
        fill = fill_disk(small_disk, 4 << 20)
        time.sleep(0.3)  # (the next check_s)
        r = httpx.post(f"{base}/rank", json=_rank("full"), timeout=30)
        assert r.status_code == 503 and "nearly full" in r.json()["message"], r.text
        assert "Retry-After" in r.headers
        ready = httpx.get(f"{base}/readyz", timeout=5)
        assert ready.status_code == 503 and ready.json()["feature_log_disk_full"] is True
        assert REGISTRY.get_sample_value("driftline_disk_paused", {"service": "serving"}) == 1.0
        assert REGISTRY.get_sample_value("driftline_disk_free_bytes", {"service": "serving"}) < 16 << 20
        refused = REGISTRY.get_sample_value("driftline_serving_feature_log_refused_total", {"reason": "SpoolDiskFull"})
        assert refused and refused >= 1

        fill.unlink()
        time.sleep(0.3)
        assert httpx.post(f"{base}/rank", json=_rank("after"), timeout=30).status_code == 200
        assert wait_ready(base)["feature_log_disk_full"] is False
        assert REGISTRY.get_sample_value("driftline_disk_paused", {"service": "serving"}) == 0.0
