"""``trainer.dist_mode = "gba"`` and ``"async"``: N ranks that do not step in lockstep, over a
parameter-server design on ``torch.distributed.rpc`` (GBA, :mod:`trainer.dist.gba`).

Rank ``r`` owns shard ``r`` of every PS table, as in :mod:`trainer.dist.model`; rank 0 also owns
the dense head (the *master* head and its optimizer; every rank trains on a replica it pulls).
Each rank runs a :class:`trainer.dist.gba_server.ShardServer` for what it owns, answering pulls and pushes on RPC
threads. **One step**, on one rank, never waiting for another rank's step:

1. *plan* (:func:`trainer.dist.routing.plan`): the batch's unique ``(table, id)`` pairs in wire
   order (owner, table, id).
2. *pull*: to every owner its ids (an RPC; the own shard a local call): the owner looks them up
   (lookup-or-insert, :meth:`trainer.dist.owner.Owner.serve`, the 1-process PS's insert path) and
   returns the rows with its **token** (its global steps so far); owner 0 also returns the dense
   head when it changed since this rank's last pull, with the dense token.
3. *forward/backward* locally, loss = sum / ``global_batch`` (sync's normalisation).
4. *push* (RPC, not waited for: the next step's push waits for it): to every owner its rows'
   gradients, the example count and the token they were pulled at; owner 0 also gets the dense
   gradients. Each owner's :class:`trainer.dist.gba.TokenBuffer` sums them until they cover
   ``global_batch`` examples, then applies them once with the table's own optimizer (the dense
   head: its optimizer); stale ones are decayed or dropped there. In ``async`` every push is
   applied on arrival (the paper's baseline).

**The fresh pull** (``fresh_wait``, ``trainer.gba.fresh_wait``; not in the paper, measured here):
a free-running rank pulls while its own push still waits in the buffer for the other ranks', so
with no straggler about a third of its gradients were one step stale, a self-sustaining pattern
(bench-gba: ``staleness_mean_gba`` 0.34-0.45) that cost 0.002-0.004 of holdout AUC against sync.
So step 2 first waits, up to ``fresh_wait`` x the rank's own last step, until the global batch its
last push joined is applied (the owner's token passed it): with no straggler the ranks then learn
on fresh parameters, as in sync (staleness 0, sync's AUC), and a straggler makes the wait time
out, after which the rank pulls at once for 1, 4, 16, 64 steps (timeouts in a row; halved after
each wait that succeeds). ``fresh_wait=0`` is the paper's free-running GBA. The cost: with no
straggler the ranks wait for each other as in sync, and a step's RPCs are then on its critical
path (bench-gba: gba 0.7-0.8 x sync's rate with it, 0.9-1.0 x without).

Every owner gets every push (with no ids when the batch has none of its rows), so all owners
count the same examples and their tokens move together.

**Transport**: ``torch.distributed.rpc`` (TensorPipe, shared memory between ranks on one
machine, TCP otherwise), chosen over ``isend``/``irecv`` on a second gloo group because a pull is
a request and a reply from any rank at any time: with point-to-point the server thread would
have to match requests from any source to replies by hand, which is what RPC does.
Measured round trip between two pinned ranks on this machine (``bench/rpc_latency.py``): about
0.3-0.45 ms for 64 B and for the DeepFM head's 264 kB with shared memory (0.6-0.7 ms over TCP); a
step pulls and pushes once per remote owner.

**Equal to sync** when every rank pushes exactly one full batch per token and nothing is stale
(each rank waits for its pushes and all meet at a barrier between steps,
tests/trainer/distributed/test_gba.py): each owner then releases one global batch of the same
gradients, scaled by 1, as sync's owners apply them.

**Count and probabilistic admission**: a pull carries each id's occurrences in the batch, and
the owner's sketch counts them as sync's owners do (:meth:`trainer.dist.owner.Owner.serve`). An id
that reaches its count in the same step on two ranks is admitted by whichever rank's pull comes
first, which reads its new row while the other reads zeros (sync: the lower rank's occurrences
count first); with a zero initializer the two agree (tests/trainer/distributed/test_gba.py).

**Not here** (issue #34): sequential models, snapshots of the buffers (the online ranks flush
them before each snapshot instead, :mod:`trainer.dist.rank_trainer`). The online ranks'
rounds do not wait for each other either (:mod:`trainer.dist.rounds`).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from services.ports import free_port

from ..batch import SparseBatch
from ..config import ModelConfig
from ..model import NonFiniteStepError, SparseModel
from ..sharding import owners
from . import gba_server as srv
from .gba import MODES, GBAStats, TokenBuffer
from .gba_server import DenseOwner, ShardServer
from .model import DistributedError
from .owner import Owner
from .routing import packed_rows, plan, starts

__all__ = ["GBAModel", "shutdown_rpc", "unsupported"]

log = logging.getLogger(__name__)

_RPC_UP = [False]   # rpc.init_rpc ran in this process (and no shutdown since)


def unsupported(cfg: ModelConfig, device: str = "cpu", cache_rows: int = 0) -> str | None:
    """Why ``cfg`` cannot train as gba/async (None: it can), on ``trainer.device`` with
    ``trainer.cache_rows``."""
    if device != "cpu" or cache_rows:
        # the owners and the master head step on RPC threads, host tensors end to end: not placed yet
        return (f"gba/async train on the CPU without the cache (trainer.device = {device!r}, trainer.cache_rows = "
                f"{cache_rows}); sync and hybrid run N ranks on GPUs and with the cache")
    if cfg.sequential:
        return "gba/async: sequential models are not supported (use sync or hybrid)"
    if cfg.meta is not None:
        return "gba/async: model.meta is not supported (use sync)"
    return None


def shutdown_rpc() -> None:
    """Collective (every rank): stop RPC when a :class:`GBAModel` left it up (``close(keep_rpc=True)``:
    the online ranks switched back to sync, :mod:`trainer.dist.mode_switch`)."""
    if _RPC_UP[0]:
        rpc.shutdown()
        _RPC_UP[0] = False


class GBAModel:
    """A :class:`SparseModel` trained by N ranks without lockstep (``mode``: ``"gba"`` or
    ``"async"``). Built collectively (every rank, after ``init_process_group``); :meth:`step`
    and :meth:`predict` are not collective; :meth:`finish` and :meth:`close` are."""

    def __init__(self, cfg: ModelConfig, *, mode: str = "gba", global_batch: int, max_staleness: int = 8,
                 fresh_wait: float = 1.5, group=None, tables: dict | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized: call init_process_group first")
        if mode not in MODES:
            raise DistributedError(f"mode must be one of {MODES}, got {mode!r}")
        if (why := unsupported(cfg)) is not None:
            raise DistributedError(why)
        self.mode, self.group, self.global_batch = mode, group, global_batch
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        local = cfg.model_copy(update={"tables": [t.model_copy(update={"shards": 1}) for t in cfg.tables]})
        self.model = SparseModel(local, tables)
        self.cfg = cfg
        self._names = self.model.ps.table_names
        self._dims = np.array([self.model.tables[n].dim for n in self._names], np.int64)
        # an admission that depends on occurrences needs each id's count in the batch (as sync's)
        self._counts = any(self.model.tables[n].config.admission.min_count > 1
                           or self.model.tables[n].config.admission.probability < 1.0 for n in self._names)
        self._params = list(self.model.head.parameters())
        with torch.no_grad():  # equal replicas, and the master starts from them
            for p in self._params:
                dist.broadcast(p.data, 0, group=group)
        owner = Owner([self.model.tables[n] for n in self._names], self._names, self.rank, self.world, self.model.ps)
        dense = None
        if self.rank == 0:
            dense = DenseOwner(copy.deepcopy(self.model.head), cfg,
                               TokenBuffer(global_batch, max_staleness, mode))
        self.server = ShardServer(owner, self.world, global_batch, max_staleness, mode, dense)
        srv.install(self.server)
        srv.reset_tickets()
        if not _RPC_UP[0]:  # kept up by close(keep_rpc=True) for the next model in this process
            port = [free_port() if self.rank == 0 else 0]
            dist.broadcast_object_list(port, 0, group=group)
            opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port[0]}", num_worker_threads=4,
                                                   _transports=["shm", "uv"], _channels=["basic"])
            # under torch's elastic launcher every rank would only connect to the agent's store
            # (TORCHELASTIC_USE_AGENT_STORE), which is not at this port: rank 0 serves this one
            agent = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            try:
                rpc.init_rpc(f"gba{self.rank}", rank=self.rank, world_size=self.world, rpc_backend_options=opts)
            finally:
                if agent is not None:
                    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent
            _RPC_UP[0] = True
        dist.barrier(group=group)  # every rank's server is in place before anyone pulls
        self._dense_token: int | None = None
        self._inflight: list = []
        self.steps = 0
        self.step_s: list[float] = []
        # test knob: seconds slept between the pull and the push, as a rank slow in its compute
        # (its gradients then arrive stale; ``trainer.debug_slow_rank`` sleeps after the push)
        self.push_delay_s = 0.0
        # the fresh pull (module docstring): the tokens of the global batches this rank's last
        # pushes joined (per owner, and the head's), the seconds its last step worked (waits left
        # out), how many steps to pull without waiting, and for how many after the next timeout
        self._after: list[int] = [-1] * self.world
        self._dense_after = -1
        self._work_s = 0.0
        self._skip = 0
        self._backoff = 1
        self.fresh_wait_fraction = fresh_wait
        self.waits_timed_out = 0
        self.waits = 0
        # seconds per phase, summed over steps: "acks" (the last pushes' replies), "pull" (its
        # fresh wait included), "learn" (forward, backward), "push" (the own shard's update included)
        self.timings: dict[str, float] = {"acks": 0.0, "pull": 0.0, "learn": 0.0, "push": 0.0}
        # what the online ranks (trainer.dist.rank_trainer) read of either engine
        self.alltoall_bytes = 0          # bytes this rank pushed to other ranks' owners (ids, gradients, head)
        self.comm_s: list[float] = []    # per step: seconds in its pull and its push
        self.overlapped_updates = 0      # (hybrid's; none here)

    # ------------------------------------------------------------------ properties
    @property
    def tables(self):
        """This rank's shard of every table."""
        return self.model.tables

    @property
    def head(self):
        """The dense head: the master on rank 0, this rank's last pulled replica elsewhere."""
        return self.server.dense.head if self.server.dense is not None else self.model.head

    @property
    def optimizer(self):
        """The master head's optimizer (rank 0), None elsewhere."""
        return self.server.dense.optimizer if self.server.dense is not None else None

    @property
    def failed_updates(self) -> int:
        """Updates of this rank's shard that raised and were skipped."""
        return self.server.owner.failed_updates

    @property
    def stats(self) -> GBAStats:
        """What this rank's buffers (its shard, and on rank 0 the dense head) did."""
        return self.server.stats()

    # ------------------------------------------------------------------ the step
    def _lookup(self, batch: SparseBatch, insert: bool):
        m, n = self.model, self.world
        # the fresh pull: wait (up to fresh_wait x the own last step) for the global batch this
        # rank's last push joined; after a wait that timed out (a straggler) pull at once for a
        # while, 4x longer after each timeout in a row, half as long after each wait that was not
        wait_s = 0.0
        if insert and self.mode == "gba" and self._skip == 0:
            wait_s = self.fresh_wait_fraction * self._work_s
        self._skip = max(0, self._skip - 1)
        tp = time.perf_counter()
        pb = m.pack(batch)
        tab = np.repeat(pb.slot_table, np.diff(pb.offsets))
        p = plan(pb.ids, tab, owners(pb.ids, n), n, len(self._names))
        id_off = starts(p.counts.sum(1))
        t_event = int(batch.max_event_time)
        calls = []
        for o in range(n):
            sl = slice(int(id_off[o]), int(id_off[o] + p.counts[o].sum()))
            args = (self.rank, p.u_ids[sl], p.counts[o], t_event, insert, self._dense_token if o == 0 else -1,
                    self._after[o] if wait_s else -1, self._dense_after if wait_s and o == 0 else -1, wait_s,
                    p.occ[sl] if self._counts and insert else None)
            calls.append((o, sl, args))
        futs = {o: rpc.rpc_async(f"gba{o}", srv.pull, args=args) for o, _, args in calls if o != self.rank}
        got = {self.rank: self.server.pull(*calls[self.rank][2])}
        got.update({o: f.wait() for o, f in futs.items()})
        rows = np.concatenate([got[o][0] for o in range(n)])
        self.timings["pull"] += time.perf_counter() - tp
        if wait_s:
            self.waits += 1
            if all(got[o][4] for o in range(n)):
                self._backoff = max(1, self._backoff // 2)
            else:  # a straggler: pull at once for a while, 4x as long after each timeout in a row
                self.waits_timed_out += 1
                self._skip, self._backoff = self._backoff, min(4 * self._backoff, 64)
        dense, dtoken = got[0][2], got[0][3]
        if dense is not None:
            with torch.no_grad():
                off = 0
                for q in self._params:
                    q.copy_(dense[off:off + q.numel()].view_as(q))
                    off += q.numel()
            self._dense_token = dtoken
        rows_map = packed_rows(self._dims, p.u_tab, p.inv, tab)
        return pb, p, rows_map, rows_map.take(rows, rows_map.size), rows.size, [got[o][1] for o in range(n)], t_event

    def step(self, batch: SparseBatch):
        """Pull, learn and push one batch: ``(this batch's mean loss, its probabilities before
        the update)``. Raises :class:`NonFiniteStepError` (nothing pushed) on a non-finite loss or
        gradient; a failed remote lookup raises here too. Not collective."""
        t0 = time.perf_counter()
        m = self.model
        batch = m.complete(batch)
        if batch.size == 0:
            return 0.0, np.zeros(0, np.float32)
        pb, p, rows_map, buf, n_rows, tokens, t_event = self._lookup(batch, True)
        t1 = time.perf_counter()
        # a replica whose master has not started its bias yet (it starts at the first global batch
        # it applies) scores at the log-odds of this rank's own labels so far, not at 0: the
        # gradients it pushes then come from probabilities near the truth (DenseHead.start_bias);
        # the next pull after the master's start replaces it
        if m.head.bias_waits and batch.labels is not None:
            m.head.start_bias(float(batch.labels.sum()), batch.size)
        logits, leaves = m.forward_packed(batch, pb, buf, requires_grad=True)
        labels = batch.labels if batch.labels is not None else np.zeros(batch.size, np.float32)
        for q in self._params:
            q.grad = None
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels), reduction="sum") / self.global_batch
        loss.backward()
        self.model.head.stage_moments()  # (the dense scaler's moments travel with the head's gradients)
        gs = [w.grad.numpy().reshape(-1) if w.grad is not None else np.zeros(w.numel(), np.float32) for _, w in leaves]
        g_rows = rows_map.sum_back(np.concatenate(gs) if len(gs) > 1 else gs[0], n_rows)
        # the head's gradients, then the labels' sum and count (DenseHead.start_bias on the master)
        head = torch.cat([q.grad.reshape(-1) if q.grad is not None else torch.zeros(q.numel()) for q in self._params]
                         + [torch.tensor([float(labels.sum()), float(batch.size)])])
        value = float(loss.detach()) * self.global_batch / batch.size
        if not (math.isfinite(value) and np.isfinite(g_rows).all() and bool(torch.isfinite(head).all())):
            raise NonFiniteStepError(f"rank {self.rank}: the loss ({value}) or a gradient is not finite; nothing pushed")
        t2 = time.perf_counter()
        self.timings["learn"] += t2 - t1
        if self.push_delay_s:
            time.sleep(self.push_delay_s)
        self.wait()
        row_off = starts((p.counts * self._dims).sum(1))
        id_off = starts(p.counts.sum(1))
        local = None
        for o in range(self.world):
            ids = p.u_ids[int(id_off[o]):int(id_off[o] + p.counts[o].sum())]
            g = g_rows[int(row_off[o]):int(row_off[o] + (p.counts[o] * self._dims).sum())]
            args = (ids, p.counts[o], g, batch.size, tokens[o], t_event, head if o == 0 else None,
                    self._dense_token if o == 0 else -1)
            if o == self.rank:
                local = args
            else:
                self._inflight.append((o, rpc.rpc_async(f"gba{o}", srv.push, args=args)))
                self.alltoall_bytes += ids.nbytes + g.nbytes + (head.numel() * 4 if o == 0 else 0)
        assert local is not None
        # every owner (and the head) gets every push with the same example count, so their
        # global batches fill in step: the one this push joined on the own shard stands for all
        joined, _ = self.server.push(*local)
        self._after, self._dense_after = [joined] * self.world, joined
        t3 = time.perf_counter()
        self.timings["push"] += t3 - t2
        self.comm_s.append(t1 - t0 + t3 - t2)
        self._work_s = t3 - t1
        self.steps += 1
        self.step_s.append(time.perf_counter() - t0)
        return value, torch.sigmoid(logits.detach()).numpy()

    def wait(self) -> None:
        """Wait for this rank's pushes in flight (raises a remote owner's error here)."""
        inflight, self._inflight = self._inflight, []
        t = time.perf_counter()
        for _, f in inflight:
            f.wait()
        self.timings["acks"] += time.perf_counter() - t

    def finish(self) -> None:
        """Collective: every rank's pushes land, then every owner applies what its buffers hold
        short of a global batch: the tables and the head then hold every example learned."""
        self.wait()
        dist.barrier(group=self.group)
        self.server.flush()
        dist.barrier(group=self.group)

    flush = finish  # the online ranks' name (before a publication or a snapshot), as DistributedModel's
    @torch.no_grad()
    def predict(self, batch: SparseBatch) -> np.ndarray:
        """Probabilities for ``batch`` from the owners' current rows and the master head, nothing
        inserted or learned. Not collective."""
        batch = self.model.complete(batch)
        if batch.size == 0:
            return np.zeros(0, np.float32)
        self._dense_token = None  # the head as it is now
        pb, _, _, buf, _, _, _ = self._lookup(batch, False)
        logits, _ = self.model.forward_packed(batch, pb, buf, requires_grad=False)
        return torch.sigmoid(logits).numpy()

    def ticket(self) -> int:
        """The next number of a counter shared by the ranks (rank 0 holds it): which batch of a
        shared stream a rank takes next, so fast ranks take more (the benchmark)."""
        return srv.ticket() if self.rank == 0 else int(rpc.rpc_sync("gba0", srv.ticket))

    def ticket_later(self):
        """:meth:`ticket` as a future (``.wait()`` gives it): taken while this rank's step runs."""
        if self.rank == 0:
            f: torch.futures.Future = torch.futures.Future()
            f.set_result(srv.ticket())
            return f
        return rpc.rpc_async("gba0", srv.ticket)

    def close(self, keep_rpc: bool = False) -> None:
        """Collective: waits for every rank's RPCs; stops RPC unless ``keep_rpc`` (another
        :class:`GBAModel` follows in this process and reuses it: no new port, no new agent)."""
        self.wait()
        dist.barrier(group=self.group)
        if not keep_rpc:
            rpc.shutdown()
            _RPC_UP[0] = False
        srv.install(None)
