"""``driftline serve --workers N`` (N > 1): one serving PS process and N uvicorn workers.

The PS process (this one) starts the N workers (``python -m serving --worker-index i``), each of
which listens on the port with ``SO_REUSEPORT``: the kernel spreads connections over them by
hash (one shared accept socket would not: the first worker to wake accepts every waiting
connection, so 8 keep-alive clients all land on one worker). Then the PS bootstraps
the model from the snapshot and runs the one :class:`serving.deltas.DeltaFeed` of this machine
into :class:`serving.shared_model.PSModel`, whose tables live in shared memory. Workers read the
rows with no copy and no IPC per request (:mod:`serving.shared_tables`) and answer 503 until the
PS counts the model as loaded.

Each worker has its own feature-log spool (``<spool_dir>-w<i>``: RocksDB takes one writer per
database) so a 200 stays durable per worker exactly as in the single-process path, and each
worker's spool survives its restart.

The PS and the workers write their Prometheus samples to one directory, so the worker that
answers a scrape reports the whole replica (:mod:`serving.replica_metrics`).

SIGTERM/SIGINT: the workers get SIGTERM (each ships its spool and exits 0), then the feed stops
and the shared files are removed. A worker that dies takes the PS down with a non-zero exit
(the supervisor restarts the whole replica): a half-served port is worse than a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from services.settings import Settings
from serving import replica_metrics
from serving.broker_epoch import SharedEpoch
from serving.deltas import DeltaFeed
from serving.model import warm_up
from serving.shared_model import PSModel

log = logging.getLogger(__name__)


def worker_spool(settings: Settings, index: int) -> Path:
    """Worker ``index``'s own spool directory (derived from the replica's)."""
    base = settings.serving.spool_dir or settings.var_dir / "serving" / f"spool-{settings.serving.port}"
    return base.with_name(f"{base.name}-w{index}")


def listen(host: str, port: int) -> socket.socket:
    """A worker's listening socket: ``SO_REUSEPORT``, so every worker of the replica binds the port."""
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # accepted sockets inherit it. With proto 0 every response met Nagle + the client's delayed
    # ACK: 48 ms per /rank instead of 3 (bench_serving's worker_scaling was 0.46 for it).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def start_workers(settings: Settings) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-m", "serving", "--worker-index", str(i), "--ps-pid", str(os.getpid()),
                              "--port", str(settings.serving.port), "--host", settings.serving.host])
            for i in range(settings.serving.workers)]


async def _run_ps(settings: Settings, workers: list[subprocess.Popen[bytes]]) -> int:
    options = settings.serving
    root = settings.serving_ps_dir
    model = PSModel(settings.serving_model, root, options.ps_max_shards, options.ps_state_bytes)
    epochs = SharedEpoch(settings)
    feed = DeltaFeed(settings, model, settings.snapshot_root, options.kafka_retry_s, epochs=epochs)
    model.loaded = lambda: feed.loaded
    model.behind_s = feed.behind_s
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rc = 0
    try:
        await asyncio.to_thread(feed.load_snapshot)
        await asyncio.to_thread(warm_up, model)
        model.publish_state()
        feed.start()
        log.info("serving PS: %d workers on port %d, tables in %s (%.1f MB)", len(workers), options.port,
                 root, model.publisher.table_bytes() / 1e6)
        while not stop.is_set():
            dead = [w for w in workers if w.poll() is not None]
            if dead:
                log.error("serving worker %d exited with %s: stopping the replica", dead[0].pid, dead[0].returncode)
                rc = 4
                break
            model.publish_state()  # readiness and staleness move without deltas too
            try:
                await asyncio.wait_for(stop.wait(), options.ps_state_interval_s)
            except TimeoutError:
                pass
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                await asyncio.to_thread(w.wait, options.spool_drain_timeout_s + 10)
            except subprocess.TimeoutExpired:
                w.kill()
            if w.returncode not in (0, None) and rc == 0 and not stop.is_set():
                rc = 4
        await feed.stop()
        await epochs.stop()
        shutil.rmtree(root, ignore_errors=True)
        replica_metrics.remove()
    return rc


def main(settings: Settings) -> int:
    """Run the serving PS and its workers until SIGTERM/SIGINT."""
    workers = start_workers(settings)
    return asyncio.run(_run_ps(settings, workers))
