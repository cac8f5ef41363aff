"""Meta-learned starting points for new ids of a *task* slot (``ModelConfig.meta``; issue 36,
G-Meta's family: optimization-based meta-learning, MAML and Meta-SGD).

A **task** is one id of ``meta.task_slot`` (a user): its first ``support`` examples in the stream
are the inner loop's, its next ``query`` ones the outer loop's. What is learned is the *starting
point* every new id of the task slot gets from the PS, in place of its tables' random initial row:
for each of the slot's tables (its embedding table and its first-order table) zeros for values
(what serving reads for an id it has no row for: a brand-new user scores from the same start in
serving as in training, with no path of its own) and the learned optimizer state it starts with
(Adagrad's accumulator, per dimension: it sets how far the row's first steps go, the inner
learning rate that Meta-SGD learns). Nothing else changes: the rows then learn online exactly as
before.

**Inner loop** (:meth:`MetaLearner._meta_step`): the PS's own update of a new row, the table's
optimizer from the starting point, one support example after another (as the sequential model
steps a row), with each example's gradient taken at the starting point; the other rows and the
dense head are read as they are now, and stay. **Outer loop**: the query examples' loss at the
adapted rows; its gradient reaches the starting point through the inner updates with their
gradients held fixed (first order, as FOMAML: the second order would need the head's Hessian
through every support step); Adam steps the starting accumulators in log space.

Why the optimizer state and not (also) the values: on ml-1m's online stream the learned starting
accumulators lifted new users' first 10 examples by 0.0031 AUC (5 seeds, paired std 0.0004:
docs/results.md, section 5, ``driftline eval coldstart``), before the served model learned a
factor on each first-order field; with those factors the lift is 0.0011 ± 0.0006
(docs/cold-start.md, section 5). Learning the starting values as well
(a prototype, seed 0) gave 0.7457 against 0.7484 with the accumulators alone, and a starting
vector made from the user's other features (a generator, as Meta-Embedding's) 0.7441; serving
would need those values too.

**Meta-IO** (:class:`TaskBuffer`): no second pass over the data. A task opens when its id is
new to the PS (:meth:`MetaLearner.before`, which also gives the new row its starting point);
after each step the examples of open tasks are kept, one ``select`` of the batch's rows (a
*chunk*); a task that has its ``support + query`` examples is handed to the outer loop once
``tasks_per_step`` have. At most ``max_open_tasks`` wait: past that the oldest is dropped
unfilled (counted). Kept examples are bounded by ``max_open_tasks x (support + query)``; a chunk
lives while one of its rows is wanted, and the chunks are compacted when they hold more than
twice the wanted rows. A task that never fills costs its examples until it is dropped.

**N ranks** (``sync``, :mod:`trainer.dist.meta`): the starting point is replicated like the dense
head; the owner of a new id gives it the starting point in the engine's lookup and tells the
requester it was new; each rank keeps its own examples' tasks; the outer step runs on every rank
together once the ranks' filled tasks add up to ``tasks_per_step``, reading rows through the
engine (:attr:`MetaLearner.read`) and summing the ranks' gradients (:attr:`MetaLearner.reduce`).
Serving needs nothing: the starting accumulator is optimizer state, which it does not keep.

>>> tb = TaskBuffer(support=2, query=1, max_open=2)
>>> tb.open([7, 8])
>>> tb.wanted([7, 9, 8, 7])
[0, 2, 3]
>>> tb.add(0, [7, 8, 7])            # chunk 0 keeps rows 0, 2, 3 of the batch: task 7 has 2 of 3
[]
>>> [(k, refs) for k, refs in tb.add(1, [7])]  # chunk 1: task 7 filled (support 2, query 1)
[(7, [(0, 0), (0, 2), (1, 0)])]
>>> tb.open([9, 10]); tb.dropped, sorted(tb.keys())   # task 8 was the oldest: dropped unfilled
(1, [9, 10])
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import metrics as M
from .batch import SparseBatch, concat_batches
from .config import MetaConfig
from .head import load_optimizer_state
from .torch_quirks import optimizer_class

__all__ = ["MetaLearner", "TaskBuffer"]

log = logging.getLogger(__name__)

Ref = tuple[int, int]  # (chunk, row in the chunk)


class TaskBuffer:
    """Which examples belong to open tasks, by reference to the chunks that hold them (the module
    docstring); pure bookkeeping, the chunks themselves are the caller's."""

    def __init__(self, support: int, query: int, max_open: int):
        self.need, self.max_open = support + query, max_open
        self._open: OrderedDict[int, list[Ref]] = OrderedDict()
        self.live: dict[int, int] = defaultdict(int)  # chunk -> its rows still wanted
        self.opened = self.filled = self.dropped = 0

    def keys(self) -> Iterable[int]:
        return self._open.keys()

    def open(self, keys: Iterable[int]) -> None:
        """Open a task per new key; past ``max_open`` the oldest open ones are dropped."""
        for k in keys:
            if k not in self._open:
                self._open[k] = []
                self.opened += 1
        while len(self._open) > self.max_open:
            self.release(self._open.popitem(last=False)[1])
            self.dropped += 1

    def wanted(self, keys: Sequence[int]) -> list[int]:
        """Positions of ``keys`` (a batch's task ids, one per example) whose task is open."""
        return [i for i, k in enumerate(keys) if k in self._open]

    def add(self, chunk: int, keys: Sequence[int]) -> list[tuple[int, list[Ref]]]:
        """Row ``i`` of ``chunk`` is an example of task ``keys[i]``; returns the tasks that filled
        (their references, support first), closed here."""
        out = []
        for i, k in enumerate(keys):
            refs = self._open.get(k)
            if refs is None:  # filled earlier in this chunk
                continue
            refs.append((chunk, i))
            self.live[chunk] += 1
            if len(refs) == self.need:
                out.append((k, self._open.pop(k)))
                self.filled += 1
        return out

    def release(self, refs: Iterable[Ref]) -> list[int]:
        """These rows are no longer wanted; returns the chunks left with none."""
        gone = []
        for c, _ in refs:
            self.live[c] -= 1
            if self.live[c] == 0:
                del self.live[c]
                gone.append(c)
        return gone

    def open_refs(self) -> Iterable[list[Ref]]:
        return self._open.values()


@dataclass
class _Part:
    """One table of the task slot in the model's packed buffer."""

    table: str
    block: int      # 0: the embedding block, 1: the first-order block
    field: int      # the slot's index in its block
    dim: int
    lr: float
    eps: float
    adagrad: bool
    salt: int       # the slot's ids are salted in this table (``ModelConfig.salts``)
    cap: float      # Adagrad's ``max_accumulator`` (inf: none)

    def keys(self, ids: np.ndarray) -> np.ndarray:
        return ids ^ self.salt if self.salt else ids


class MetaLearner:
    """The starting point of ``cfg.meta.task_slot``'s new ids, learned from the stream (the
    module docstring). ``before(batch)`` ahead of each training step, ``after(batch)`` once it
    is applied."""

    def __init__(self, model, meta: MetaConfig):
        self.m, self.meta = model, meta
        self.parts = self._parts(model, meta.task_slot)
        self.dim = sum(p.dim for p in self.parts)
        acc0 = np.concatenate([np.full(p.dim, self._acc0(p), np.float32) for p in self.parts])
        # log of the starting accumulators (Adagrad's parts; an SGD part keeps none): positive, and
        # Adam's steps are relative
        self.log_acc = torch.tensor(np.log(np.maximum(acc0, 1e-3)), requires_grad=True)
        self.optimizer = optimizer_class(torch.optim.Adam)([self.log_acc], lr=meta.outer_lr)
        self.tasks = TaskBuffer(meta.support, meta.query, meta.max_open_tasks)
        self.chunks: dict[int, SparseBatch] = {}
        self._next_chunk = 0
        self._ready: list[list[Ref]] = []
        self.outer_steps = self.skipped_steps = 0
        self._published: dict[tuple[str, str], int] = {}
        # N ranks replace these three (trainer.dist.meta): whether an outer step is due (on the
        # count of filled tasks), how a batch's rows are read (``(completed batch, packed, rows)``)
        # and how an outer step's gradient sum, task count and failure add up over the ranks
        self.due: Callable[[int], bool] = lambda n: n >= self.meta.tasks_per_step
        self.read: Callable[[SparseBatch], tuple] = self._read
        self.reduce: Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, int, bool]] = lambda g, n, bad: (g, n, bad)

    @staticmethod
    def _parts(model, slot: str) -> list[_Part]:
        cfg, salts, out = model.cfg, model.cfg.salts(), []
        for b, (blk, mapping) in enumerate(((model._emb_block, cfg.slots), (model._lin_block, cfg.linear))):
            if blk is None or slot not in mapping:
                continue
            t = cfg.table(mapping[slot])
            opt = t.optimizer
            cap = getattr(opt, "max_accumulator", None)
            out.append(_Part(t.name, b, blk.keys.index(f"{'el'[b]}:{slot}"), blk.dim, float(opt.lr),
                             float(getattr(opt, "eps", 0.0)), opt.kind == "adagrad", salts[(t.name, slot)],
                             float("inf") if cap is None else float(cap)))
        return out

    def _acc0(self, p: _Part) -> float:
        opt = self.m.cfg.table(p.table).optimizer
        return float(opt.initial_accumulator_value) if p.adagrad else 0.0

    # ------------------------------------------------------------------ the starting point
    def start(self) -> np.ndarray:
        """The starting accumulators, float32 ``[dim]`` (all parts)."""
        with torch.no_grad():
            return np.exp(self.log_acc.numpy()).astype(np.float32)

    def before(self, batch: SparseBatch) -> None:
        """Give the batch's new task ids their starting point (inserted now, as the step would) and
        open a task for each."""
        ids = self._task_ids(batch)
        u = np.unique(ids[ids >= 0])
        p0 = self.parts[0]
        new = u[~self.m.tables[p0.table].contains(p0.keys(u))] if u.size else u
        if not new.size:
            return
        acc = self.start()
        for i, p in enumerate(self.parts):
            self.give_start(i, self.m.tables[p.table], p.keys(new), batch.max_event_time, acc)
        self.tasks.open(new.tolist())

    def give_start(self, part: int, table, keys: np.ndarray, event_time: int, acc: np.ndarray | None = None) -> None:
        """Insert ``keys`` (new ids of part ``part``'s table, salted as stored) into ``table`` with
        the starting point: zero values and the starting accumulators (``acc``: :meth:`start`)."""
        p = self.parts[part]
        acc = self.start() if acc is None else acc
        at = sum(q.dim for q in self.parts[:part])
        table.gather(keys, insert=True, event_time=event_time)
        _, state = table.read_rows(keys)
        rows = np.zeros((keys.size, p.dim), np.float32)
        if p.adagrad:
            state[:, :p.dim] = acc[at:at + p.dim]
        table.write_rows(keys, rows, state)

    def after(self, batch: SparseBatch) -> None:
        """Keep the examples of open tasks; an outer step once ``tasks_per_step`` tasks filled."""
        keys = self._task_ids(batch).tolist()
        rows = self.tasks.wanted(keys)
        if rows:
            c = self._next_chunk
            self._next_chunk += 1
            self.chunks[c] = batch.select(np.asarray(rows, np.int64))
            self._ready += [refs for _, refs in self.tasks.add(c, [keys[i] for i in rows])]
        if self.due(len(self._ready)):
            ready, self._ready = self._ready, []
            try:
                self._meta_step(ready, batch)
            except Exception:
                # the training step it follows is applied already: raising would make the caller
                # retry (and apply again) that batch; skipped and counted instead
                self.skipped_steps += 1
                log.exception("meta: an outer step failed on %d tasks; skipped", len(ready))
            for refs in ready:
                for c in self.tasks.release(refs):
                    del self.chunks[c]
        self._compact()
        self._publish()

    def _publish(self) -> None:
        """The counts since the last call, to the trainer's metrics."""
        t, model = self.tasks, self.m.cfg.model_id
        now = {("tasks", "opened"): t.opened, ("tasks", "filled"): t.filled, ("tasks", "dropped"): t.dropped,
               ("steps", "taken"): self.outer_steps, ("steps", "skipped"): self.skipped_steps}
        for (kind, event), n in now.items():
            if n > self._published.get((kind, event), 0):
                (M.META_TASKS if kind == "tasks" else M.META_STEPS).labels(model, event).inc(
                    n - self._published.get((kind, event), 0))
        self._published = now

    def _task_ids(self, batch: SparseBatch) -> np.ndarray:
        """Each example's task id (its first id of the task slot; -1: none), int64 ``[size]``."""
        ids, offs = batch.bag(self.meta.task_slot)
        out = np.full(batch.size, -1, np.int64)
        has = offs[1:] > offs[:-1]
        out[has] = ids[offs[:-1][has]]
        return out

    # ------------------------------------------------------------------ the outer step
    def _examples(self, tasks: list[list[Ref]]) -> SparseBatch:
        """The tasks' examples as one batch, task by task (support then query)."""
        by_chunk: dict[int, list[int]] = defaultdict(list)
        for refs in tasks:
            for c, r in refs:
                by_chunk[c].append(r)
        parts, where, at = [], {}, 0
        for c, rows in by_chunk.items():
            parts.append(self.chunks[c].select(np.asarray(rows, np.int64)))
            for r in rows:
                where[(c, r)] = at
                at += 1
        order = np.fromiter((where[ref] for refs in tasks for ref in refs), np.int64)
        return concat_batches(parts).select(order)

    def _read(self, batch: SparseBatch) -> tuple:
        """``(completed batch, packed batch, its rows)`` read from the PS, nothing inserted."""
        m = self.m
        batch = m.complete(batch)
        pb = m.pack(batch)
        return batch, pb, m.ps.gather_packed(pb, insert=False)

    def _grads(self, looked: tuple, rows: torch.Tensor) -> torch.Tensor:
        """Each example's loss gradient at its task's rows ``rows`` [size, dim] (the other rows and
        the head as they are), ``[size, dim]``; ``looked``: the examples as :attr:`read` gives them."""
        m = self.m
        batch, pb, buf = looked
        if batch.size == 0:
            return torch.zeros(0, self.dim)
        spans = [s for s in m.block_spans(pb) if s is not None]
        views = [buf[elem:elem + n * blk.dim].reshape(n, blk.dim) for blk, elem, n, _ in spans]
        pos = [offsets for *_, offsets in spans]
        vals = rows.detach().numpy()
        at = 0
        locs = []
        for p in self.parts:
            o = pos[p.block]
            loc = np.arange(o[p.field], o[p.field + 1])  # one id per example (a task slot's bag)
            views[p.block][loc] = vals[:, at:at + p.dim]
            locs.append(loc)
            at += p.dim
        logits, leaves = m.forward_packed(batch, pb, buf, requires_grad=True)
        F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels), reduction="sum").backward()
        for q in m.head.parameters():
            q.grad = None
        return torch.cat([leaves[p.block][1].grad[torch.from_numpy(loc)] for p, loc in zip(self.parts, locs, strict=True)], 1)

    def _meta_step(self, tasks: list[list[Ref]], template: SparseBatch) -> None:
        """FOMAML over ``tasks`` (the module docstring). Reads rows twice (:attr:`read`: support,
        then query) and sums once (:attr:`reduce`) whatever fails here, so N ranks' outer steps
        (each over its own tasks, maybe none) stay in step; a failure skips the step everywhere."""
        s, q = self.meta.support, self.meta.query
        try:
            ex = self._examples(tasks) if tasks else None
        except Exception:  # the reads and the sum still run (N ranks wait on them)
            log.exception("meta: the outer step's examples could not be gathered")
            ex, tasks = None, []
        T, failed = len(tasks), ex is None and bool(tasks)
        empty = template.select(np.zeros(0, np.int64))
        base = np.arange(T) * (s + q)
        si = (base[:, None] + np.arange(s)[None, :]).reshape(-1)
        qi = (base[:, None] + s + np.arange(q)[None, :]).reshape(-1)
        support = self.read(ex.select(si) if T else empty)
        w = None
        if T:
            try:
                w = self._inner(support, T)
            except Exception:  # as above
                log.exception("meta: the inner loop failed on %d tasks", T)
                failed = True
        query = self.read(ex.select(qi) if T and w is not None else empty)
        g = torch.zeros(self.dim)
        if w is not None:
            try:
                gq = self._grads(query, w.repeat_interleave(q, 0)).view(T, q, self.dim).mean(1)
                self.optimizer.zero_grad()
                (w * gq).sum().backward()  # first order: d(query loss)/d(start) through the steps
                if self.log_acc.grad is not None:
                    g = self.log_acc.grad.detach().clone()
            except Exception:  # as above
                log.exception("meta: the query gradients failed on %d tasks", T)
                failed = True
        g, n, failed = self.reduce(g, 0 if failed else T, failed)
        if failed or n == 0 or not bool(torch.isfinite(g).all()):
            self.skipped_steps += 1  # (a task's non-finite loss skips the outer step, as the PS skips the row)
            return
        self.log_acc.grad = g / n
        self.optimizer.step()
        self.outer_steps += 1

    def _inner(self, support: tuple, T: int) -> torch.Tensor:
        """The adapted rows ``[T, dim]`` (with their graph to the starting accumulators): the
        support examples' gradients at the starting point (one pass), then the PS's steps of a new
        row through them one example after another: first order, the gradients held where they
        were taken (re-taking each at the stepped row, one pass per example, measured the same on
        ml-1m's coldstart stream, 0.7481/0.7487 against 0.7482/0.7488, at 3x the cost)."""
        s = self.meta.support
        lr = torch.tensor(np.concatenate([np.full(p.dim, p.lr) for p in self.parts]), dtype=torch.float32)
        eps = torch.tensor(np.concatenate([np.full(p.dim, p.eps) for p in self.parts]), dtype=torch.float32)
        ada = torch.tensor(np.concatenate([np.full(p.dim, p.adagrad) for p in self.parts]))
        cap = torch.tensor(np.concatenate([np.full(p.dim, p.cap) for p in self.parts]), dtype=torch.float32)
        w = torch.zeros(T, self.dim)
        acc = torch.exp(self.log_acc).expand(T, self.dim)
        gs = self._grads(support, w.repeat_interleave(s, 0)).view(T, s, self.dim)
        for j in range(s):
            g = gs[:, j]
            acc = torch.minimum(acc + g * g, cap)
            w = w - torch.where(ada, lr * g / (acc.sqrt() + eps), lr * g)
        return w

    def _compact(self) -> None:
        """Chunks holding more than twice the rows still wanted are re-cut to those rows."""
        held = sum(b.size for b in self.chunks.values())
        wanted = sum(self.tasks.live.values())
        if held <= 2 * wanted + 4096:
            return
        refs = [r for rs in self.tasks.open_refs() for r in rs] + [r for rs in self._ready for r in rs]
        if not refs:
            self.chunks.clear()
            return
        c = self._next_chunk
        self._next_chunk += 1
        self.chunks[c] = self._examples([refs])
        new = {ref: (c, i) for i, ref in enumerate(refs)}
        for rs in [*self.tasks.open_refs(), *self._ready]:
            rs[:] = [new[r] for r in rs]
        self.tasks.live.clear()
        self.tasks.live[c] = len(refs)
        for old in [k for k in self.chunks if k != c]:
            del self.chunks[old]

    # ------------------------------------------------------------------ snapshots
    def state_dict(self) -> dict:
        """What a snapshot keeps: the starting point and its optimizer (not the waiting tasks: a
        restart opens tasks afresh)."""
        return {"log_acc": self.log_acc.detach().clone(), "optimizer": self.optimizer.state_dict(),
                "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.log_acc.copy_(state["log_acc"])
        load_optimizer_state(self.optimizer, state["optimizer"])  # (outer_lr: the configuration's)
        self.outer_steps = int(state["outer_steps"])
