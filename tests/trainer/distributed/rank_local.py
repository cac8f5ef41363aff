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


def _rank_main(rank: int, world: int, port: int, timeout_s: float, threads: int, pin: bool, jobs, results) -> None:
    """A rank of a :class:`RankPool`: joins the group, then runs ``(fn, args)`` jobs until ``None``.
    A job that raises ends the rank (its group destroyed, so a peer waiting in a collective fails
    at once instead of at the timeout)."""
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
            while (job := jobs.get()) is not None:
                fn, args = job
                results.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


class RankPool:
    """``world`` spawned processes joined by a gloo process group on 127.0.0.1 that stay up between
    calls: :meth:`run` runs ``fn(rank, world, *args)`` on every rank and returns their results by
    rank (``fn`` importable: module level). A spawn imports torch and loads the kernels, most of a
    small test's time on the suite's busy cores, so a test file's calls share one pool (the
    ``rank_pool`` fixture); a call leaves the process group as it found it (models it builds are
    closed), which every caller here does. A call that fails or times out closes the pool (a rank
    may be stuck in a collective); the next call starts new ranks. ``pin``: each rank on its share
    of the cores (:func:`trainer.dist.launch.pin_to_cores`); ``timeout_s`` bounds each collective."""

    def __init__(self, world: int, timeout_s: float = 60.0, threads: int = 1, pin: bool = False):
        self.world, self.timeout_s, self.threads, self.pin = world, timeout_s, threads, pin
        self._procs: list = []

    def _start(self) -> None:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self._procs = [ctx.Process(target=_rank_main, args=(r, self.world, port, self.timeout_s, self.threads,
                                                            self.pin, self._jobs[r], self._results), daemon=True)
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        """``fn(rank, world, *args)`` on every rank; their results by rank. Raises
        :class:`DistributedError` with the failing ranks' tracebacks, or when the ranks do not all
        finish within ``2 * timeout_s`` (default: the pool's)."""
        import queue
        if not self._procs:
            self._start()
        for q in self._jobs:
            q.put((fn, args))
        results: dict[int, object] = {}
        errors = []
        wait_s = 2 * (timeout_s or self.timeout_s)
        deadline = time.monotonic() + wait_s
        try:
            while len(results) + len(errors) < self.world:
                try:
                    rank, ok, val = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise DistributedError(f"ranks {sorted(set(range(self.world)) - set(results))} did not "
                                           f"finish in {wait_s:.0f} s") from None
                if ok:
                    results[rank] = val
                else:
                    errors.append(f"rank {rank}:\n{val}")
        except BaseException:
            self.close()
            raise
        if errors:
            self.close()
            raise DistributedError("\n".join(errors))
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop the ranks (killed if they do not stop within 5 s)."""
        for q in self._jobs if self._procs else ():
            q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


def run_local(fn, world: int, *args, timeout_s: float = 60.0, threads: int = 1, pin: bool = False) -> list:
    """:meth:`RankPool.run` on a pool of its own: fresh ranks (a benchmark's measurements start
    clean), stopped after."""
    pool = RankPool(world, timeout_s, threads, pin)
    try:
        return pool.run(fn, *args)
    finally:
        pool.close()


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
