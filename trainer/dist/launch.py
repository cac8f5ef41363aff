"""Starting N ranks of the online trainer on this machine: torch's elastic launcher, not ours.

``trainer online --nproc N`` (or ``trainer.nproc``, ``DRIFTLINE_TRAINER__NPROC``) calls
:func:`launch`: :func:`torch.distributed.launcher.api.elastic_launch` with a c10d rendezvous on a
free local port starts ``N`` worker processes (``python -m trainer online`` with the same flags;
each sees torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` environment and runs as a rank,
:func:`init_rank`). When a worker fails (an exception, or a kill -9) the launcher stops the others
and restarts the whole group, up to ``trainer.max_restarts`` times; every rank then resumes from
the last complete snapshot (:mod:`trainer.dist.rank_trainer`). Past that it fails, and ``driftline up``'s
supervisor restarts the launcher. A SIGTERM of the launcher is passed on to the workers (each
stops cleanly: the last snapshot, the offsets) and the launcher exits 0; ranks whose launcher is
gone (kill -9: nobody would restart them) stop the group after a last snapshot, and where other
machines' launchers live their ranks exit with ``trainer.dist.rank_trainer.EXIT_REGROUP`` to be restarted.
Several machines: run ``torchrun`` itself on each, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(docs/scale-out.md); the workers are the same.
"""

from __future__ import annotations

import os
import sys
import uuid
from datetime import timedelta

from services.settings import TrainerSettings


class LaunchError(RuntimeError):
    """The rank group failed more often than ``trainer.max_restarts`` allows."""


def under_launcher() -> bool:
    """Whether this process is a worker started by torchrun / the elastic launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int, argv: list[str], ts: TrainerSettings) -> None:
    """Run ``python -m trainer online *argv`` as ``nproc`` ranks until they all exit; raises
    :class:`LaunchError` when the group failed ``ts.max_restarts + 1`` times."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from services.ports import free_port

    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"driftline-{uuid.uuid4().hex[:8]}",
                       rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                       max_restarts=ts.max_restarts, monitor_interval=0.5, start_method="spawn")
    try:
        elastic_launch(cfg, sys.executable)("-u", "-m", "trainer", "online", *argv)
    except ChildFailedError as err:
        raise LaunchError(f"the trainer's {nproc} ranks failed {ts.max_restarts + 1} times: {err}") from err
    except SignalException as err:
        # the agent passed the stop on to the ranks and waited for them (each stops cleanly: last
        # snapshot, offsets); a requested stop is a clean exit, as for the 1-process trainer
        if err.sigval not in (signal.SIGTERM, signal.SIGINT):
            raise


def pin_to_cores(local_rank: int, local_world: int) -> set[int]:
    """Pin this process, every thread it has and (by inheritance) every thread it starts, to
    the ``local_rank``-th of ``local_world`` equal slices of the cores it may run on (at least
    one core each; ranks share cores when there are more ranks than cores). Returns the cores;
    an empty set where the platform cannot pin (nothing changed).

    >>> cores = pin_to_cores(0, 1)   # one rank: every core it had, nothing taken away
    >>> cores == (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set())
    True
    """
    if not hasattr(os, "sched_setaffinity"):
        return set()
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // local_world)
    start = (local_rank * per) % len(cpus)
    mine = set(cpus[start:start + per])
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity(0) moves the calling thread only
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:  # a thread that just ended
            pass
    return mine


def init_rank(ts: TrainerSettings) -> tuple[int, int]:
    """Join the gloo process group of the launcher's workers (one torch intra-op thread: the ranks
    share the cores; pinned to their share with ``trainer.pin_cores``); ``(rank, world)``."""
    import torch
    import torch.distributed as dist

    env = os.environ
    if ts.pin_cores:  # before torch and gloo start threads: they inherit the cores
        pin_to_cores(int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(1)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    timeout = timedelta(seconds=ts.collective_timeout_s)
    # The launcher's store outlives a restart of the group, and torch's env:// init does not
    # separate attempts in it (it counts on a fresh store per attempt): a restarted rank then read
    # its dead peer's gloo address and hung or was refused (seen here after a kill -9). So the
    # group's keys live under the attempt's own prefix. Without the agent's store (several
    # machines: docs/scale-out.md) rank 0 serves a new store on a new port every round, and the
    # machines' restart counts differ (one that rejoins starts at 0): no attempt in the prefix.
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=not agent and rank == 0,
                         timeout=timeout, multi_tenant=not agent)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0") if agent else "own-store"
    store = dist.PrefixStore(f"driftline/{env.get('TORCHELASTIC_RUN_ID', '')}/attempt-{attempt}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world
