"""The online ranks' *agreement* (:mod:`trainer.dist.rank_trainer`): the control vector every rank
contributes, and, for ``trainer.dist_mode = "gba"`` / ``"async"``, rounds that do not wait for a
straggler.

**The vector** (:func:`control_vector`, int64 per rank): whether the rank was asked to stop, is
idle, saw a broker reset, its launcher is gone; the examples it learned and their max event time;
its work per step (auto's input, :mod:`trainer.dist.mode_switch`); on rank 0 the time-based sync
decisions (sparse, dense), its clock and its claim (:mod:`trainer.claim`: whether the set is
the only trainer of its examples and group). Every rank takes the same decisions from the gathered
matrix, with no further message.

**sync / hybrid**: one blocking ``all_gather`` per round (their steps are collectives anyway, so
the rounds are in lockstep whatever the agreement does).

**gba / async: the agreement in flight** (:class:`FreeAgreement`). Each rank starts an
``all_gather`` of its vector on a gloo group of its own (``async_op=True``), goes on polling and
stepping, and at each of its round boundaries looks, without blocking, whether the gather has
completed (every rank contributed). Completed, it acts on the matrix (a reset, the syncs, a
snapshot, a mode switch, a stop), then starts the next. So agreement *n* is the n-th on every
rank, whatever the number of rounds each ran meanwhile: a fast rank runs several rounds while a
straggler runs one, and the agreement completes at the straggler's pace (one per its rounds).

Why this design and not the others considered:

* *agree every K rounds*: still lockstep, only coarser: the fast rank cannot run more rounds than
  the slow one in total, so it gains nothing once the K rounds are out of phase;
* *a blocking agreement every T seconds*: the fast rank waits in each one for the straggler's
  step in progress (half a slow round on average, every T), and T trades that against the latency
  of stops, resets and syncs;
* *rank 0 decides and publishes over RPC*: stop, reset and idle are any rank's news, so they would
  need their own RPCs to rank 0, plus an ordering of decisions the ranks poll: the gather in flight
  gives that order for free (the n-th gather is the n-th decision on every rank).

What stays as it was, and why it is still safe:

* every action the matrix decides (a reset handled, a sparse / dense sync, a snapshot, a switch,
  the stop) runs on every rank after the same n-th agreement and before the next one starts, so
  none is in flight during them; those actions are collectives on the main group
  (:meth:`GBAModel.finish` flushes every owner's buffer before a publication or a snapshot), so the
  fast rank waits there for the straggler's step in progress, once per action, not per round;
* a rank contributes only examples it has stepped and booked (the counts since its last
  contribution, :class:`Tally`), so a snapshot that the agreed max event time makes due holds them;
  examples stepped after the contribution are applied and booked too: snapshots record each
  rank's applied offsets, so every example is applied once across a kill -9 as before;
* a reset: the rank that saw it steps nothing more (it polls nothing either) until the agreement
  that carries it completes; the others step until they see it (at most a slow round later; in
  lockstep they stepped until the epoch check found it, every ``epoch_check_interval_s``); the
  batch a rank holds when it sees the agreed reset is dropped, as in lockstep;
* ``max_examples``, ``stop_when_idle_s``, SIGTERM: decided on the agreed sums, so every rank
  stops after the same agreement (the ranks' last batches, stepped, are in the last snapshot).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["COLUMNS", "FreeAgreement", "Tally", "control_vector"]

# the agreed-upon control vector (int64 per rank); WORK: the rank's speed, its work per step (µs,
# trainer.dist.rank_trainer's _step; 0: not measured in this mode yet), CLOCK: rank 0's (µs since
# its run began): auto's inputs; CLAIM: rank 0's trainer.claim state (whether the set is the only
# trainer of its examples and group)
STOP, IDLE, EXAMPLES, EVENT, SYNC, DENSE, RESET, ORPHAN, WORK, CLOCK, CLAIM = range(11)
COLUMNS = CLAIM + 1


def control_vector(*, stop: bool, idle: bool, reset: bool, examples: int, event: int, orphan: bool,
                   work_us: int, due: tuple[bool, bool] | None = None, clock_us: int = 0,
                   claim: int = 0) -> torch.Tensor:
    """One rank's vector; ``due``: rank 0's (sparse, dense) sync decisions (None elsewhere), with
    its clock and claim."""
    v = torch.zeros(COLUMNS, dtype=torch.int64)
    v[STOP], v[IDLE], v[RESET], v[EXAMPLES], v[EVENT] = int(stop), int(idle), int(reset), examples, event
    v[ORPHAN], v[WORK] = int(orphan), work_us
    if due is not None:
        v[SYNC], v[DENSE] = int(due[0]), int(due[1])
        v[CLOCK], v[CLAIM] = clock_us, claim
    return v


@dataclass
class Tally:
    """What a rank stepped since its last contribution to a :class:`FreeAgreement`."""

    examples: int = 0
    event: int = 0

    def add(self, examples: int, event: int) -> None:
        self.examples += examples
        self.event = max(self.event, event)

    def take(self) -> tuple[int, int]:
        """``(examples, max event time)``, and start again from zero."""
        got = (self.examples, self.event)
        self.examples, self.event = 0, 0
        return got


class FreeAgreement:
    """At most one ``all_gather`` of control vectors in flight on ``group`` (its own gloo group:
    the main group's collectives, a snapshot's, run beside it). Built collectively."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world
        self._work = None
        self._out: list[torch.Tensor] = []
        self.started = 0     # agreements started (the n-th is the same on every rank)
        self.waited_s = 0.0  # seconds this rank blocked on one (it had nothing else to do)

    @property
    def pending(self) -> bool:
        return self._work is not None

    def start(self, mine: torch.Tensor) -> None:
        assert self._work is None, "one agreement in flight at a time"
        self._out = [torch.zeros_like(mine) for _ in range(self.world)]
        self._work = dist.all_gather(self._out, mine, group=self.group, async_op=True)
        self.started += 1

    def ready(self) -> np.ndarray | None:
        """The gathered ``[world, COLUMNS]`` when every rank contributed (then none is in flight),
        else None. Never blocks (a failed gather, a rank gone, raises here)."""
        if self._work is None or not self._work.is_completed():
            return None
        self._work.wait()
        self._work = None
        return torch.stack(self._out).numpy()

    async def wait(self, timeout_s: float) -> np.ndarray | None:
        """:meth:`ready`, waiting up to ``timeout_s`` for it without blocking the event loop (a rank
        with nothing to step: the consumer's fetches and the commits go on meanwhile)."""
        t0 = time.monotonic()
        end = t0 + timeout_s
        while (got := self.ready()) is None and self.pending and time.monotonic() < end:
            await asyncio.sleep(0.002)
        self.waited_s += time.monotonic() - t0
        return got
