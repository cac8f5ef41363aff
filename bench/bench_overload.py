"""Overload bench: ``/rank`` at 50, 100, 200 and 500 concurrent connections against ``driftline
serve --workers 2`` with its default feature-store pool (``serving.feature_store_connections``
per process, each ``/rank`` waiting up to ``serving.feature_store_wait_s`` for one).

What it checks is issue 30's promise: overload is an error, not a wrong answer. Every user of the
traffic is in the feature store (ml-1m's, loaded first), so a 200 saying ``user_known: false``
was scored on default features; without the ``X-Driftline-Degraded`` header that is an
*unmarked* degraded answer, and it must be 0 at every level. A 503 (with ``Retry-After``) is
the allowed answer to overload. Per level: ``rps_<c>`` (200s per second), ``p99_ms_<c>`` (of
the 200s, client side), ``unavailable_<c>`` (503s), ``unmarked_degraded_<c>``. One closed loop
per level (each connection sends its next request when the last is answered), the load
generator on the same two cores as the server. ``QUICK=1``: 3 s a level. The last line is JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serving import rank_requests, start, start_stack, stop_all, wait_ready

QUICK = os.environ.get("QUICK") == "1"
DURATION = 3.0 if QUICK else 10.0
LEVELS = (50, 100, 200, 500)
CANDIDATES = 100


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return int(head[9:12]), head.lower(), await reader.readexactly(length)


async def level(host: str, port: int, requests: list[bytes], concurrency: int) -> dict[str, float]:
    ok: list[float] = []
    counts = {"unavailable": 0, "unmarked_degraded": 0, "marked_degraded": 0, "other": 0}
    stop_at = time.perf_counter() + DURATION

    async def connection(w: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        i = w
        try:
            while time.perf_counter() < stop_at:
                t = time.perf_counter()
                writer.write(requests[i % len(requests)])
                status, head, body = await answer(reader)
                i += concurrency
                if status == 503:
                    counts["unavailable"] += 1
                elif status != 200:
                    counts["other"] += 1
                elif b'"user_known":false' in body:
                    counts["marked_degraded" if b"x-driftline-degraded" in head else "unmarked_degraded"] += 1
                else:
                    ok.append(time.perf_counter() - t)
        except (OSError, asyncio.IncompleteReadError):
            counts["other"] += 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"rps": len(ok) / elapsed, "p99_ms": float(np.percentile(ok, 99) * 1000) if ok else float("nan"),
            **counts}


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    host = "127.0.0.1"
    procs = []
    try:
        env, _settings, sport, _load_s = start_stack(tmp, host, procs)
        server = start([sys.executable, "-m", "driftline.cli", "serve", "--workers", "2"], tmp / "serving.log", env)
        procs.append(server)
        wait_ready(f"http://{host}:{sport}", server, tmp / "serving.log", 120)
        requests = rank_requests(candidates=CANDIDATES)
        asyncio.run(level(host, sport, requests, 8))  # warm-up
        out: dict[str, float] = {}
        for c in LEVELS:
            r = asyncio.run(level(host, sport, requests, c))
            print(f"{c:4d} concurrent: {r}", flush=True)
            out.update({f"{k}_{c}": round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                        if k in ("rps", "p99_ms", "unavailable", "unmarked_degraded")})
        out["unmarked_degraded_answers"] = sum(out[f"unmarked_degraded_{c}"] for c in LEVELS)
        print(json.dumps(out))
    finally:
        stop_all(procs)


if __name__ == "__main__":
    main()
