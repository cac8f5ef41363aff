"""Serving bench: /rank (100 candidates) vs a trivial endpoint on the same uvicorn, and under a
large parameter-delta burst.

Starts its own redis-server and tansu broker (the embedded binaries), loads the ml-1m features
into Redis, runs ``python -m serving`` in a subprocess (one uvicorn worker = one core), and drives
it from this process over keep-alive HTTP/1.1. Latency (the ``rank_p*``/``trivial_p*`` keys) is
measured one request at a time, so it compares the work per request with the framework's floor
instead of queueing behind other requests; throughput and the delta-burst run use a closed loop
of ``BENCH_CONCURRENCY`` connections (default 8), whose latencies are reported as ``*_loaded_*``.
``QUICK=1`` finishes in about a minute. With ``DRIFTLINE_SERVING__API_KEYS`` set (e.g.
``'["bench-key"]'``) the servers ask for the key and every request sends it (``api_key: true``).

Workers (issue #17): the run above is ``--workers 1`` (the single-process path, today's keys;
``rank_rps_1worker`` is its rps in the alternation below). A second server, ``--workers 2`` (one serving PS and two
uvicorn workers over its shared tables), takes the same closed-loop /rank load
(``rank_rps_2workers``, ``worker_scaling`` = their ratio; the two servers alternate three times
and the medians are kept, as the cores are shared), then a delta burst of ``table_rows``
rows: ``table_mb`` is the size of the PS's shared index + rows, ``extra_worker_rss_mb`` how much
one worker's private memory (USS: what one more worker adds, shared pages excluded) grew while the
table grew to that size, and ``worker_uss_mb`` a worker's whole private memory (python, torch,
numba: the same with any table). ``torn_reads`` is the seqlock check: a writer applies chunks
(growing and rehashing) while a reader process gathers in a loop, rows checked against their
versions.
The last line is JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from driftline.embedded import redis_command, tansu_command, wait_for_port
from proto import ParameterDelta
from proto.parameter_delta_pb2 import SparseRows
from services.api_keys import client_headers
from services.kafka import create_topics, producer, start_client
from services.ports import free_port
from services.settings import Settings
from trainer.config import SERVED_DIM

QUICK = os.environ.get("QUICK") == "1"
DURATION = 4.0 if QUICK else 15.0
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "8"))
CANDIDATES = 100
#: serving's API key when the environment sets one (DRIFTLINE_SERVING__API_KEYS: the served
#: processes inherit it): every request sends it, so the bench measures the key's check too
AUTH_HEADERS = client_headers(Settings().serving)


class Conn:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams: far less client CPU than httpx,
    which matters when the load generator shares two cores with the server."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, raw: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def encode_request(method: str, path: str, body: dict | None) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Length: {len(data)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in AUTH_HEADERS.items())
    if body is not None:
        head += "Content-Type: application/json\r\n"
    return head.encode() + b"\r\n" + data


def rank_requests(n: int = 256, candidates: int = CANDIDATES, seed: int = 0) -> list[bytes]:
    """``n`` encoded /rank requests of ml-1m users, each with ``candidates`` random ml-1m items."""
    rng = np.random.default_rng(seed)
    return [encode_request("POST", "/rank", {
        "user_id": int(rng.integers(1, 6041)),
        "candidates": [{"item_id": int(i)} for i in rng.integers(1, 3953, candidates)]}) for _ in range(n)]


async def load(
    host: str, port: int, requests: list[bytes], duration: float, concurrency: int = CONCURRENCY
) -> tuple[list[float], int, int]:
    """Closed-loop load with ``concurrency`` connections: (latencies in s, ok requests, failed)."""
    latencies: list[float] = []
    failed = 0
    stop_at = time.perf_counter() + duration

    async def worker(w: int) -> None:
        nonlocal failed
        conn = Conn(host, port)
        i = w
        try:
            while time.perf_counter() < stop_at:
                t = time.perf_counter()
                try:
                    status = await conn.request(requests[i % len(requests)])
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    failed += 1
                    await conn.close()
                    continue
                i += concurrency
                if status != 200:
                    failed += 1
                    continue
                latencies.append(time.perf_counter() - t)
        finally:
            await conn.close()

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return latencies, len(latencies), failed


def server_quantile(metrics_text: str, endpoint: str, q: float) -> float:
    """Upper bucket bound (ms) of the server-side latency quantile, over the whole run."""
    buckets: list[tuple[float, float]] = []
    for line in metrics_text.splitlines():
        if line.startswith("driftline_serving_request_seconds_bucket") and f'endpoint="{endpoint}"' in line:
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= q * total) * 1000


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q)) if xs else float("nan")


async def delta_burst(settings: Settings, rows: int, chunk: int, dim: int) -> float:
    """Publish ``rows`` random item/user rows as version-1 chunks; return the publish seconds."""
    rng = np.random.default_rng(1)
    p = producer(settings)
    await start_client(p, settings)
    started = time.perf_counter()
    n_chunks = -(-rows // chunk)
    try:
        for c in range(n_chunks):
            keys = rng.integers(1, 4000, size=chunk, dtype=np.int64) if c % 2 else \
                rng.integers(1, 6041, size=chunk, dtype=np.int64)
            keys = np.unique(keys) if c < 2 else rng.integers(10**6, 10**12, size=chunk, dtype=np.int64)
            vals = rng.normal(scale=0.1, size=(keys.size, dim)).astype("<f4")
            msg = ParameterDelta(model_id="deepfm", version=1, chunk_index=c, chunk_count=n_chunks,
                                 created_at_ms=int(time.time() * 1000),
                                 sparse=SparseRows(table="item_id" if c % 2 else "user_id", dim=dim,
                                                   keys=keys.astype("<i8").tobytes(), values=vals.tobytes()))
            await p.send(settings.topics.param_deltas, msg.SerializeToString(), key=b"deepfm")
        await p.flush()
    finally:
        await p.stop()
    return time.perf_counter() - started


def uss_mb(pid: int) -> float:
    """Private memory of ``pid`` (what it alone holds; shared mappings excluded), MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) / 1024


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _torn_reader(root: str, seconds: float, q) -> None:  # type: ignore[no-untyped-def]
    from ps import TableConfig
    from serving.shared_tables import Control, attach_tables

    control = Control(Path(root), 16, 1 << 16, write=False)
    table = attach_tables(Path(root), control, control.read_state()[1],
                          {"t": TableConfig(name="t", dim=8, initial_capacity=64).serving()})["t"]
    rng, torn, end = np.random.default_rng(), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        ids = rng.integers(0, 40_000, 256).astype(np.int64)
        rows = table.gather(ids)
        present = rows[:, 1] != 0
        torn += int((present & ((rows[:, 0] != ids) | (rows[:, 1:] != rows[:, 1:2]).any(axis=1))).sum())
    q.put(torn)


def torn_reads(root: Path, seconds: float) -> int:
    """Rows a reader process saw torn while a writer applied chunks in place (want 0)."""
    import multiprocessing as mp

    from ps import EmbeddingTable, SyncChunk, TableConfig
    from serving.shared_tables import TablePublisher

    table = EmbeddingTable(TableConfig(name="t", dim=8, initial_capacity=64).serving())
    pub = TablePublisher(root, 16, 1 << 16)
    pub.adopt({"t": table})
    pub.control.write_state({"tables": pub.layout()})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    reader = ctx.Process(target=_torn_reader, args=(str(root), seconds, q))
    reader.start()
    time.sleep(1.0)
    rng, version, end = np.random.default_rng(1), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        version += 1
        keys = np.unique(rng.integers(0, min(40_000, 500 * version), 2_000)).astype(np.int64)
        vals = np.full((keys.size, 8), version, np.float32)
        vals[:, 0] = keys
        with pub.writing("t"):
            table.apply_sync(SyncChunk(keys, vals, np.ones(keys.size, np.int64), np.empty(0, np.int64)))
    torn = int(q.get(timeout=60))
    reader.join(30)
    return torn


def wait_ready(base: str, server: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit(f"server not ready; see {log}")
        time.sleep(0.2)


def start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=ROOT)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Stop ``procs``, the last started first (SIGTERM, then SIGKILL after 10 s)."""
    for p in reversed(procs):
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def start_stack(tmp: Path, host: str, procs: list[subprocess.Popen]) -> tuple[dict[str, str], Settings, int, float]:
    """A tansu broker and a redis-server (added to ``procs``: the caller stops them), the topics,
    and ml-1m's features in Redis: (the serving process's environment, settings, the port it is
    to serve on, seconds the features took to load)."""
    bport, rport, sport = free_port(), free_port(), free_port()
    procs.append(start(tansu_command(host, bport), tmp / "tansu.log"))
    procs.append(start(redis_command(host, rport, tmp), tmp / "redis.log"))
    wait_for_port(host, bport, 20, "broker", procs[-2])
    wait_for_port(host, rport, 20, "redis", procs[-1])
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=f"{host}:{bport}", REDIS_URL=f"redis://{host}:{rport}/0",
               DRIFTLINE_SERVING__PORT=str(sport), DRIFTLINE_VAR_DIR=str(tmp / "var"),
               DRIFTLINE_LOG_LEVEL="WARNING")
    settings = Settings(kafka_bootstrap_servers=f"{host}:{bport}")
    asyncio.run(create_topics(settings))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "serving.feature_files", "load", "--movielens", "--dataset", "ml-1m",
                    "--data-dir", str(ROOT / "var" / "data")], env=env, check=True, cwd=ROOT)
    return env, settings, sport, time.perf_counter() - t


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    host = "127.0.0.1"
    procs: list[subprocess.Popen] = []
    try:
        env, settings, sport, load_s = start_stack(tmp, host, procs)
        server = start([sys.executable, "-m", "serving", "--workers", "1"], tmp / "serving.log", env)
        procs.append(server)
        base = f"http://{host}:{sport}"
        wait_ready(base, server, tmp / "serving.log", 60)

        rng = np.random.default_rng(0)
        bodies = [{"user_id": int(rng.integers(1, 6041)),
                   "candidates": [{"item_id": int(i)} for i in rng.integers(1, 3953, CANDIDATES)]}
                  for _ in range(256)]

        rank_reqs = [encode_request("POST", "/rank", b) for b in bodies]
        ping_reqs = [encode_request("GET", "/ping", None)]

        async def run() -> dict:
            async with httpx.AsyncClient(base_url=base, timeout=10, headers=AUTH_HEADERS) as client:
                await load(host, sport, rank_reqs, 1.0)  # warm-up (numba, caches)
                triv, _, triv_fail = await load(host, sport, ping_reqs, DURATION / 4, concurrency=1)
                rank, _, rank_fail = await load(host, sport, rank_reqs, DURATION / 2, concurrency=1)
                triv_loaded, triv_ok, triv_loaded_fail = await load(host, sport, ping_reqs, DURATION / 2)
                rank_loaded, rank_ok, rank_loaded_fail = await load(host, sport, rank_reqs, DURATION)
                rows = 200_000 if QUICK else 1_000_000
                burst_task = asyncio.create_task(delta_burst(settings, rows, 9_000, SERVED_DIM))
                during, during_ok, during_fail = await load(host, sport, rank_reqs, DURATION)
                publish_s = await burst_task
                ready = (await client.get("/readyz")).json()
                server_p99 = server_quantile((await client.get("/metrics")).text, "/rank", 0.99)
            return dict(
                trivial_p50_ms=pct(triv, 50), trivial_p99_ms=pct(triv, 99),
                rank_p50_ms=pct(rank, 50), rank_p99_ms=pct(rank, 99),
                trivial_loaded_p99_ms=pct(triv_loaded, 99), trivial_rps=triv_ok / (DURATION / 2),
                rank_loaded_p50_ms=pct(rank_loaded, 50), rank_loaded_p99_ms=pct(rank_loaded, 99),
                rank_rps=rank_ok / DURATION,
                candidates_per_s_per_core=rank_ok * CANDIDATES / DURATION,  # one uvicorn worker = one core
                during_delta_p50_ms=pct(during, 50), during_delta_p99_ms=pct(during, 99),
                delta_rows=rows, delta_publish_s=publish_s,
                sparse_version_after=ready["model_version"]["sparse_version"],
                rank_server_p99_ms_le=server_p99,
                failed_requests=triv_fail + rank_fail + triv_loaded_fail + rank_loaded_fail + during_fail,
                feature_load_s=load_s,
                concurrency=CONCURRENCY, candidates=CANDIDATES, duration_s=DURATION, api_key=bool(AUTH_HEADERS),
            )

        result = asyncio.run(run())

        # The same load on one serving PS with two workers, then the memory a worker adds.
        wport = free_port()
        wenv = dict(env, DRIFTLINE_SERVING__PORT=str(wport), DRIFTLINE_SERVING__PS_DIR=str(tmp / "ps"))
        shared = start([sys.executable, "-m", "serving", "--workers", "2"], tmp / "serving-2w.log", wenv)
        procs.append(shared)
        wait_ready(f"http://{host}:{wport}", shared, tmp / "serving-2w.log")
        rank_reqs_2 = rank_reqs

        async def run_workers() -> dict:
            await load(host, wport, rank_reqs_2, 1.0)  # warm-up: both workers
            workers = children(shared.pid)
            cpu0 = [cpu_s(p) for p in [shared.pid, *workers]]
            # 1 and 2 workers alternate (the cores are shared with whatever else runs): medians
            rps1, rps2, fail = [], [], 0
            served = {sport: 0, wport: 0}
            single0 = cpu_s(server.pid)
            for _ in range(3):
                for port, out in ((sport, rps1), (wport, rps2)):
                    _lat, ok, failed = await load(host, port, rank_reqs_2, DURATION / 2)
                    out.append(ok / (DURATION / 2))
                    served[port] += ok
                    fail += failed
            cpu = [round(cpu_s(p) - c, 2) for p, c in zip([shared.pid, *workers], cpu0)]
            # server CPU per /rank: whether the shared path costs more work, whatever the contention
            cpu_1 = (cpu_s(server.pid) - single0) / max(1, served[sport]) * 1000
            cpu_2 = sum(cpu) / max(1, served[wport]) * 1000
            before = [uss_mb(w) for w in workers]
            rows = 1_000_000
            await delta_burst(settings, rows, 9_000, SERVED_DIM)
            async with httpx.AsyncClient(base_url=f"http://{host}:{wport}", timeout=10, headers=AUTH_HEADERS) as client:
                deadline = time.monotonic() + 120
                while (await client.get("/readyz")).json()["model_version"]["sparse_version"] < 1:
                    if time.monotonic() > deadline:
                        raise SystemExit("the burst did not complete on the serving PS")
                    await asyncio.sleep(0.5)
            await load(host, wport, rank_reqs_2, 1.0)  # the workers read the grown tables
            after = [uss_mb(w) for w in workers]
            table_mb = sum(f.stat().st_size for f in (tmp / "ps").glob("*.rows")) / 1e6 * (1e6 / 2**20)
            return dict(workers=len(workers), rank_rps_1worker=float(np.median(rps1)),
                        rank_rps_2workers=float(np.median(rps2)), workers_failed_requests=fail,
                        table_rows=rows, table_mb=table_mb,
                        extra_worker_rss_mb=max(a - b for a, b in zip(after, before)),
                        worker_uss_mb=max(after), ps_and_worker_cpu_s=cpu,
                        cpu_ms_per_rank_1worker=cpu_1, cpu_ms_per_rank_2workers=cpu_2)

        result.update(asyncio.run(run_workers()))
        result["worker_scaling"] = result["rank_rps_2workers"] / result["rank_rps_1worker"]
        result["torn_reads"] = torn_reads(tmp / "torn", 3.0 if QUICK else 10.0)
    finally:
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)  # logs, spools and tables: ~25 MB a run
    result["p99_ratio"] = result["rank_p99_ms"] / result["trivial_p99_ms"]
    result["loaded_p99_ratio"] = result["rank_loaded_p99_ms"] / result["trivial_loaded_p99_ms"]
    for k, v in result.items():
        print(f"{k:>28}: {v:.3f}" if isinstance(v, float) else f"{k:>28}: {v}")
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
