"""Fake driftline services for the status page's tests: real HTTP servers serving /metrics.

:class:`MetricsServer` serves whatever text it is given (canned expositions for exact tests).
:class:`FakeStack` runs joiner, trainer and serving look-alikes whose metrics (the real names and
labels, from real ``prometheus_client`` registries) evolve on a background thread, so a browser
sees the charts move: event time runs at 600x, AUC climbs, versions tick, tables grow.
"""

from __future__ import annotations

import math
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class MetricsServer:
    """A threaded HTTP server on 127.0.0.1 answering ``GET /metrics`` with ``self.text``
    (or ``self.status`` when that is not 200). ``stop()`` closes the port (the service is down)."""

    def __init__(self, text: str | bytes | None = "", render=None) -> None:
        self.text = text
        self.render = render
        self.status = 200
        self.hits = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.hits += 1
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = server.render() if server.render else server.text
                body = body.encode() if isinstance(body, str) else body
                self.send_response(server.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeStack:
    """joiner, trainer and serving /metrics that evolve in (compressed) time."""

    # mid-December 2000 (ml-1m's time): at SPEED the page still shows December after half an
    # hour of wall time, however slowly a loaded machine gets to look at it
    EVENT_START_S = 976_950_000.0
    SPEED = 600.0

    def __init__(self, tick_s: float = 0.1, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.tick_s = tick_s
        self.started = time.time()
        self._build_joiner()
        self._build_trainer()
        self._build_serving()
        self.servers = {
            "joiner": MetricsServer(render=lambda: generate_latest(self.joiner)),
            "trainer": MetricsServer(render=lambda: generate_latest(self.trainer)),
            "serving": MetricsServer(render=lambda: generate_latest(self.serving)),
        }
        self._stop = threading.Event()
        self._step(0.0)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def targets(self) -> list[str]:
        return [f"{name}={srv.url}" for name, srv in self.servers.items()]

    def _build_joiner(self) -> None:
        r = self.joiner = CollectorRegistry()
        self.j_examples = Counter("driftline_joiner_examples_produced_total", "Examples produced.", registry=r)
        self.j_wm = Gauge("driftline_joiner_watermark_ms", "Watermark.", ["stream", "partition"], registry=r)
        self.j_wm_lag = Gauge("driftline_joiner_watermark_lag_seconds", "Lag.", ["stream", "partition"], registry=r)
        self.j_lag = Gauge("driftline_consumer_lag_messages", "Lag.", ["service", "topic", "partition"], registry=r)

    def _build_trainer(self) -> None:
        r = self.trainer = CollectorRegistry()
        self.t_auc = Gauge("driftline_trainer_auc", "AUC.", ["model", "mode"], registry=r)
        self.t_base_auc = Gauge("driftline_trainer_baseline_auc", "AUC.", ["model", "baseline"], registry=r)
        self.t_recent_auc = Gauge("driftline_trainer_recent_auc", "AUC.", ["model", "scorer"], registry=r)
        self.t_loss = Gauge("driftline_trainer_loss", "Loss.", ["model", "mode"], registry=r)
        self.t_examples = Counter("driftline_trainer_examples_total", "Examples.", ["model", "mode"], registry=r)
        self.t_delay = Histogram("driftline_trainer_sync_delay_seconds", "Delay.", ["model"],
                                 buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 300), registry=r)
        self.t_bytes = Histogram("driftline_trainer_sync_bytes", "Bytes.", ["model", "kind"],
                                 buckets=(1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9), registry=r)
        self.t_rows = Gauge("driftline_trainer_table_rows", "Rows.", ["model", "table"], registry=r)
        self.t_lag = Gauge("driftline_consumer_lag_messages", "Lag.", ["service", "topic", "partition"], registry=r)
        # a trainer of 2 ranks, both exported here (each rank has its own /metrics in a real stack)
        self.t_rank_examples = Counter("driftline_trainer_rank_examples_total", "Examples.", ["model", "rank"], registry=r)
        self.t_rank_steps = Counter("driftline_trainer_rank_steps_total", "Steps.", ["model", "rank"], registry=r)
        self.t_rank_comm = Counter("driftline_trainer_rank_comm_seconds_total", "Comm.", ["model", "rank"], registry=r)
        self.t_elsewhere = Gauge("driftline_trainer_group_partitions_elsewhere", "Partitions.", registry=r)
        self.t_places = Gauge("driftline_trainer_place_click_ratio", "Ratio.", ["model", "place"], registry=r)

    def _build_serving(self) -> None:
        r = self.serving = CollectorRegistry()
        self.s_requests = Counter("driftline_serving_requests_total", "Requests.", ["endpoint", "status"], registry=r)
        self.s_latency = Histogram("driftline_serving_request_seconds", "Latency.", ["endpoint"],
                                   buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
                                   registry=r)
        self.s_version = Gauge("driftline_serving_model_version", "Version.", ["model_id", "kind"], registry=r)
        self.s_stale = Gauge("driftline_serving_model_staleness_seconds", "Staleness.", ["model_id", "kind"], registry=r)
        self.s_emptied = Gauge("driftline_serving_feature_store_emptied", "Emptied.", registry=r)

    def faults(self, on: bool) -> None:
        """Raise (or clear) two fault flags: another consumer in the trainer's group, serving's
        feature store emptied."""
        self.t_elsewhere.set(2 if on else 0)
        self.s_emptied.set(1 if on else 0)

    def _step(self, elapsed: float) -> None:
        rng = self.rng
        event_s = self.EVENT_START_S + self.SPEED * elapsed
        now = time.time()
        for p in range(4):
            wm = event_s - rng.uniform(0, 30)
            for stream, skew in (("features", 0.0), ("actions", 20.0)):
                self.j_wm.labels(stream, str(p)).set(1000 * (wm - skew))
                self.j_wm_lag.labels(stream, str(p)).set(now - (wm - skew))
            for topic in ("features", "actions"):
                self.j_lag.labels("joiner", topic, str(p)).set(max(0, int(rng.gauss(300, 150))))
            self.t_lag.labels("trainer", "examples", str(p)).set(max(0, int(rng.gauss(150, 80))))
        n = rng.randint(150, 250)
        self.j_examples.inc(n)
        self.t_examples.labels("deepfm", "online").inc(n)
        for rank, part in enumerate((n // 2, n - n // 2)):
            self.t_rank_examples.labels("deepfm", str(rank)).inc(part)
            self.t_rank_steps.labels("deepfm", str(rank)).inc(2)
            self.t_rank_comm.labels("deepfm", str(rank)).inc(2 * rng.uniform(0.004, 0.008))
        auc = 0.5 + 0.26 * (1 - math.exp(-elapsed / 8)) + rng.gauss(0, 0.004)
        self.t_auc.labels("deepfm", "online").set(auc)
        self.t_base_auc.labels("deepfm", "counts").set(0.5 + 0.22 * (1 - math.exp(-elapsed / 5)) + rng.gauss(0, 0.004))
        self.t_recent_auc.labels("deepfm", "model").set(auc + 0.01 + rng.gauss(0, 0.006))
        self.t_recent_auc.labels("deepfm", "recent_counts").set(0.5 + 0.2 * (1 - math.exp(-elapsed / 5)) + rng.gauss(0, 0.006))
        self.t_loss.labels("deepfm", "online").set(0.69 - 0.15 * (1 - math.exp(-elapsed / 8)))
        for place in range(8):  # (the page draws the first five)
            self.t_places.labels("deepfm", str(place)).set(1 / (1 + place) + rng.gauss(0, 0.01) * (place > 0))
        version = int(elapsed / 2)
        if version != getattr(self, "_version", -1):  # one sync per fake version
            self._version = version
            for q in (rng.uniform(0.8, 1.5), rng.uniform(2, 3), rng.uniform(3, 5)):
                self.t_delay.labels("deepfm").observe(q)
            self.t_bytes.labels("deepfm", "sparse").observe(rng.uniform(2e5, 6e5))
        for table, full in (("user_id", 6040), ("movie_id", 3700), ("genre", 18), ("age", 7)):
            self.t_rows.labels("deepfm", table).set(int(full * (1 - math.exp(-elapsed / 10))) + 1)
        for _ in range(rng.randint(4, 9)):
            self.s_requests.labels("/rank", "200").inc()
            self.s_latency.labels("/rank").observe(rng.lognormvariate(math.log(0.004), 0.6))
        if rng.random() < 0.02:
            self.s_requests.labels("/rank", "503").inc()
        self.s_requests.labels("/actions", "200").inc(rng.randint(1, 3))
        self.s_version.labels("deepfm", "sparse").set(version)
        self.s_version.labels("deepfm", "dense").set(version // 5)
        self.s_stale.labels("deepfm", "sparse").set(elapsed % 2)
        self.s_stale.labels("deepfm", "dense").set(elapsed % 10)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._step(time.time() - self.started)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        for srv in self.servers.values():
            srv.stop()
