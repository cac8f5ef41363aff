"""A shared serving PS (serving/shared_model.py, serving/serving_ps.py): the worker scores exactly
what the PS holds, follows its versions, dense head and bootstraps, and a real
``python -m serving --workers 2`` answers /rank from one PS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serving_helpers import parameters

from services.ports import free_port
from serving.shared_model import PSModel, SharedModel
from trainer import snapshots
from trainer.batch import SparseBatch
from trainer.config import deepfm_config
from trainer.model import SparseModel
from trainer.sync import encode_dense, encode_sparse_tables

ROOT = Path(__file__).resolve().parents[2]
CFG = deepfm_config(dim=4, mlp=[8])


def _train(model: SparseModel, rng: np.random.Generator, steps: int, t0: int) -> None:
    for s in range(steps):
        rows = [{"user_id": [int(rng.integers(1, 50))], "gender": [int(rng.integers(0, 2))],
                 "item_id": [int(rng.integers(1, 2000))], "genres": list(map(int, rng.integers(0, 18, 2)))}
                for _ in range(64)]
        model.train_step(SparseBatch.from_slot_dicts(rows, slots=model.cfg.all_slots,
                                                     labels=rng.integers(0, 2, 64).astype(np.float32),
                                                     event_time_ms=np.full(64, t0 + s, np.int64)))


def _request(rng: np.random.Generator) -> tuple[dict, list[dict]]:
    user = {"user_id": [int(rng.integers(1, 50))], "gender": [1]}
    return user, [{"item_id": [int(i)], "genres": [3]} for i in rng.integers(1, 2000, 30)]


def test_worker_scores_what_the_ps_holds(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    trainer = SparseModel(CFG, train=True)
    ps = PSModel("deepfm", tmp_path / "ps", 64, 1 << 20, config=CFG)
    ps.loaded = lambda: True
    ps.publish_state()
    worker = SharedModel("deepfm", tmp_path / "ps", 64, 1 << 20, config=CFG)
    for version in (1, 2, 3):  # enough new rows to grow and rehash the tables
        _train(trainer, rng, 20, 1_700_000_000_000 + version * 1000)
        for _t, msg in encode_sparse_tables(CFG.model_id, version, trainer.tables):
            ps.apply_delta(msg)
        ps.apply_delta(encode_dense(CFG.model_id, version, trainer.head))
        user, items = _request(rng)
        np.testing.assert_array_equal(worker.score(user, items), ps.score(user, items))
        assert worker.sparse.versions() == ps.sparse.versions() == {"0": version}
        assert worker.dense.version == version and worker.loaded
    pw, pp = parameters(worker), parameters(ps)
    for k in pp:
        np.testing.assert_array_equal(pw[k], pp[k], err_msg=k)

    # A bootstrap publishes new tables: the worker follows the new layout.
    root = tmp_path / "snapshots"
    _train(trainer, rng, 5, 1_800_000_000_000)
    snapshots.save(root / CFG.model_id, CFG, trainer.tables, {"head": trainer.head.state_dict()},
                   {"sparse_version": 9, "dense_version": 9})
    assert ps.bootstrap(root) is not None
    user, items = _request(rng)
    np.testing.assert_array_equal(worker.score(user, items), ps.score(user, items))
    assert worker.sparse.version == 9 and worker.dense.version == 9


@pytest.mark.timeout(120)
def test_serve_with_two_workers(tmp_path: Path, redis_url: str) -> None:
    trainer = SparseModel(CFG, train=True)
    _train(trainer, np.random.default_rng(1), 10, 1_700_000_000_000)
    var = tmp_path / "var"
    snapshots.save(var / "snapshots" / CFG.model_id, CFG, trainer.tables, {"head": trainer.head.state_dict()},
                   {"sparse_version": 4, "dense_version": 4, "config": CFG.model_dump(mode="json")})
    port = free_port()
    env = dict(os.environ, DRIFTLINE_VAR_DIR=str(var), DRIFTLINE_SERVING__MODEL="deepfm",
               KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1", REDIS_URL=redis_url,
               DRIFTLINE_SERVING__PS_DIR=str(tmp_path / "ps"), DRIFTLINE_SERVING__KAFKA_RETRY_S="0.3",
               DRIFTLINE_SERVING__SPOOL_DRAIN_TIMEOUT_S="0.5", DRIFTLINE_SERVING__READY_MAX_BEHIND_S="3")
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--port", str(port), "--workers", "2"],
                            cwd=ROOT, env=env, stdout=open(tmp_path / "log", "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
            try:
                r = httpx.get(f"{url}/readyz", timeout=2)
                if r.json().get("model_loaded"):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.3)
        assert r.json()["model_version"]["sparse_version"] == 4
        for _ in range(20):
            with httpx.Client(timeout=10) as c:  # new connections: spread over the workers
                r = c.post(f"{url}/rank", json={"user_id": 3, "candidates": [{"item_id": i} for i in range(1, 20)]})
            # Kafka is down: the feature log waits in the worker's spool, /rank still answers
            assert r.status_code == 200, r.text
            assert r.json()["model_version"]["dense_version"] == 4
        assert (var / "serving" / f"spool-{port}-w0").exists() and (var / "serving" / f"spool-{port}-w1").exists()
        assert (tmp_path / "ps" / "control").exists()
        # a worker counts a request after its response is sent: let the last one land first
        until = time.monotonic() + 10
        while '{endpoint="/rank",status="200"} 20.0' not in httpx.get(f"{url}/metrics", timeout=10).text:
            assert time.monotonic() < until
            time.sleep(0.1)
        for _ in range(6):  # whichever worker answers the scrape reports the whole replica
            with httpx.Client(timeout=10) as c:
                text = c.get(f"{url}/metrics").text
            assert 'driftline_serving_model_version{kind="sparse",model_id="deepfm"} 4.0' in text
            assert 'driftline_serving_requests_total{endpoint="/rank",status="200"} 20.0' in text
            assert "driftline_serving_feature_log_spooled_total 20.0" in text
        writers = {f.stem.rsplit("_", 1)[-1] for f in (tmp_path / "ps-metrics").glob("*.db")}
        assert str(proc.pid) in writers and len(writers) >= 3  # the PS (its delta feed) and both workers
        # A hung PS (SIGSTOP) behind live workers: its rows no longer move, the workers say so.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            until = time.monotonic() + 20
            while (r := httpx.get(f"{url}/readyz", timeout=5)).status_code != 503:
                assert time.monotonic() < until, r.text
                time.sleep(0.3)
            assert r.json()["deltas_behind_s"] > 3 and r.json()["model_loaded"], r.text
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        until = time.monotonic() + 20
        while (r := httpx.get(f"{url}/readyz", timeout=5)).status_code != 200:
            assert time.monotonic() < until, r.text
            time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0, (tmp_path / "log").read_text()[-3000:]
    assert not (tmp_path / "ps").exists() and not (tmp_path / "ps-metrics").exists()

    # A PS killed -9 leaves no worker serving frozen parameters: they stop themselves.
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--port", str(port), "--workers", "2"],
                            cwd=ROOT, env=env, stdout=open(tmp_path / "log", "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while not (workers := Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()) or \
            len(workers) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(1.0)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{w}").exists() and "zombie" not in Path(f"/proc/{w}/status").read_text()
              for w in workers):
        assert time.monotonic() < deadline, "workers outlived their PS"
        time.sleep(0.3)


def test_worker_app_serves_the_ps_versions(filled_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A worker's app: 503 until the PS publishes a loaded model, then /rank and /readyz carry the
    PS's versions, and a dense delta on the PS reaches the worker's next request."""
    from serving_helpers import running, wait_ready

    from serving.app import create_app

    settings = filled_store.updated(serving={"model": "deepfm"})
    ps_dir = tmp_path / "ps"
    worker = SharedModel("deepfm", ps_dir, 64, 1 << 20, config=CFG)
    with running(create_app(settings, worker)) as base:
        body = {"user_id": 1, "candidates": [{"item_id": i} for i in range(1, 11)]}
        assert httpx.post(f"{base}/rank", json=body, timeout=10).status_code == 503
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 503
        ps = PSModel("deepfm", ps_dir, 64, 1 << 20, config=CFG)
        trainer = SparseModel(CFG, train=True)
        _train(trainer, np.random.default_rng(2), 5, 1_700_000_000_000)
        for _t, msg in encode_sparse_tables(CFG.model_id, 7, trainer.tables):
            ps.apply_delta(msg)
        ps.loaded = lambda: True
        ps.apply_delta(encode_dense(CFG.model_id, 7, trainer.head))
        ready = wait_ready(base)
        assert ready["model_version"]["sparse_version"] == 7 and ready["model_version"]["dense_version"] == 7
        r = httpx.post(f"{base}/rank", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["model_version"]["dense_version"] == 7
        ps.apply_delta(encode_dense(CFG.model_id, 8, trainer.head, sample_rates={"global": 0.25, "slices": {}}))
        r = httpx.post(f"{base}/rank", json=body, timeout=10).json()
        assert r["model_version"]["dense_version"] == 8
        # the log-odds correction uses the PS's rates: corrected != raw once a rate is known
        assert all(i["score"] < i["raw_score"] for i in r["items"])
        assert httpx.get(f"{base}/readyz", timeout=10).json()["sample_rate"]["rate"] == 0.25


async def test_a_workers_connections_send_without_nagle() -> None:
    """A worker's listening socket (``serving_ps.listen``) gives connections TCP_NODELAY: without
    it every response waited on the client's delayed ACK (48 ms per /rank, 2 workers slower than 1)."""
    import asyncio
    import socket

    from serving.serving_ps import listen

    sock = listen("127.0.0.1", 0)
    nodelay: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nodelay.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=sock)
    async with server:
        _r, w = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        await asyncio.sleep(0.2)
        w.close()
    assert nodelay and nodelay[0] != 0
