"""How far ``loaded_p99_ratio`` can fall on this machine: ``/rank`` against the floor of its own
request and response.

``bench/bench_serving.py``'s ``loaded_p99_ratio`` is ``/rank``'s p99 over ``/ping``'s, each under
8 keep-alive connections on one uvicorn worker. Both queue: each request waits behind the others,
so the ratio follows the two endpoints' CPU per request. This bench measures how much of
``/rank``'s cost is its model and how much is everything else. Three servers alternate
``ROUNDS`` times under the same closed loop (bench_serving's ``load``), on their own broker,
Redis and ml-1m features (as bench_serving):

* ``rank``: ``python -m serving --workers 1``, the real ``/rank`` (``DRIFTLINE_SERVING__MODEL``
  picks the model: ``deepfm`` by default, ``lr``, or the built-in ``fm``; ``WORKERS=2``: one
  serving PS and 2 workers, ``make up``'s default, where the other two stay on one);
* ``unscored``: the same server with the model's ``score`` replaced by constants: everything
  ``/rank`` does but the model (the feature fetch, the feature log, its spool and its shipping
  to Kafka, the response);
* ``floor``: the HTTP stack alone: the same uvicorn (uvloop, httptools, through
  ``services.uvicorn_server.serve``), FastAPI, serving's metrics middleware, ``RankRequest``
  validation of the same 100-candidate bodies and a 100-item ``FastJSONResponse`` of the same
  shape, nothing between them: what no model, feature store or feature log can remove.

Medians over the rounds, per server (``<server>_...``):

* ``loaded_p99_ratio``: the server's ``/rank`` p99 over its own ``/ping`` p99, 8 connections;
* ``cpu_ms``: server CPU (user + system, ``/proc/<pid>/stat``, its workers included) per ``/rank``; ``ping_cpu_ms``:
  per ``/ping`` (the floor server's);
* ``rps``: ``/rank`` requests per second; ``ping_rps``.

``budget_ms_for_ratio_5``: the CPU per ``/rank`` at which the ratio would be 5, interpolated
linearly between the floor's and the real ``/rank``'s (ratio, CPU) points (docs/scale-out.md);
None with ``WORKERS=2``.

``QUICK=1``: 1.5 s loads (under a minute in all). Last line: JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serving import CANDIDATES, children, cpu_s, encode_request, load, pct, start, start_stack, stop_all, wait_ready
from fastapi import FastAPI

from driftline.embedded import wait_for_port
from services.ports import free_port
from serving.metrics import RequestMetrics
from serving.responses import FastJSONResponse
from serving.schemas import RankRequest, RankResponse

QUICK = os.environ.get("QUICK") == "1"
SECONDS = 1.5 if QUICK else 6.0
WORKERS = os.environ.get("WORKERS", "1")  # the real server's --workers
ROUNDS = 3


def floor_app() -> FastAPI:
    """The floor: serving's HTTP stack and ``/rank``'s schemas, no work between them."""
    app = FastAPI()
    app.add_middleware(RequestMetrics)

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/rank", response_model=RankResponse, response_class=FastJSONResponse)
    async def rank(body: RankRequest) -> FastJSONResponse:
        ids = [c.item_id for c in body.candidates]
        scores = np.linspace(1.0, 0.0, len(ids)).tolist()
        return FastJSONResponse({
            "request_id": body.request_id or "floor", "user_known": True,
            "model_version": {"model_id": "floor", "sparse_version": 0, "dense_version": 0},
            "items": [{"item_id": i, "score": s, "raw_score": s} for i, s in zip(ids, scores)]})

    return app


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (a serving PS's workers)."""
    return sum(cpu_s(p) for p in (pid, *children(pid)))


async def measure(port: int, pid: int, rank_reqs: list[bytes], ping_reqs: list[bytes]) -> dict[str, float]:
    """One round on one server: the ping load, then the rank load."""
    out: dict[str, float] = {}
    lat: dict[str, list[float]] = {}
    for name, reqs in (("ping", ping_reqs), ("rank", rank_reqs)):
        cpu0 = tree_cpu_s(pid)
        lat[name], ok, failed = await load("127.0.0.1", port, reqs, SECONDS)
        if failed:
            raise SystemExit(f"{failed} {name} requests failed on port {port}")
        out[f"{name}_cpu_ms"] = (tree_cpu_s(pid) - cpu0) / max(ok, 1) * 1000
        out[f"{name}_rps"] = ok / SECONDS
    out["ratio"] = pct(lat["rank"], 99) / pct(lat["ping"], 99)
    return out


def serve_unscored(port: int) -> int:
    """``python -m serving --workers 1`` whose model scores every candidate 0.5 (no lookup, no
    forward): what the route costs without its model."""
    import serving.fm_model
    import serving.model
    from serving.__main__ import main as serving_main

    def constant(self, user_slots, item_slots_list, dense=None):  # type: ignore[no-untyped-def]
        return np.full(len(item_slots_list), 0.5)

    serving.model.TrainerModel.score = constant  # type: ignore[method-assign]
    serving.fm_model.FMModel.score = constant  # type: ignore[method-assign]
    return serving_main(["--workers", "1", "--port", str(port)])


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        from services.uvicorn_server import serve
        serve(floor_app(), "127.0.0.1", int(sys.argv[2]), "warning")
        return
    if sys.argv[1:2] == ["serve-unscored"]:
        raise SystemExit(serve_unscored(int(sys.argv[2])))
    tmp = Path(tempfile.mkdtemp(prefix="serving-floor-"))
    procs: list[subprocess.Popen] = []
    try:
        env, _settings, sport, _ = start_stack(tmp, "127.0.0.1", procs)
        real = start([sys.executable, "-m", "serving", "--workers", WORKERS], tmp / "serving.log",
                     dict(env, DRIFTLINE_SERVING__PS_DIR=str(tmp / "ps")))
        procs.append(real)
        uport, fport = free_port(), free_port()
        unscored = start([sys.executable, __file__, "serve-unscored", str(uport)], tmp / "unscored.log",
                         dict(env, DRIFTLINE_VAR_DIR=str(tmp / "var-unscored")))  # a spool of its own
        floor = start([sys.executable, __file__, "serve", str(fport)], tmp / "floor.log", env)
        procs += [unscored, floor]
        wait_ready(f"http://127.0.0.1:{sport}", real, tmp / "serving.log", 90)
        wait_ready(f"http://127.0.0.1:{uport}", unscored, tmp / "unscored.log", 90)
        wait_for_port("127.0.0.1", fport, 30, "the floor server", floor)
        servers = {"rank": (sport, real.pid), "unscored": (uport, unscored.pid), "floor": (fport, floor.pid)}
        rng = np.random.default_rng(0)
        rank_reqs = [encode_request("POST", "/rank", {
            "user_id": int(rng.integers(1, 6041)),
            "candidates": [{"item_id": int(i)} for i in rng.integers(1, 3953, CANDIDATES)]}) for _ in range(256)]
        ping_reqs = [encode_request("GET", "/ping", None)]

        async def run() -> dict[str, list[dict[str, float]]]:
            for port, _pid in servers.values():
                await load("127.0.0.1", port, rank_reqs, 1.0)  # warm-up (numba, caches)
            rounds: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            for _ in range(ROUNDS):  # alternated: the cores are shared
                for name, (port, pid) in servers.items():
                    rounds[name].append(await measure(port, pid, rank_reqs, ping_reqs))
            return rounds

        rounds = asyncio.run(run())
    finally:
        stop_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)

    def med(server: str, key: str) -> float:
        return float(np.median([r[key] for r in rounds[server]]))

    result: dict = {"model": os.environ.get("DRIFTLINE_SERVING__MODEL", "deepfm"), "workers": int(WORKERS)}
    for name in rounds:
        result.update({f"{name}_loaded_p99_ratio": med(name, "ratio"), f"{name}_cpu_ms": med(name, "rank_cpu_ms"),
                       f"{name}_rps": med(name, "rank_rps")})
    result.update(ping_cpu_ms=med("floor", "ping_cpu_ms"), ping_rps=med("floor", "ping_rps"))
    (r0, c0), (r1, c1) = ((result["floor_loaded_p99_ratio"], result["floor_cpu_ms"]),
                          (result["rank_loaded_p99_ratio"], result["rank_cpu_ms"]))
    # both on one worker, else the two points are not on one line (None)
    result["budget_ms_for_ratio_5"] = c0 + (5 - r0) * (c1 - c0) / (r1 - r0) if WORKERS == "1" and r1 != r0 else None
    result.update(rounds=ROUNDS, seconds_per_load=SECONDS, candidates=CANDIDATES, quick=QUICK)
    for k, v in result.items():
        print(f"{k:>24}: {v:.3f}" if isinstance(v, float) else f"{k:>24}: {v}")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
