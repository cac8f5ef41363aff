"""Serving with Kafka credentials it cannot use: the password shows nowhere it answers or logs."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from serving_helpers import running, wait_ready
from test_rank import rank_body

from services.settings import Settings
from serving.app import create_app
from serving.fm_model import FMModel
from tests.test_kafka_security import PASSWORD, sasl_settings


def test_serving_shows_the_password_nowhere(filled_store: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """A replica whose feature log and delta feed cannot authenticate: it still answers /rank from
    its spool; /readyz, /metrics, /actions' 503 and every log record hold no password."""
    s = sasl_settings(filled_store).updated(serving=dict(kafka_retry_s=0.3, spool_drain_timeout_s=0.2))
    model = FMModel(dim=s.serving.embedding_dim)
    model.sparse.version, model.dense.version = 5, 2
    model.save_snapshot(s.snapshot_root)
    caplog.set_level(logging.DEBUG)
    with running(create_app(s)) as base:
        wait_ready(base)  # (its snapshot)
        time.sleep(1.0)  # a few failed connections of the feature log and the delta feed
        answers = [httpx.get(f"{base}/readyz", timeout=5), httpx.get(f"{base}/metrics", timeout=5),
                   httpx.post(f"{base}/rank", json=rank_body(), timeout=10),
                   httpx.post(f"{base}/actions", json={"actions": [{"request_id": "r", "item_id": 1,
                                                                    "action_type": "click"}]}, timeout=10)]
    assert answers[0].json()["feature_log_connected"] is False and answers[2].status_code == 200
    assert answers[3].status_code == 503 and "Kafka unavailable" in answers[3].text
    assert "UnsupportedSaslMechanism" in caplog.text
    assert not [r.url for r in answers if PASSWORD in r.text] and PASSWORD not in caplog.text
