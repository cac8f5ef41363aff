"""What gloo itself costs a distributed step on this machine: no model, only collectives.

Two pinned ranks (as ``bench_distributed.py``) time, per call and per rank, wall and CPU
(user + system, every thread) of:

* ``a2a_tiny_threads_{1,2,4}``: a 96-byte ``all_to_all_single`` on a group with 1, 2 or 4
  ProcessGroupGloo threads (the header's size);
* ``step_5_collectives``: the shape of one ``sync`` step of ``trainer.dist.model`` at
  ``bench_distributed``'s batch (header, ids, rows, then the dense swap in flight with the
  gradients on a second group);
* ``step_3_collectives``: the fewest a step could have (the header riding on the dense swap, the
  ids on the gradients' collective, the rows), for what restructuring the step could save;
* ``socket_round_trip``: a raw 48-byte ping-pong between two pinned processes over a socketpair,
  the kernel's floor under any of the above.

``QUICK=1``: fewer repeats. Last line: JSON, every value ``[wall_us, cpu_us]`` (per rank for the
collectives).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer  # noqa: F401  - before torch: OMP_WAIT_POLICY=PASSIVE

# isort: split
import torch
import torch.distributed as dist

from tests.trainer.distributed.rank_local import run_local

REPEATS = 100 if os.environ.get("QUICK") == "1" else 500
HEAD = 66_053        # the DeepFM head's floats (dim 16, MLP 256-128) plus the loss and flags
UNIQUE = 1_600       # unique (table, id) pairs per rank and owner at batch 1024
ROW_FLOATS = UNIQUE * 16 // 2


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _time(f, repeats: int) -> list[int]:
    for _ in range(repeats // 5):
        f()
    dist.barrier()
    t0, c0 = time.perf_counter(), _cpu_s()
    for _ in range(repeats):
        f()
    return [round((time.perf_counter() - t0) / repeats * 1e6), round((_cpu_s() - c0) / repeats * 1e6)]


def _ranks(rank: int, world: int, repeats: int) -> dict:
    def a2a(n, group, wait=True):
        work = dist.all_to_all_single(torch.empty(n * world), torch.zeros(n * world), group=group, async_op=True)
        return work.wait() if wait else work

    out = {}
    for threads in (1, 2, 4):
        opts = dist.ProcessGroupGloo._Options()
        opts._threads = threads
        g = dist.new_group(backend="gloo", pg_options=opts)
        out[f"a2a_tiny_threads_{threads}"] = _time(lambda g=g: a2a(12, g), repeats)
    dense, lookups = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")

    def five():
        a2a(12, lookups), a2a(UNIQUE // 2, lookups), a2a(ROW_FLOATS, lookups)
        swap = a2a(HEAD, dense, wait=False)
        a2a(ROW_FLOATS, lookups)
        swap.wait()

    def three():
        a2a(HEAD + 12, dense), a2a(ROW_FLOATS + UNIQUE // 2, lookups), a2a(ROW_FLOATS, lookups)

    out["step_5_collectives"] = _time(five, repeats // 2)
    out["step_3_collectives"] = _time(three, repeats // 2)
    return out


def _socket_round_trip(repeats: int) -> list[int]:
    a, b = socket.socketpair()
    n = repeats * 10
    if os.fork() == 0:
        os.sched_setaffinity(0, {1 % os.cpu_count()})
        for _ in range(n + n // 5):
            b.sendall(b.recv(64))
        os._exit(0)
    os.sched_setaffinity(0, {0})
    for _ in range(n // 5):
        a.sendall(b"x" * 48), a.recv(64)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        a.sendall(b"x" * 48), a.recv(64)
    os.wait()
    return [round((time.perf_counter() - t0) / n * 1e6), round((time.process_time() - c0) / n * 1e6)]


def main():
    out = {"socket_round_trip": _socket_round_trip(REPEATS)}
    res = run_local(_ranks, 2, REPEATS, pin=True)
    for key in res[0]:  # the mean of the two ranks
        out[key] = [round((res[0][key][i] + res[1][key][i]) / 2) for i in range(2)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
