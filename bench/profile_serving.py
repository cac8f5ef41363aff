"""Server CPU per /rank (100 candidates) over real HTTP, and where it goes (cProfile).

``bench/profile_rank.py`` times the route's stages in process; this one runs ``python -m serving
--workers 1`` as ``bench/bench_serving.py`` does (its redis-server, tansu broker, ml-1m features
and load generator), sends ``REQUESTS`` /rank requests over ``BENCH_CONCURRENCY`` keep-alive
connections and reads the server's CPU seconds (user + system, ``/proc/<pid>/stat``) before and
after: ``cpu_ms_per_request`` is everything the serving process spent per request, HTTP, the
feature-log shipping to Kafka and the garbage collector included. CPU time, unlike latency or
throughput, hardly moves when the other cores are busy, so it compares changes on a shared machine.

``PROFILE=1`` runs the server under cProfile (which slows Python calls, so read its table for
shares, not for the CPU figure) and prints the top entries by cumulative time.
``python bench/profile_serving.py``; the last line is JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serving import CANDIDATES, cpu_s, encode_request, load, rank_requests, start, start_stack, wait_ready

REQUESTS = int(os.environ.get("REQUESTS", "3000"))
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "8"))
PROFILE = os.environ.get("PROFILE") == "1"
#: "ping": the trivial endpoint instead, the floor of uvicorn + FastAPI per request
ENDPOINT = os.environ.get("ENDPOINT", "rank")


async def drive(host: str, port: int, reqs: list[bytes], n: int) -> tuple[int, int, float]:
    """Send about ``n`` requests (closed loop); (ok, failed, seconds)."""
    started = time.perf_counter()
    ok = failed = 0
    while ok + failed < n:
        _lat, o, f = await load(host, port, reqs, 0.5, CONCURRENCY)
        ok, failed = ok + o, failed + f
    return ok, failed, time.perf_counter() - started


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="profile-serving-"))
    host = "127.0.0.1"
    procs: list[subprocess.Popen] = []
    prof = tmp / "serving.prof"
    try:
        env, _settings, sport, _load_s = start_stack(tmp, host, procs)
        profiler = [sys.executable, "-m", "cProfile", "-o", str(prof)] if PROFILE else [sys.executable]
        server = start([*profiler, "-m", "serving", "--workers", "1"], tmp / "serving.log", env)
        procs.append(server)
        wait_ready(f"http://{host}:{sport}", server, tmp / "serving.log", 90)
        reqs = rank_requests(candidates=CANDIDATES)
        if ENDPOINT == "ping":
            reqs = [encode_request("GET", "/ping", None)]
        asyncio.run(drive(host, sport, reqs, 300))  # warm-up
        cpu0 = cpu_s(server.pid)
        ok, failed, seconds = asyncio.run(drive(host, sport, reqs, REQUESTS))
        time.sleep(0.5)  # the feature logs of the last requests are shipped too
        cpu = cpu_s(server.pid) - cpu0
        server.send_signal(signal.SIGINT)
        server.wait(60)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    if PROFILE:
        pstats.Stats(str(prof)).sort_stats("cumulative").print_stats(45)
    shutil.rmtree(tmp, ignore_errors=True)
    result = dict(endpoint=ENDPOINT, cpu_ms_per_request=cpu / max(ok, 1) * 1000, requests=ok, failed=failed, rps=ok / seconds,
                  concurrency=CONCURRENCY, profiled=PROFILE)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
