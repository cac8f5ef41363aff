"""What one ``torch.distributed.rpc`` round trip costs between two pinned ranks on this machine:
the transport of ``trainer.dist_mode = "gba"`` (:mod:`trainer.dist.gba_model`). Per transport
(``shm``: TensorPipe's shared memory, what two ranks on one machine get; ``uv``: TCP), the median
and p90 of an echo of 64 B, 264 kB (the DeepFM head of bench-distributed) and 800 kB, in µs.
Last line: JSON."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer  # noqa: F401  - before torch: OMP_WAIT_POLICY=PASSIVE

# isort: split
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from services.ports import free_port
from tests.trainer.distributed.rank_local import run_local


def echo(x):
    return x


def _rank(rank: int, world: int, transport: str) -> dict:
    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, 0)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port[0]}", num_worker_threads=4,
                                           _transports=[transport], _channels=["basic"])
    rpc.init_rpc(f"r{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    out = {}
    if rank == 0:
        for n in (16, 66_000, 200_000):
            x = torch.zeros(n)
            for _ in range(20):
                rpc.rpc_sync("r1", echo, args=(x,))
            ts = []
            for _ in range(200):
                t = time.perf_counter()
                rpc.rpc_sync("r1", echo, args=(x,))
                ts.append(time.perf_counter() - t)
            ts.sort()
            out[f"{transport}_{n * 4}B_us"] = [round(ts[100] * 1e6), round(ts[180] * 1e6)]
    rpc.shutdown()
    return out


def main() -> None:
    out: dict = {}
    for transport in ("shm", "uv"):
        out.update(run_local(_rank, 2, transport, timeout_s=60, pin=True)[0])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
