"""N ranks of a function in spawned processes on this machine, joined by a gloo process group:
the engine's tests and benchmark (:mod:`trainer.dist.model`). The online trainer's ranks are
started by torch's elastic launcher instead (:mod:`trainer.dist.launch`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from services.ports import free_port
from trainer.dist.launch import pin_to_cores
from trainer.dist.model import DistributedError


def _rank_main(fn, rank: int, world: int, port: int, args: tuple, timeout_s: float, threads: int, pin: bool,
               q) -> None:
    import traceback
    from datetime import timedelta
    if pin:
        pin_to_cores(rank, world)
    torch.set_num_threads(threads)  # ranks share the cores: one intra-op thread each by default
    try:
        # the timeout bounds every collective: a rank that never arrives fails the others
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            q.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        q.put((rank, False, traceback.format_exc()))


def run_local(fn, world: int, *args, timeout_s: float = 60.0, threads: int = 1, pin: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined by a gloo process
    group on 127.0.0.1 (each pinned to its share of the cores with ``pin``: :func:`trainer.dist.launch.pin_to_cores`);
    returns their results by rank. ``fn`` must be importable (module level).
    Raises :class:`DistributedError` with the failing rank's traceback, or when ranks do not all
    finish within ``2 * timeout_s`` (the processes are then killed)."""
    import multiprocessing as mp
    import queue
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, args, timeout_s, threads, pin, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + 2 * timeout_s
    try:
        while len(results) + len(errors) < world:
            try:
                rank, ok, val = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise DistributedError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                       f"in {2 * timeout_s:.0f} s") from None
            if ok:
                results[rank] = val
            else:
                errors.append(f"rank {rank}:\n{val}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise DistributedError("\n".join(errors))
    return [results[r] for r in range(world)]


def refusals(builds) -> list[str]:
    """Each of ``builds`` (functions that build and return a model with a ``close()``, on every
    rank) tried in turn: ``"built"`` or the :class:`DistributedError` it raised."""
    out = []
    for build in builds:
        try:
            build().close()
            out.append("built")
        except DistributedError as err:
            out.append(str(err))
    return out
