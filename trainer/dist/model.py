"""Distributed training over ``torch.distributed``: sparse model parallel, dense data parallel.
(Over 450 lines because one step's phases, planned, looked up, exchanged, updated and, in hybrid,
deferred, share the engine's state and read best in the order a step runs them; what stands alone
is apart already: :mod:`trainer.dist.routing`, :mod:`trainer.dist.owner`, :mod:`trainer.dist.sequential`.)

N ranks train one model. Rank ``r`` owns shard ``r`` of every PS table (the ids with
:func:`trainer.sharding.shard_of` ``(id, N) == r``: the PS's own shard hash) and a full replica of
the dense head. Every rank reads its own batches. Only ``torch.distributed`` collectives are used
(gloo on CPU): no RPC of our own.

**One step** (mode ``sync``), on every rank, in this order:

1. *plan* (:mod:`trainer.dist.routing`): the batch's ids (salted and packed as
   :class:`trainer.model.SparseModel` packs them) are deduplicated per ``(table, id)`` and sorted
   by ``(owner, table, id)``: that order is the wire order, so no per-id table tag is sent.
2. *header* (``all_to_all_single``, equal splits): to each owner, ``int64 [T + 3]``: how many
   unique ids of each of the T tables it will get, the local batch size, the local max event
   time and whether planning failed here (the rank then takes part with no ids). Everyone then knows its uneven split sizes, the global batch size (the loss is a mean
   over the *global* batch) and the global event time (the 1-process step's ``max_event_time``).
3. *ids* (``all_to_all_single``, uneven): the unique ids to their owners (plus, when a table has
   count admission or probabilistic admission, each id's occurrence count in the batch: the
   owner repeats the id so its sketch counts what the 1-process PS counts; an id admitted by this
   very batch then reads its new row at every position, where the 1-process PS reads zeros at the
   occurrences before the admitting one: deduplication cannot tell positions apart).
4. *lookup* (:mod:`trainer.dist.owner`): each owner runs, per table,
   ``EmbeddingTable.gather(insert=True)`` (admission, lookup-or-insert): exactly the 1-process
   PS's insert path. A gather that raises names the requesters whose ids fail (step 7).
5. *embeddings* (``all_to_all_single``, uneven): float32 rows back, in the order they came.
6. *forward/backward* locally (:meth:`SparseModel.forward_packed`), loss = sum / global batch.
7. *dense* (a sum over the ranks of one flat buffer: ``all_reduce``, with 2 ranks one
   ``all_to_all`` swap, :meth:`DistributedModel._start_sum`): the head's gradients plus the loss sum and one
   failure flag per rank, so every rank takes the same decision: when a rank's part of the step
   failed (its loss or a gradient not finite, its planning, forward or backward raised, or an
   owner's lookup raised on its ids: :class:`OwnerLookupError`), every
   rank raises :class:`RankStepError` naming the failed ranks, before anything is applied
   anywhere (no rank is left waiting in a collective; :func:`trainer.isolate.train_isolating_ranks`
   then finds the examples). Summing ``d(sum/B_global)`` over ranks is the gradient of the
   1-process mean loss on the concatenated batch.
8. *gradients* (``all_to_all_single``, the embeddings' splits reversed, on the lookups' group
   while step 7's all-reduce is in flight on the other: the two overlap): per unique id the sum
   of its rows' gradients, to the owner; once step 7 has agreed, the owner steps every
   table's part with the table's optimizer (``apply_gradients`` sums an id's parts first; one that
   raises is skipped and counted, :attr:`DistributedModel.failed_updates`: the step is agreed).
9. the dense optimizer steps on every replica (same gradients: replicas stay equal; rank 0's
   initial head is broadcast once).

So an N-rank ``sync`` run equals a 1-process run on the concatenated global batch, up to float
summation order (and the admitting batch of an id, step 3) (tests/trainer/distributed/test_distributed.py checks rows, PS optimizer state and Adam's
state). An idle rank (empty batch) takes part in every collective; a step whose global batch is
empty is skipped by all ranks together.

**Sequential models** (``ModelConfig.sequential``): the first-order tables live whole on rank 0
(:func:`trainer.sharding.whole_tables`) and are left out of steps 3-5 and 8; in step 6 each rank
runs its deep part forward, rank 0 runs the first-order pass over the global batch and returns
each rank its residuals, and each rank back-propagates them (:mod:`trainer.dist.sequential`).
With ``sequential_embeddings`` the embedding tables live whole on rank 0 too, rank 0's pass
learns their rows as well and step 8 does not run (nothing is left for it).
The result equals the 1-process sequential step on the concatenated batch (same test as above).
In ``hybrid`` the first-order pass stays synchronous (fresh); only the embeddings are stale.

**Wire**: bytes per example and per step in :mod:`trainer.dist.routing`.

**Mode** ``hybrid`` (PERSIA): steps 2-5 of batch ``t+1`` (the lookup) run in a background thread,
on a second process group, while batch ``t`` does its forward, backward and updates, and step 8
of batch ``t`` (the gradients to their owners and the owners' updates) is queued on the same
thread right behind the lookups already in flight: it overlaps the forward and backward of
``t+1``. A looked-up row therefore misses the updates of at most ``staleness`` earlier steps
(``staleness`` lookups in flight), and the tables are only touched by that one thread, in the
same order on every rank. The dense part stays synchronous. Use :meth:`DistributedModel.train`
(an iterator over batches) to get the overlap; every rank must give it the same number of
batches (empty ones for an idle rank). A caller with one batch at a time uses
:meth:`DistributedModel.step` (the same order of lookups and updates; the step's own update
waits for the next call) and :meth:`DistributedModel.flush` before it reads the tables. With
``staleness`` 1 this equals a 1-process run applying each step's sparse update one step late
(tests/trainer/distributed/test_distributed.py); what that costs in AUC: ``docs/scale-out.md``. With
``staleness`` 0, :meth:`DistributedModel.step` queues a step's update ahead of the next lookup:
``sync``'s results, the update overlapping what the caller does between steps.

The online trainer's ranks (:mod:`trainer.dist.rank_trainer`, launched by :mod:`trainer.dist.launch`) step it one
batch per round (:meth:`DistributedModel.step`); their snapshots and deltas name shards by
:func:`trainer.sharding.shard_of`.

**Device and cache** (issue 35): ``device`` puts each replica of the head and its optimizer on the
rank's device, with step 7's sum on a group of its own (NCCL on CUDA: :mod:`trainer.dist.placement`);
steps 2-5 and 8 stay on gloo with host arrays. ``cache_rows``: each owner's hot rows on its device,
served and stepped there in steps 4 and 8 (:mod:`trainer.dist.owner_cache`), written back by
:meth:`DistributedModel.flush` (and at the end of :meth:`DistributedModel.train`).

**Not here yet** (issue #14): the dense sum waits for the whole backward (no per-layer overlap); TTL
watermarks move only on owners that got ids of a table in a step (the 1-process PS moves a
single-shard table's watermark every step).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch import SparseBatch
from ..config import ModelConfig
from ..device import Transfers
from ..model import NonFiniteStepError, SparseModel
from ..sharding import owners, whole_tables
from ..torch_quirks import backward
from . import sequential as seq
from .content import ContentStore, OwnerEncoder
from .meta import RankMeta
from .owner import Owner
from .owner_cache import OwnerCache
from .placement import dense_group, rank_device
from .routing import Lookup, packed_rows, plan, wire_tables

log = logging.getLogger(__name__)

MODES = ("sync", "hybrid")


class DistributedError(RuntimeError):
    """Distributed training misuse: no process group, unknown mode, bad staleness."""


class OwnerLookupError(RuntimeError):
    """An owner's lookup (admission, lookup-or-insert) raised on this rank's ids: this rank's
    part of the step failed (the owner logs the underlying error)."""


class RankStepError(RuntimeError):
    """A step failed on the ranks ``failed`` (raised on *every* rank together, nothing applied
    anywhere); ``local``: this rank's own error (what its batch did), None when its batch was fine.
    Which examples fail is then found by :func:`trainer.isolate.train_isolating_lockstep`."""

    def __init__(self, failed: list[int], local: Exception | None):
        super().__init__(f"the step failed on rank(s) {failed}" + (f": {local!r}" if local is not None else ""))
        self.failed, self.local = failed, local


class DistributedModel:
    """A :class:`SparseModel` whose tables are sharded over the ranks of ``group`` (the default
    process group when None). Call collectively: every rank builds one, then every rank calls
    :meth:`train_step` (or :meth:`train`) the same number of times.

    ``device`` (``trainer.device``): where each rank's replica of the dense head and its optimizer
    live (``"cuda"``: ``cuda:LOCAL_RANK``; the dense sum then on an NCCL group of its own:
    :mod:`trainer.dist.placement`); the shards stay on the host. ``cache_rows``
    (``trainer.cache_rows``): each owner's hot rows on its device (:mod:`trainer.dist.owner_cache`).
    ``content`` (a model with ``cfg.content``): the items' content, for the encoder to run on each
    item's owner (:mod:`trainer.dist.content`; ``content_mode``: ``"row"``, its output added to the
    item rows the owner sends, ``"owners"``, sent in an exchange of its own, ``"raw"``, the owner
    sends the content to the requester instead); None: each rank encodes its batches' own content slot."""

    def __init__(self, cfg: ModelConfig, *, mode: str = "sync", staleness: int = 1, group=None,
                 tables: dict | None = None, device: str | torch.device = "cpu", cache_rows: int = 0,
                 cache_admit_after: int = 2, content: ContentStore | None = None, content_mode: str = "row"):
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized: call init_process_group first")
        if mode not in MODES:
            raise DistributedError(f"mode must be one of {MODES}, got {mode!r}")
        if staleness < 0:
            raise DistributedError(f"staleness must be >= 0, got {staleness}")
        self.mode, self.staleness, self.group = mode, staleness, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        dev = rank_device(device, self.rank)
        if dev.type != "cpu" and cfg.sequential:
            # rank 0's first-order pass and its residuals are host arrays end to end
            raise DistributedError(f"trainer.device = {str(device)!r}: a sequential model's ranks train on the "
                                   "CPU (sequential off runs N ranks on GPUs)")
        if cfg.content is not None and cfg.sequential_embeddings:
            # rank 0's pass takes the MLP's slopes without the content field (trainer.content)
            raise DistributedError("model.content: N ranks train it with sequential_embeddings off")
        # one local shard per table: this rank's rows are shard `rank` of an N-shard table
        # already, and a second split by the same hash would be lopsided (trainer.sharding)
        local = cfg.model_copy(update={"tables": [t.model_copy(update={"shards": 1}) for t in cfg.tables]})
        self.model = SparseModel(local, tables, device=dev)  # tables: this rank's restored shard
        self.io = self.model.io
        self.cfg = cfg
        self._names = self.model.ps.table_names
        self._tables = [self.model.tables[n] for n in self._names]
        self._dims = np.array([t.dim for t in self._tables], np.int64)
        # the owner's cache copies on its own Transfers: in hybrid the owner runs on the lookup thread
        self._cache = (OwnerCache(self.model.make_cache(cache_rows, cache_admit_after, Transfers(dev)))
                       if cache_rows else None)
        self._owner = Owner(self._tables, self._names, self.rank, self.world, self.model.ps, self._cache)
        # a sequential model's first-order tables live whole on rank 0 (trainer.dist.sequential)
        whole = whole_tables(cfg)
        self._whole = np.array([n in whole for n in self._names], bool)
        self._seq = cfg.sequential
        # sequential embeddings learn inside rank 0's pass: no per-batch sparse gradients (step 8)
        self._seq_emb = cfg.sequential_embeddings
        # an admission that depends on occurrences needs each id's count in the batch
        self._counts = any(t.config.admission.min_count > 1 or t.config.admission.probability < 1.0
                           for t in self._tables)
        self._params = [p for p in self.model.head.parameters()]
        self._content = None
        if content is not None and cfg.content is not None:
            if dev.type != "cpu":
                raise DistributedError("content on the owners: the ranks train on the CPU")
            if content_mode == "row" and mode != "sync":
                # the owner needs the rows' gradients before the dense sum (trainer.dist.content)
                raise DistributedError(f"content_mode 'row' trains in sync, not {mode!r} (use 'owners')")
            try:
                self._content = OwnerEncoder(self.model, content, self.rank, self.world, content_mode)
            except ValueError as err:
                raise DistributedError(str(err)) from err
            self.model.content_source = self._content
        self._row_content = self._content is not None and self._content.mode == "row"
        # the dense sum's group: NCCL when every rank is on CUDA, else `group` (gloo)
        self.dense_group = dense_group(dev, group, DistributedError)
        with torch.no_grad():  # equal replicas even if a head was built from another seed
            for p in self._params:
                dist.broadcast(p.data, 0, group=self.dense_group)
        # lookups and sparse gradients on a group of their own (gloo: host arrays), the dense
        # all-reduce on `dense_group`: sync sends a step's sparse gradients while its all-reduce is
        # in flight, and hybrid runs lookups in their own thread; either way the two never
        # interleave on one group (gloo matches collectives by issue order per group)
        self._lookup_group = dist.new_group(backend="gloo")
        self._meta = None
        if cfg.meta is not None:  # meta-learned starting points (trainer.dist.meta)
            if mode != "sync" or cache_rows:
                raise DistributedError(f"model.meta on N ranks trains in sync without the owner cache (mode {mode!r}, "
                                       f"cache_rows {cache_rows})")
            try:
                self._meta = RankMeta(self, self._lookup_group)
            except ValueError as err:
                raise DistributedError(str(err)) from err
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dist-lookup") if mode == "hybrid" else None
        self._lock = threading.Lock()
        self.alltoall_bytes = 0   # bytes this rank sent to other ranks through all_to_all
        self.allreduce_bytes = 0  # the dense all-reduce's share (ring estimate)
        self.comm_s: list[float] = []   # per step: seconds in collectives (lookup + gradients)
        self.sparse_comm_s = 0.0        # hybrid: in the gradients' all_to_all, on the lookup thread
        self._sparse_steps: deque = deque()  # hybrid: gradient exchanges queued behind the lookups
        self._deferred: deque = deque()      # hybrid step(): (lookup, gradients) not queued yet
        self.overlapped_updates = 0          # sparse updates run on the lookup thread (hybrid)
        self.steps = 0

    @property
    def failed_updates(self) -> int:
        """Owner updates that raised and were skipped (:mod:`trainer.dist.owner`)."""
        return self._owner.failed_updates

    @property
    def head(self):
        return self.model.head

    @property
    def tables(self):
        """This rank's shard of every table (name -> :class:`ps.EmbeddingTable`)."""
        return self.model.tables

    @property
    def optimizer(self):
        return self.model.optimizer

    @property
    def cache(self):
        """This owner's :class:`trainer.mixcache.MixCache` (None without ``cache_rows``)."""
        return self._cache.cache if self._cache is not None else None

    @property
    def transfers(self) -> tuple[Transfers, ...]:
        """The host/device copiers: the model's (rows in, gradients out) and the owner cache's."""
        return self.model.transfers + ((self.cache.io,) if self.cache is not None else ())

    def write_back(self) -> int:
        """Copy the owner cache's stepped rows to this rank's shard; the rows (part of :meth:`flush`)."""
        return self._cache.write_back() if self._cache is not None else 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ------------------------------------------------------------------ collectives
    def _a2a(self, send: np.ndarray, send_splits, recv_splits, group) -> np.ndarray:
        out = torch.empty(int(sum(recv_splits)), dtype=torch.from_numpy(send[:0]).dtype)
        dist.all_to_all_single(out, torch.from_numpy(np.ascontiguousarray(send)), [int(x) for x in recv_splits],
                               [int(x) for x in send_splits], group=group)
        with self._lock:  # what a rank sends itself is no traffic
            self.alltoall_bytes += (send.size - int(send_splits[self.rank])) * send.itemsize
        return out.numpy()

    # ------------------------------------------------------------------ steps 1-5
    def _lookup(self, batch: SparseBatch, insert: bool = True) -> Lookup:
        t0 = time.perf_counter()
        m, n, T, g = self.model, self.world, len(self._names), self._lookup_group
        error = None
        # training a sequential model: the first-order ids go to rank 0's pass, not to owners
        seq_train = self._seq and insert
        try:
            batch = m.complete(batch)
            pb, lin = self._pack(batch, seq_train)
        except Exception as err:  # noqa: BLE001 - one rank's bad batch: every rank learns of it (header)
            error = err
            batch = m.complete(batch.select(np.zeros(0, np.int64)))
            pb, lin = self._pack(batch, seq_train)
        tab = np.repeat(pb.slot_table, np.diff(pb.offsets))
        p = plan(pb.ids, tab, owners(pb.ids, n, self._whole[tab]), n, T)
        counts = p.counts
        header = np.empty((n, T + 4), np.int64)
        header[:, :T] = counts
        header[:, T] = batch.size
        header[:, T + 1] = batch.max_event_time
        header[:, T + 2] = error is not None
        header[:, T + 3] = 0 if lin is None else lin.ids.size + (pb.ids.size if self._seq_emb else 0)
        tc = time.perf_counter()
        got = self._a2a(header.reshape(-1), [T + 4] * n, [T + 4] * n, g).reshape(n, T + 4)
        rcounts = got[:, :T]                        # [source, table]: ids this rank owns
        global_size, t_event = int(got[:, T].sum()), int(got[:, T + 1].max())
        r_ids = self._a2a(p.u_ids, counts.sum(1), rcounts.sum(1), g)
        if self._counts:
            r_occ = self._a2a(p.occ, counts.sum(1), rcounts.sum(1), g)
        comm = time.perf_counter() - tc
        r_tab = wire_tables(rcounts)
        new_tasks, meta_failed = None, None
        if self._meta is not None and insert:  # new task ids: their start, before they are served
            new_tasks, meta_failed = self._meta_start(r_ids, rcounts, r_tab, counts, p, t_event)
        reply, owned, served_failed = self._owner.serve(r_ids, r_occ if self._counts else None, rcounts, r_tab,
                                                        t_event, insert)
        if self._row_content:
            served_failed = self._content_rows(reply, r_ids, rcounts, r_tab, insert, served_failed)
        if meta_failed is not None:
            served_failed = served_failed | meta_failed
        back_splits = (rcounts * self._dims).sum(1)
        row_splits = (counts * self._dims).sum(1)
        tc = time.perf_counter()
        rows = self._a2a(reply, back_splits, row_splits, g)
        comm += time.perf_counter() - tc
        rows_map = packed_rows(self._dims, p.u_tab, p.inv, tab)  # reused by the backward
        buf = rows_map.take(rows, rows_map.size)
        m.timings["lookup"] += time.perf_counter() - t0 - comm
        return Lookup(batch, pb, buf, rows_map, rows.size, list(row_splits), list(back_splits), owned,
                       global_size, t_event, comm, error, bool(got[:, T + 2].any()), served_failed,
                       lin, got[:, T].tolist(), got[:, T + 3].tolist(), new_tasks)

    def _meta_start(self, r_ids, rcounts, r_tab, counts, p, t_event: int):
        """Step 4's ``model.meta`` part (:mod:`trainer.dist.meta`): the owner starts the new task
        ids, then each requester learns which of its own were new (collective). If the start
        raises, the requesters of the task table are named like an owner's failed lookup.
        Returns ``(this rank's new task ids, the requesters to name or None)``."""
        m, failed = self._meta, None
        try:
            flags = m.start(r_ids, r_tab, t_event)
        except Exception as err:  # noqa: BLE001 - named to the requesters, isolated in lockstep
            log.error("rank %d: model.meta's start of new ids failed: %r", self.rank, err)
            t0 = m.part_tables[0]
            flags = np.zeros(int(rcounts[:, t0].sum()), bool)
            failed = rcounts[:, t0] > 0
        return m.new_tasks(flags, rcounts, counts, p.u_ids, p.u_tab), failed

    def _content_rows(self, reply, r_ids, rcounts, r_tab, insert: bool, served_failed: np.ndarray) -> np.ndarray:
        """Step 4's ``row`` content: the encoder's output added to the served item rows
        (:meth:`trainer.dist.content.OwnerEncoder.add_to_rows`). If it raises, the requesters of
        item rows are named like an owner's failed lookup: the step fails everywhere, nothing hangs."""
        try:
            self._content.add_to_rows(reply, r_ids, r_tab, self._dims, self._names,
                                      insert and torch.is_grad_enabled())
        except Exception as err:  # noqa: BLE001 - named to the requesters, isolated in lockstep
            log.error("rank %d: the content encoder failed on its items: %r", self.rank, err)
            served_failed = served_failed | (rcounts[:, self._names.index(self._content.table)] > 0)
        return served_failed

    def _pack(self, batch: SparseBatch, seq_train: bool):
        """``(what the owners look up, the first-order ids for rank 0's pass or None)``."""
        m = self.model
        full = m.pack(batch)
        if not seq_train:
            return full, None
        k = len(m._emb_block.keys) if m._emb_block is not None else 0
        return full.segments(0, k), full.segments(k, len(full.slots))

    # ------------------------------------------------------------------ steps 6-9
    def _local(self, lk: Lookup):
        """Forward and backward of this rank's examples: ``(loss sum / global size, probs, per
        unique row the sum of its gradients)``; raises when any of it is not finite here."""
        m = self.model
        logits, leaves = m.forward_packed(lk.batch, lk.pb, lk.buf, requires_grad=True)
        labels = lk.batch.labels if lk.batch.labels is not None else np.zeros(lk.batch.size, np.float32)
        # a sum over the local examples / the global size: summed over ranks it is the 1-process
        # mean loss of the concatenated batch (and an idle rank's empty sum is 0, not NaN)
        loss = (F.binary_cross_entropy_with_logits(logits, m.io.to_device(labels), reduction="sum")
                / max(lk.global_size, 1))
        loss.backward()
        gs = [m.io.to_host(w.grad).reshape(-1) if w.grad is not None else np.zeros(w.numel(), np.float32)
              for _, w in leaves]
        gpacked = np.concatenate(gs) if len(gs) > 1 else gs[0]
        # per unique row, the sum of its positions' gradients (float64 accumulation)
        g_rows = lk.rows_map.sum_back(gpacked, lk.n_rows)
        value = float(loss.detach())
        if not (math.isfinite(value) and np.isfinite(g_rows).all()):
            raise NonFiniteStepError(f"the step's loss ({value}) or sparse gradients are not finite on rank "
                                     f"{self.rank}; nothing applied")
        return value, m.io.to_host(torch.sigmoid(logits.detach())), g_rows

    def _local_sequential(self, lk: Lookup, error: Exception | None):
        """:meth:`_local` of a ``sequential`` model, ``(loss, probs, g_rows or None, error)``: the
        deep part's forward, rank 0's first-order pass over the global batch
        (:mod:`trainer.dist.sequential`; collective, so every rank takes part whatever failed
        before), then the deep part's backward from this rank's residuals. Never raises."""
        m = self.model
        blocks = [m._emb_block, m._lin_block] if self._seq_emb else [m._lin_block]
        pbs = [lk.pb, lk.lin] if self._seq_emb else [lk.lin]
        slots = [s for b in blocks for s in b.slots]
        n_slots, B = len(slots), lk.batch.size
        n_emb = len(m._emb_block.slots) if self._seq_emb else 0
        width = n_emb * m._emb_block.dim if self._seq_emb else 0
        fwd = None
        if error is None:
            try:
                jac, slopes = None, None
                if self._seq_emb:
                    slopes = m.mlp_part(lk.batch, lk.pb, lk.buf)
                    logits, jac, leaves = slopes.logits, slopes.jac, []
                else:
                    logits, leaves = self._deep_forward(lk)
                deep = logits.detach().double().numpy()
                if not (np.isfinite(deep).all() and (jac is None or np.isfinite(jac).all())):
                    raise NonFiniteStepError(f"the step's dense logits are not finite on rank {self.rank}; "
                                             "nothing applied")  # rank 0 would write them into rows
                lens = np.diff(np.stack([lk.batch.offsets[s] for s in slots]), axis=1)
                labels = lk.batch.labels if lk.batch.labels is not None else np.zeros(B, np.float32)
                msg = seq.encode(False, lens, np.concatenate([p.ids for p in pbs]), deep,
                                 labels.astype(np.float64), jac)
                fwd = (slopes if slopes is not None else logits, leaves)
            except Exception as err:  # noqa: BLE001 - this rank's part fails; it still takes part
                error = err
        if fwd is None:
            msg = np.zeros(seq.size(n_slots, B, lk.lin_ids[self.rank], width), np.int64)
            msg[0] = 1
        sizes = [seq.size(n_slots, b, k, width) for b, k in zip(lk.sizes, lk.lin_ids)]
        mean = np.array([x == "mean" for b in blocks for x in b.modes], np.bool_)
        pass_slots = tuple(s for p in pbs for s in p.slots)
        pass_tables = np.concatenate([p.slot_table for p in pbs])

        factors = m.head.linear_scale  # the first-order fields' learned factors (DenseHead), if any
        scale = factors.detach().double().numpy() if factors is not None else None
        n_scale = 0 if factors is None else factors.numel()

        def run(msgs):  # rank 0
            parts = [seq.decode(x, n_slots, b, k) for x, b, k in zip(msgs, lk.sizes, lk.lin_ids)]
            if any(p.failed for p in parts):
                return seq.SKIPPED, None
            try:
                if self._meta is not None:  # the task slot's new first-order rows (trainer.dist.meta)
                    self._meta.start_pass(pass_slots, parts, lk.event_time)
                return seq.OK, seq.run_pass(m.ps, pass_slots, pass_tables, mean, parts, lk.event_time, n_emb,
                                            scale)
            except Exception as err:  # noqa: BLE001 - every rank is told; none is left waiting
                log.error("rank 0: the first-order pass failed: %r", err)
                return seq.FAILED, None

        tc = time.perf_counter()
        status, resid, probs, loss_sum, g_scale, sent = seq.exchange(self.group, self.rank, self.world, msg, sizes,
                                                                     lk.sizes, run, n_scale)
        with self._lock:
            self.alltoall_bytes += sent
            m.timings["update"] += time.perf_counter() - tc
        if error is None and status == seq.FAILED:
            error = RuntimeError("rank 0's first-order pass failed (see its log); nothing applied elsewhere")
        if error is not None or status != seq.OK:
            return 0.0, np.zeros(0, np.float32), None, error
        deep_part, leaves = fwd  # a HeadSlopes or the logits' graph: either steps back from the seed
        try:
            seed = torch.from_numpy((resid / max(lk.global_size, 1)).astype(np.float32))
            backward(deep_part, seed) if isinstance(deep_part, torch.Tensor) else deep_part.backward(seed)
            if factors is not None and factors.requires_grad:  # this rank's share of the global mean's gradient
                factors.grad = torch.from_numpy((g_scale / max(lk.global_size, 1)).astype(np.float32))
            if leaves:
                w = leaves[0][1]
                g = w.grad.numpy().reshape(-1) if w.grad is not None else np.zeros(w.numel(), np.float32)
                g_rows = lk.rows_map.sum_back(g, lk.n_rows)
            else:
                g_rows = np.zeros(lk.n_rows, np.float32)
            value = loss_sum / max(lk.global_size, 1)
            if not (math.isfinite(value) and np.isfinite(g_rows).all()):
                raise NonFiniteStepError(f"the step's loss ({value}) or sparse gradients are not finite on rank "
                                         f"{self.rank}; the first-order rows were stepped, nothing else applied")
        except Exception as err:  # noqa: BLE001 - failed in lockstep by the dense sum
            return 0.0, np.zeros(0, np.float32), None, err
        return value, probs, g_rows, None

    def _deep_forward(self, lk: Lookup):
        """Logits without the first-order fields (the embedding fields and the dense head; an LR's
        bias and dense weights), and the embedding block's leaf."""
        m = self.model
        if m._emb_block is not None:
            return m.forward_packed(lk.batch, lk.pb, lk.buf, requires_grad=True, linear=False)
        head, b = m.head, lk.batch
        out = head.bias.expand(b.size)
        dense = m.dense_input(b) if head.dense_linear is not None else None
        if dense is not None:
            out = out + head.dense_linear(dense).squeeze(1)
        return out, []

    def _head_grads(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                          for p in self._params])

    def _learn(self, lk: Lookup, sparse: str = "now"):
        """Steps 6-9 of ``lk``'s batch. ``sparse``: step 8 runs ``"now"`` (sync), is ``"queued"``
        on the lookup thread (:meth:`train`), or ``"deferred"`` until the next :meth:`step`
        queues it behind that step's lookup."""
        m = self.model
        if lk.global_size == 0 and not lk.any_failed:  # every rank knows: nothing to learn, no more collectives
            return 0.0, np.zeros(0, np.float32)
        t1, f0 = time.perf_counter(), m.timings["forward"]
        m.optimizer.zero_grad(set_to_none=True)
        error, value, probs, g_rows = lk.error, 0.0, np.zeros(0, np.float32), None
        if m.head.bias_waits:  # the step's global label sums, before it is scored (DenseHead.start_bias)
            labels = lk.batch.labels
            seen = [float(labels.sum()), float(labels.size)] if error is None and labels is not None else [0.0, 0.0]
            sums = m.io.to_device(torch.tensor(seen, dtype=torch.float64))
            dist.all_reduce(sums, group=self.dense_group)
            m.head.start_bias(sums[0], sums[1])
        if self._content is not None:
            self._content.begin()
        if self._seq:
            value, probs, g_rows, error = self._local_sequential(lk, error)
        elif error is None:
            try:
                value, probs, g_rows = self._local(lk)
            except Exception as err:  # noqa: BLE001 - one rank's failure fails the step on every rank
                error = err
        if self._content is not None:  # its exchanges are collective: run by every rank, failed or not
            self._content.finish()
        r_grads, row_comm = None, 0.0
        if self._row_content:  # step 8 first: the item rows' gradients are the encoder's (trainer.dist.content)
            tc = time.perf_counter()
            r_grads = self._a2a(g_rows if g_rows is not None else np.zeros(lk.n_rows, np.float32),
                                lk.row_splits, lk.back_splits, self._lookup_group)
            row_comm = time.perf_counter() - tc
            try:
                self._content.backward_rows(r_grads)
            except Exception as err:  # noqa: BLE001 - one rank's failure fails the step on every rank
                error = error or err
        self.model.head.stage_moments()  # (the dense scaler's moments: summed with the gradients)
        head = self._head_grads()
        if error is None and not bool(torch.isfinite(head).all()):
            error = NonFiniteStepError(f"the step's dense gradients are not finite on rank {self.rank}; nothing applied")
        if error is not None:  # this rank's part is left out of the sums (nothing is applied anyway)
            head, value = torch.zeros_like(head), 0.0
        # the head's gradients, the loss and one failure flag per rank: every rank learns which
        # ranks' batches failed and all take the same decision
        flags = torch.zeros(self.world)
        flags[self.rank] = float(error is not None)
        if lk.served_failed is not None and lk.served_failed.any():  # requesters this owner failed
            flags[torch.from_numpy(np.flatnonzero(lk.served_failed))] = 1.0
        tail = m.io.to_device(torch.cat([torch.tensor([value], dtype=torch.float32), flags]))
        flat = torch.cat([head, tail])  # on the device: the dense group's (NCCL's on CUDA)
        tc = time.perf_counter()
        summed = self._start_sum(flat, self.dense_group)
        if self._seq_emb:  # every row learned in rank 0's pass: no step 8
            sparse = "none"
        if sparse == "now" and r_grads is None:  # the gradients travel while the all-reduce does; applied once agreed
            r_grads = self._a2a(g_rows if g_rows is not None else np.zeros(lk.n_rows, np.float32),
                                lk.row_splits, lk.back_splits, self._lookup_group)
        flat = summed()
        with self._lock:
            # what a ring all-reduce sends per rank (gloo's algorithm may differ: an estimate)
            self.allreduce_bytes += flat.numel() * 4 * 2 * (self.world - 1) // self.world
        comm = time.perf_counter() - tc + row_comm
        failed = torch.nonzero(flat[-self.world:].cpu()).reshape(-1).tolist()
        if failed:
            if error is None and self.rank in failed:  # named by an owner (which logged why)
                error = OwnerLookupError(f"an owner's lookup failed on rank {self.rank}'s ids; nothing applied")
            raise RankStepError(failed, error)
        value = float(flat[-self.world - 1])
        if not math.isfinite(value) or not bool(torch.isfinite(flat[:-self.world - 1]).all()):
            # finite on every rank, not summed: none to blame, each rank's batch is suspect
            raise RankStepError(list(range(self.world)), NonFiniteStepError(
                f"the step's summed loss ({value}) or gradients are not finite; nothing applied"))
        if g_rows is None:
            g_rows = np.zeros(lk.n_rows, np.float32)
        t2 = time.perf_counter()
        if sparse == "queued":  # after the lookups already queued, before the next ones: staleness holds
            self._queue_update(lk, g_rows)
        elif sparse == "deferred":
            self._deferred.append((lk, g_rows))
        elif sparse == "now":
            self._owner.apply(lk.owned, r_grads, lk.event_time)
            with self._lock:
                m.timings["update"] += time.perf_counter() - t2
        t3 = time.perf_counter()
        off = 0
        for p in self._params:
            p.grad = flat[off:off + p.numel()].view_as(p)  # flat is this step's own sum: views suffice
            off += p.numel()
        m.head.hold_bias()
        m.optimizer.step()
        with self._lock:
            m.timings["backward"] += t2 - t1 - comm - (m.timings["forward"] - f0)
            m.timings["update"] += time.perf_counter() - t3
        self.comm_s.append(lk.comm_s + comm)
        self.steps += 1
        return value, probs

    def _start_sum(self, flat: torch.Tensor, group):
        """Start step 7's sum of ``flat`` over the ranks; returns a function that waits for it and
        returns the sum. Two ranks swap their buffers in one ``all_to_all`` and each adds the two
        in rank order (the same float sum on both: replicas stay equal): one round trip where
        gloo's all-reduce takes several, about 2x cheaper for the DeepFM head's 264 kB here
        (median 0.4-0.7 ms against 0.6-2.3 ms, under load). More ranks use the all-reduce: a swap
        would send N-1 copies."""
        if self.world != 2:
            work = dist.all_reduce(flat, group=group, async_op=True)
            return lambda: (work.wait(), flat)[1]
        n, out = flat.numel(), torch.empty(2 * flat.numel(), device=flat.device)
        work = dist.all_to_all_single(out, flat.repeat(2), group=group, async_op=True)
        return lambda: (work.wait(), out[:n] + out[n:])[1]

    def _queue_update(self, lk: Lookup, g_rows: np.ndarray) -> None:
        self.overlapped_updates += 1
        self._sparse_steps.append(self._pool.submit(self._sparse_update, lk, g_rows, self._lookup_group))

    def _sparse_update(self, lk: Lookup, g_rows: np.ndarray, group) -> float:
        """Step 8: the gradients to their owners, which apply them; returns the seconds in the collective."""
        tc = time.perf_counter()
        r_grads = self._a2a(g_rows, lk.row_splits, lk.back_splits, group)
        comm = time.perf_counter() - tc
        self._owner.apply(lk.owned, r_grads, lk.event_time)
        with self._lock:
            self.model.timings["update"] += time.perf_counter() - tc - comm
            self.sparse_comm_s += comm
        return comm

    # ------------------------------------------------------------------ public
    def train_step(self, batch: SparseBatch):
        """One synchronous step (both modes): ``(global mean loss, this rank's probabilities
        before the update)``. Collective: every rank calls it, with an empty batch when idle.
        In ``hybrid`` the updates still in flight are applied first."""
        self._drain()
        lk = self._lookup(batch)
        if self._meta is None:
            return self._learn(lk)
        self._meta.learner.tasks.open(lk.new_tasks.tolist())
        out = self._learn(lk)
        self._meta.learner.after(lk.batch)  # collective: every rank, after every step applied
        return out

    def step(self, batch: SparseBatch):
        """One step for a caller that has one batch at a time (the online ranks): in ``sync``
        :meth:`train_step`; in ``hybrid`` the batch's lookup is queued first, then the sparse
        updates of the steps older than ``staleness`` (so the lookup misses at most the
        ``staleness`` latest steps' updates, as in :meth:`train`), and those run on the lookup
        thread while this batch does its forward and backward; this batch's own sparse update
        waits for the next call (or :meth:`flush`). Collective, like :meth:`train_step`.

        ``staleness`` 0: the batch's own update is queued at once instead, ahead of the next
        lookup: ``sync``'s results exactly, the update overlapping whatever the caller does until
        its next step (the online ranks: the round's bookkeeping, the next poll and decode)."""
        if self.mode == "sync":
            return self.train_step(batch)
        lookup = self._pool.submit(self._lookup, batch)
        while self._deferred and len(self._deferred) >= self.staleness:
            self._queue_update(*self._deferred.popleft())
        while self._sparse_steps and self._sparse_steps[0].done():
            self._sparse_steps.popleft().result()  # raises a failed update here
        return self._learn(lookup.result(), "deferred" if self.staleness else "queued")

    def flush(self) -> None:
        """Make :attr:`tables` hold every step learned, before a snapshot or a publication of the
        rows: ``hybrid``'s deferred and queued sparse updates applied (waited for), then the owner
        cache's stepped rows written back (:meth:`write_back`). Collective when anything was
        deferred (every rank has the same)."""
        self._drain()
        self.write_back()

    def _drain(self) -> None:
        """``hybrid``: apply every sparse update still deferred or queued, and wait for them (before
        a synchronous step; the cache keeps its rows: lookups read them there)."""
        while self._deferred:
            self._queue_update(*self._deferred.popleft())
        while self._sparse_steps:
            self._sparse_steps.popleft().result()

    @torch.no_grad()
    def predict(self, batch: SparseBatch) -> np.ndarray:
        """This rank's probabilities for ``batch`` from the current tables and head, nothing
        inserted or learned (evaluation). Collective: every rank calls it (an empty batch when
        it has nothing to score)."""
        self._drain()
        lk = self._lookup(batch, insert=False)
        if lk.error is not None:
            raise lk.error
        if lk.served_failed.any():  # every collective is done: raising here leaves nobody waiting
            failed = np.flatnonzero(lk.served_failed).tolist()
            raise OwnerLookupError(f"rank {self.rank} failed to look up rows of ranks {failed}")
        logits, _ = self.model.forward_packed(lk.batch, lk.pb, lk.buf, requires_grad=False)
        return self.io.to_host(torch.sigmoid(logits))

    def train(self, batches: Iterable[SparseBatch]) -> Iterator[tuple[float, np.ndarray]]:
        """:meth:`train_step` over ``batches``; in ``hybrid`` mode up to ``staleness`` lookups of
        the next batches run in the background while a batch learns. Every rank must give the
        same number of batches."""
        if self.mode == "sync":
            try:
                for b in batches:
                    yield self.train_step(b)
            finally:
                self.write_back()  # the tables hold every update once train() is done
            return
        pending: deque = deque()
        it = iter(batches)
        try:
            for b in it:
                pending.append(self._pool.submit(self._lookup, b))
                if len(pending) > self.staleness:
                    yield self._learn(pending.popleft().result(), "queued")
                while self._sparse_steps and self._sparse_steps[0].done():
                    self._sparse_steps.popleft().result()  # raises a failed update here
            while pending:
                yield self._learn(pending.popleft().result(), "queued")
        finally:
            self.flush()  # the tables hold every update once train() is done
