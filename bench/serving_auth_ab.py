"""What an API key costs ``/rank``: two single-worker serving processes side by side on one stack
(``bench_serving.start_stack``), one asking for a key (``serving.api_keys``) and sent it, one
not; closed-loop ``/rank`` windows (100 candidates, ``BENCH_CONCURRENCY`` connections) alternate
between them ``ROUNDS`` times, the first of each pair alternating too, so both see the same
machine load. ``bench_serving.py`` run twice (with and without ``DRIFTLINE_SERVING__API_KEYS``)
compares runs minutes apart, which a shared machine's load swamps; this compares windows seconds
apart. Per window: candidates/s and the server's CPU ms per ``/rank``; the last line is JSON with
their medians and the key's ratios (key / none; want within 5%).

    PYTHONPATH=$PWD .venv/bin/python bench/serving_auth_ab.py      # ROUNDS=10 WINDOW=3 by default
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.pop("DRIFTLINE_SERVING__API_KEYS", None)  # each server gets its own below
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving as bench

from services.ports import free_port

KEY = "bench-ab-key-51c0"
ROUNDS = int(os.environ.get("ROUNDS", "10"))
WINDOW = float(os.environ.get("WINDOW", "3"))
HOST = "127.0.0.1"


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-auth-ab-"))
    procs: list = []
    try:
        env, _settings, _port, _load_s = bench.start_stack(tmp, HOST, procs)
        servers = {}
        for mode in ("none", "key"):
            port = free_port()
            e = dict(env, DRIFTLINE_SERVING__PORT=str(port), DRIFTLINE_SERVING__SPOOL_DIR=str(tmp / f"spool-{mode}"))
            if mode == "key":
                e["DRIFTLINE_SERVING__API_KEYS"] = json.dumps([KEY])
            proc = bench.start([sys.executable, "-m", "serving", "--workers", "1"], tmp / f"{mode}.log", e)
            procs.append(proc)
            servers[mode] = (port, proc)
        for mode, (port, proc) in servers.items():
            bench.wait_ready(f"http://{HOST}:{port}", proc, tmp / f"{mode}.log")
        requests = {}
        for mode, headers in (("none", {}), ("key", {"Authorization": f"Bearer {KEY}"})):
            bench.AUTH_HEADERS = headers  # what encode_request adds
            requests[mode] = bench.rank_requests()
        windows: dict[str, list[dict]] = {"none": [], "key": []}

        async def run() -> None:
            for mode, (port, _) in servers.items():
                await bench.load(HOST, port, requests[mode], 2.0)  # warm-up (numba, caches)
            for r in range(ROUNDS):
                for mode in ("none", "key") if r % 2 == 0 else ("key", "none"):
                    port, proc = servers[mode]
                    cpu0 = bench.cpu_s(proc.pid)
                    _, ok, failed = await bench.load(HOST, port, requests[mode], WINDOW)
                    windows[mode].append(dict(candidates_per_s=ok * bench.CANDIDATES / WINDOW, failed=failed,
                                              cpu_ms_per_rank=(bench.cpu_s(proc.pid) - cpu0) / max(ok, 1) * 1000))
                    print(r, mode, {k: round(v, 3) for k, v in windows[mode][-1].items()}, flush=True)

        asyncio.run(run())
    finally:
        bench.stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict = {f"{k}_{mode}": float(np.median([w[k] for w in ws]))
                 for mode, ws in windows.items() for k in ("candidates_per_s", "cpu_ms_per_rank")}
    out["candidates_per_s_ratio"] = out["candidates_per_s_key"] / out["candidates_per_s_none"]
    out["cpu_ms_per_rank_ratio"] = out["cpu_ms_per_rank_key"] / out["cpu_ms_per_rank_none"]
    out["failed_requests"] = sum(w["failed"] for ws in windows.values() for w in ws)
    out.update(rounds=ROUNDS, window_s=WINDOW)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
