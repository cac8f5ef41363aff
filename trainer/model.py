"""Models: sparse parameters in PS tables, dense parameters in torch.

:class:`trainer.head.DenseHead` is the torch part (DeepFM or LR head) over pooled slot embeddings.
:class:`SparseModel` joins it with the PS tables. Per batch:

* **one** :meth:`ps.ParameterServer.gather_packed` resolves every slot of every table (one packed numba
  call). The slots are packed embedding fields first, then first-order fields, so the result is
  one float32 buffer: a ``[n_emb_ids, dim]`` block and a ``[n_lin_ids, 1]`` block;
* those two blocks become the two torch leaves (``requires_grad`` only while training), and
  **one** ``index_add_`` per block pools every slot's bags (``mean`` slots through row weights;
  nothing at all when every bag holds one id);
* after ``backward`` **one** :meth:`ps.ParameterServer.apply_packed_gradients` steps every table
  from the two blocks' gradients (one packed buffer, laid out as ``gather``'s).

No per-example Python loops, and no per-slot torch ops.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ps import EmbeddingTable, PackedBatch, ParameterServer

from .batch import SparseBatch
from .config import ModelConfig
from .content import content_field, join_content
from .device import Transfers, resolve_device
from .head import DenseHead, HeadSlopes, load_dense_optimizer, make_dense_optimizer
from .meta import MetaLearner
from .mixcache import Located, MixCache, cacheable
from .prefetch import Lookahead, lookahead_refusal
from .sequential import sequential_train_step
from .step_checks import NonFiniteStepError, finite_grads

_NO_IDS = np.zeros(0, np.int64)


def make_tables(cfg: ModelConfig, serving: bool = False) -> dict[str, EmbeddingTable]:
    return {t.name: EmbeddingTable(t.serving() if serving else t) for t in cfg.tables}


class PooledBlock:
    """One block of packed rows, all of one ``dim``: its PS slot keys, batch slots and poolings."""

    __slots__ = ("keys", "slots", "modes", "dim")

    def __init__(self, keys: list[str], slots: list[str], modes: list[str], dim: int):
        self.keys, self.slots, self.modes, self.dim = keys, slots, modes, dim


def bag_inputs(batch: SparseBatch, slots: list[str], modes: list[str]):
    """How to pool one block: ``(bag int64 [n] or None, weights float32 [n] or None)``.

    The block's rows are the slots' ids concatenated in ``slots`` order; bags are slot-major
    (slot 0's B bags, then slot 1's, ...). ``bag[i]`` is the bag of row ``i`` (None when every bag
    holds exactly one id: pooling is then the identity); ``weights`` scale rows of ``mean`` slots.
    """
    # one [slots, B] array of bag lengths: a few whole-array operations, not a few per slot
    lens = np.diff(np.stack([batch.offsets[s] for s in slots]), axis=1)
    if lens.size == 0 or (lens.min() == 1 and lens.max() == 1):
        return None, None  # one id per bag: sum and mean are both the identity
    flat = lens.reshape(-1)
    bag = np.repeat(np.arange(flat.size, dtype=np.int64), flat)
    weights = None
    means = np.array([m == "mean" for m in modes])
    if means.any():
        per_bag = np.where(means[:, None], (1.0 / np.maximum(lens, 1)).astype(np.float32), np.float32(1.0))
        weights = np.repeat(per_bag.reshape(-1), flat)
    return bag, weights


def pool(w: torch.Tensor, bag: np.ndarray | None, weights: np.ndarray | None, n_bags: int) -> torch.Tensor:
    """Sum (weighted) rows of ``w`` into ``n_bags`` bags. ``index_add_``'s backward is a plain
    ``index_select`` (each row is in exactly one bag), cheaper than ``embedding_bag``'s."""
    if bag is None:
        return w
    src = w if weights is None else w * torch.from_numpy(weights).to(w.device).unsqueeze(1)
    return (torch.zeros(n_bags, w.shape[1], dtype=w.dtype, device=w.device)
            .index_add_(0, torch.from_numpy(bag).to(w.device), src))


def _bags_for(bags: dict[tuple, tuple], batch: SparseBatch, blk: PooledBlock, rows: int) -> tuple:
    """:func:`bag_inputs` of ``blk`` (``rows`` ids), cached in ``bags`` for the batch's other
    blocks. A block whose slots (and poolings) begin another's takes the first ``rows`` of that
    one's bags: they are slot-major, so its own come first (DeepFM's first-order block is its
    embedding block less ``recent_items``: one pass over the bag lengths, not two)."""
    key = (tuple(blk.slots), tuple(blk.modes))
    got = bags.get(key)
    if got is None:
        k = len(blk.slots)
        for (slots, modes), (bag, weights) in bags.items():
            if slots[:k] == key[0] and modes[:k] == key[1]:
                got = (None if bag is None else bag[:rows], None if weights is None else weights[:rows])
                break
        else:
            got = bag_inputs(batch, blk.slots, blk.modes)
        bags[key] = got
    return got


class SparseModel:
    """A model = config + PS tables + torch head. ``forward`` for scoring, ``train_step`` to learn.

    ``device`` (``trainer.device``): where the head, its optimizer and the pooling run; the tables
    stay on the host (:mod:`trainer.device`). ``cache_rows`` (``trainer.cache_rows``): rows per
    embedding table kept on the device, stepped there (:mod:`trainer.mixcache`); 0: none.
    ``lookahead`` (``trainer.lookahead``): read the next batch while this one trains
    (:mod:`trainer.prefetch`, :meth:`train_steps`); None: on CUDA only, where the model can."""

    def __init__(self, cfg: ModelConfig, tables: dict[str, EmbeddingTable] | None = None,
                 head: DenseHead | None = None, train: bool = True, device: str | torch.device = "cpu",
                 cache_rows: int = 0, cache_admit_after: int = 2, lookahead: bool | None = False):
        self.cfg = cfg
        self.io = Transfers(resolve_device(device))
        self.tables = tables if tables is not None else make_tables(cfg, serving=not train)
        self.head = head if head is not None else DenseHead(cfg)
        if self.io.cuda:
            self.head.to(self.io.device)
        self.optimizer = make_dense_optimizer(cfg, self.head) if train else None
        salts = cfg.salts()
        # packed layout: embedding fields (one dim) then first-order fields (dim 1)
        self._plan: list[tuple[str, str, int]] = []  # (ps slot key, batch slot, id salt)
        ps_slots: dict[str, str] = {}
        blocks = []
        for role, mapping in (("e", cfg.slots), ("l", cfg.linear)):
            keys = []
            for slot, table in mapping.items():
                key = f"{role}:{slot}"
                ps_slots[key] = table
                self._plan.append((key, slot, salts[(table, slot)]))
                keys.append(key)
            if keys:
                dims = {cfg.table(t).dim for t in mapping.values()}
                if len(dims) != 1:
                    raise ValueError(f"{role}: fields of one block need one dim, got {sorted(dims)}")
                blocks.append(PooledBlock(keys, list(mapping), [cfg.pooling.get(s, "sum") for s in mapping],
                                          dims.pop()))
            else:
                blocks.append(None)
        self._emb_block, self._lin_block = blocks
        content = [cfg.content.slot] if cfg.content is not None else []
        self._batch_slots = tuple(dict.fromkeys([*(slot for _, slot, _ in self._plan), *content]))
        self.ps = ParameterServer([self.tables[t.name] for t in cfg.tables], ps_slots)
        self._dims = {k: cfg.table(t).dim for k, t in ps_slots.items()}
        self.timings: dict[str, float] = defaultdict(float)
        # N ranks: the content encoder run by the items' owners (trainer.dist.content)
        self.content_source: Callable[[SparseBatch], torch.Tensor] | None = None
        self.cache = self.make_cache(cache_rows, cache_admit_after) if cache_rows else None
        if cfg.meta is not None and train and self.cache is not None:
            raise ValueError("model.meta reads its task rows from the host PS: run it without trainer.cache_rows")
        # meta-learned starting points of the task slot's new ids (trainer.meta)
        self.meta = MetaLearner(self, cfg.meta) if cfg.meta is not None and train else None
        if lookahead is None:
            lookahead = train and self.io.cuda and lookahead_refusal(self) is None
        self.lookahead = Lookahead(self) if lookahead else None
        if self.lookahead is not None and self.cache is not None:
            self.cache.on_host_write = self.lookahead.written

    @property
    def transfers(self) -> tuple[Transfers, ...]:
        """Every host/device copier of this model (the metrics count their bytes)."""
        return (self.io,) if self.lookahead is None else (self.io, self.lookahead.io)

    def dense_state(self) -> dict:
        """What a snapshot keeps of the model besides its tables: the head, its optimizer, and the
        meta-learned starting point (``cfg.meta``) with its optimizer."""
        out = {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict() if self.optimizer else {}}
        if self.meta is not None:
            out["meta"] = self.meta.state_dict()
        return out

    def load_dense_state(self, dense: dict) -> None:
        """:meth:`dense_state` back (a snapshot's; parts it lacks stay as they are)."""
        self.head.load_state_dict(dense["head"])
        if dense.get("optimizer") and self.optimizer is not None:
            load_dense_optimizer(self.optimizer, dense["optimizer"], self.head)
        if "meta" in dense and self.meta is not None:
            self.meta.load_state_dict(dense["meta"])

    def make_cache(self, rows: int, admit_after: int, io: Transfers | None = None) -> MixCache:
        """A :class:`MixCache` of this model's cacheable embedding tables (``io``: its own copier,
        for a cache used from another thread than :attr:`io`'s: the N-rank owners)."""
        if self.cfg.sequential:
            raise ValueError("trainer.cache_rows: a sequential model steps its rows on the host, example by "
                             "example; the cache serves a model with sequential off")
        blk = self._emb_block
        names = list(self.ps.table_names)
        tables = {} if blk is None else {names.index(self.ps.slots[k]): self.tables[self.ps.slots[k]] for k in blk.keys}
        cached = {ti: t for ti, t in tables.items() if cacheable(t)}
        if blk is None or not cached:
            raise ValueError("trainer.cache_rows: no embedding table of this model can be cached "
                             "(SGD or Adagrad, no TTL)")
        return MixCache(cached, blk.dim, rows, self.io if io is None else io, admit_after)

    def write_back(self) -> int:
        """Copy the cache's stepped rows to the host tables (before anything reads them); the rows."""
        return self.cache.write_back() if self.cache is not None else 0

    # ------------------------------------------------------------------ forward
    def complete(self, batch: SparseBatch) -> SparseBatch:
        """``batch`` with an empty bag per example for every slot it lacks (e.g. the real-time
        ``recent_items`` in historical data): such a field pools to a zero vector."""
        missing = [s for s in self._batch_slots if s not in batch.ids]
        if not missing:
            return batch
        empty = np.zeros(0, np.int64)
        zeros = np.zeros(batch.size + 1, np.int64)
        return dataclasses.replace(batch, ids={**batch.ids, **{s: empty for s in missing}},
                                   offsets={**batch.offsets, **{s: zeros for s in missing}})

    def pack(self, batch: SparseBatch, block: PooledBlock | None = None) -> PackedBatch:
        """The batch as one :class:`ps.PackedBatch` (ids salted where slots share a table): every
        block's slots, or only ``block``'s."""
        keys = None if block is None else set(block.keys)
        ids = {}
        for key, slot, salt in self._plan:
            if keys is not None and key not in keys:
                continue
            a = batch.ids.get(slot, _NO_IDS)
            ids[key] = a ^ salt if salt else a
        return self.ps.pack(ids)

    def forward(self, batch: SparseBatch, *, insert: bool = False, event_time: int | None = None):
        """Logits ``[B]`` and ``(packed batch, [(block, leaf)])``; leaves require grad when inserting."""
        logits, pb, leaves, _ = self._forward(batch, insert, event_time)
        return logits, (pb, leaves)

    def _forward(self, batch: SparseBatch, insert: bool, event_time: int | None, then: SparseBatch | None = None):
        """:meth:`forward`, and where the cache holds the embedding block's rows (None: no cache).
        ``then``: the next batch to train, read ahead from here on (:attr:`lookahead`)."""
        t0 = time.perf_counter()
        ahead = self.lookahead
        got = ahead.take(batch, event_time or 0) if ahead is not None and insert else None
        dev = None
        if got is None:
            batch = self.complete(batch)
            pb = self.pack(batch)
            buf = self.ps.gather_packed(pb, insert=insert, event_time=event_time)
        else:
            batch, pb, buf, dev = got
        if ahead is not None and then is not None:
            ahead.prefetch(then)  # after this batch's inserts: the read then misses fewer rows
        at = None if self.cache is None else self.cache.locate(pb, 0, len(self._emb_block.keys))
        self.timings["lookup"] += time.perf_counter() - t0
        logits, leaves = self.forward_packed(batch, pb, buf, requires_grad=insert, cached=at, dev=dev)
        return logits, pb, leaves, at

    def block_spans(self, pb: PackedBatch, linear: bool = True) -> Iterator[tuple]:
        """Per block of ``pb`` (the embedding block, then the first-order one unless ``linear`` is
        False; None where the model has none): ``(block, where its rows start in the packed
        buffer, its row count, its fields' row offsets from its first row)``, or None."""
        elem = seg = 0
        for blk in (self._emb_block, self._lin_block if linear else None):
            if blk is None:
                yield None
                continue
            nf = len(blk.slots)
            offsets = pb.offsets[seg:seg + nf + 1] - pb.offsets[seg]
            n = int(offsets[-1])
            yield blk, elem, n, offsets
            elem += n * blk.dim
            seg += nf

    def forward_packed(self, batch: SparseBatch, pb: PackedBatch, buf: np.ndarray, *, requires_grad: bool,
                       linear: bool = True, cached: Located | None = None, dev: torch.Tensor | None = None):
        """Logits ``[B]`` and ``[(block, leaf)]`` from an already looked-up packed buffer ``buf``
        (``pb``'s rows in :meth:`ps.ParameterServer.gather_packed`'s layout; ``batch`` completed).
        Split from :meth:`forward` so that a lookup elsewhere (the owners of
        :mod:`trainer.dist.model`) feeds the same pooling and head. ``linear=False``: ``pb`` holds
        the embedding block alone and the logits leave the first-order fields out (a sequential
        model learns those in :mod:`trainer.sequential`). ``cached``: the embedding block's rows
        located in :attr:`cache` (its hits are read there). ``dev``: ``buf`` already on the device
        (the lookahead's copy; without a cache)."""
        t1 = time.perf_counter()
        pooled, leaves = [], []
        bags: dict[tuple, tuple] = {}  # blocks over the same slots pool the same bags (DeepFM's two)
        for span in self.block_spans(pb, linear):
            if span is None:
                pooled.append(None)
                continue
            blk, elem, n, _ = span
            nf = len(blk.slots)
            rows = buf[elem:elem + n * blk.dim].reshape(n, blk.dim)
            if dev is not None:
                w = dev[elem:elem + n * blk.dim].view(n, blk.dim)
            elif cached is None or blk is not self._emb_block:
                w = self.io.to_device(rows)
            else:
                w = self.cache.assemble(cached, rows)
            if requires_grad:
                w.requires_grad_(True)
            leaves.append((blk, w))
            x = pool(w, *_bags_for(bags, batch, blk, n), nf * batch.size)
            pooled.append(x.view(nf, batch.size, blk.dim).transpose(0, 1))  # [B, F, dim]
        emb, lin = pooled
        if lin is not None:
            lin = lin.reshape(batch.size, lin.shape[1])  # dim 1: [B, L] (also for B == 0)
        if self.cfg.content is not None:  # the content encoder's output (trainer.content)
            emb = join_content(self.cfg, emb, content_field(self, batch))
        logits = self.head(emb, lin, self.dense_input(batch))
        self.timings["forward"] += time.perf_counter() - t1
        return logits, leaves

    def mlp_part(self, batch: SparseBatch, pe: PackedBatch, buf: np.ndarray,
                 content: torch.Tensor | None = None) -> HeadSlopes:
        """For :mod:`ps.sequential_fm`: :meth:`DenseHead.slopes` from the embedding block's looked-up
        rows (``pe``, ``buf`` as :meth:`forward_packed` takes them): the logits leave out the FM and
        first-order terms. ``content``: the content encoder's output ``[B, D]`` (:func:`join_content`)."""
        t0 = time.perf_counter()
        blk, n_ex = self._emb_block, batch.size
        nf = len(blk.slots)
        n = int(pe.offsets[nf] - pe.offsets[0])
        w = self.io.to_device(buf[:n * blk.dim].reshape(n, blk.dim))
        x = pool(w, *_bags_for({}, batch, blk, n), nf * n_ex).view(nf, n_ex, blk.dim).transpose(0, 1)
        if content is not None:
            x = join_content(self.cfg, x, content.detach())
        slopes = self.head.slopes(x, self.dense_input(batch))
        self.timings["forward"] += time.perf_counter() - t0
        return slopes

    def dense_input(self, batch: SparseBatch) -> torch.Tensor | None:
        """The batch's dense features on the device, scaled as the head takes them (None when the
        model reads none; a training forward records their moments: :mod:`trainer.dense_scaling`)."""
        if batch.dense is None or not self.cfg.dense_features:
            return None
        return self.head.scale_dense(self.io.to_device(batch.dense))

    @torch.no_grad()
    def predict(self, batch: SparseBatch) -> np.ndarray:
        """Probabilities (no insertion, no learning)."""
        logits, _ = self.forward(batch, insert=False)
        return self.io.to_host(torch.sigmoid(logits))

    # ------------------------------------------------------------------ training
    def train_steps(self, batches: Iterable[SparseBatch]) -> Iterator[tuple[SparseBatch, tuple[float, np.ndarray]]]:
        """:meth:`train_step` on each of ``batches`` in turn: ``(batch, (loss, probabilities))``.
        With :attr:`lookahead` each batch is read while the one before it trains."""
        it = iter(batches)
        cur = next(it, None)
        while cur is not None:
            nxt = next(it, None)
            yield cur, self.train_step(cur, then=nxt)
            cur = nxt

    def train_step(self, batch: SparseBatch, then: SparseBatch | None = None):
        """One step on ``batch``: returns ``(mean loss, probabilities before the update)``.
        ``then``: the batch the next call will train (read ahead meanwhile with :attr:`lookahead`).

        The probabilities come from this step's forward pass, i.e. before the batch is learned
        (progressive validation). A ``sequential`` LR learns the batch example by example
        (:mod:`trainer.sequential`): each probability is taken before that example is learned."""
        assert self.optimizer is not None, "not a training model"
        if self.head.bias_waits and batch.labels is not None:  # (before it is scored: DenseHead.start_bias)
            self.head.start_bias(float(batch.labels.sum()), batch.size)
        if self.meta is None:
            return self._train_step(batch, then)
        # (new ids it gives their starting point had no row when a lookahead read them: they are
        # read again in the step, trainer.prefetch)
        self.meta.before(batch)
        out = self._train_step(batch, then)
        self.meta.after(batch)
        return out

    def _train_step(self, batch: SparseBatch, then: SparseBatch | None):
        if self.cfg.sequential:
            return sequential_train_step(self, batch)
        t = batch.max_event_time
        logits, pb, leaves, at = self._forward(batch, True, t, then)
        labels = self.io.to_device(batch.labels)
        t1 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.head.stage_moments()
        value = float(loss.detach())
        # copied back now, while the device waits anyway: the updates queued below then run on
        # the device while the caller prepares the next batch (CUDA kernels run asynchronously)
        probs = self.io.to_host(torch.sigmoid(logits.detach()))
        # Nothing is applied before everything is known to be finite, so a step that raises
        # changed no parameter and its batch can be retried without its poison record
        # (trainer.isolate): the loss and the head's gradients here, the sparse gradients in
        # the PS (NonFiniteGradientError, before it touches a row).
        if not math.isfinite(value) or not finite_grads(self.head):
            raise NonFiniteStepError(f"the step's loss ({value}) or dense gradients are not finite; "
                                     "nothing applied")
        t2 = time.perf_counter()
        # the leaves are the packed buffer's blocks in order, so their gradients back to back are
        # the packed gradient buffer: one validation and one PS call for every table
        gs, hits = [], None
        for blk, w in leaves:
            if w.grad is None:
                gs.append(np.zeros(w.numel(), np.float32))
            elif at is not None and blk is self._emb_block:
                host, hits = self.cache.split_gradients(at, w.grad)
                gs.append(host.reshape(-1))
            else:
                gs.append(self.io.to_host(w.grad).reshape(-1))
        self.ps.apply_packed_gradients(pb, np.concatenate(gs) if len(gs) > 1 else gs[0], t)
        if self.lookahead is not None:
            self.lookahead.applied(pb)
        if at is not None:
            self.cache.step(at, hits if hits is not None else torch.zeros((0, self._emb_block.dim)))
            self.cache.admit(at)
        t3 = time.perf_counter()
        self.head.hold_bias()
        self.optimizer.step()
        self.timings["backward"] += t2 - t1 + time.perf_counter() - t3
        self.timings["update"] += t3 - t2
        return value, probs
