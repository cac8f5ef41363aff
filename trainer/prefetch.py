"""The lookahead (``trainer.lookahead``): batch k+1's pack, PS lookup and host-to-device copy run
while batch k's forward, backward and update do, and batch k+1 still learns exactly what the
sequential trainer would (rows, optimizer state, dense head, deltas bit for bit).

:meth:`Lookahead.prefetch` starts, on a helper thread (the numba kernels release the GIL), a
**read-only** lookup of the next batch (``gather_packed`` without insert, noting which ids had a
row). :meth:`Lookahead.take`, once batch k is applied, completes it: the ids of batch k+1 that

* had no row at the read (their admission and insert happen here, in their packed order at the
  batch's event time: what the sequential lookup does, as it would do it), or
* some step since the read changed on the host: every id a step applied gradients to
  (:meth:`Lookahead.applied`), and every row the MixCache wrote to the host (evictions,
  write-backs: :meth:`Lookahead.written`),

are looked up again, with insert, by one ``gather_packed`` of that sub-batch, and patched into the
read. Every other row had a row at the read that nothing changed since: its read value is the
sequential one.

Why not look batch k+1 up with insert before batch k's update, as the issue first put it: with
admission gates (``min_count`` > 1, ``probability`` < 1) an id of batch k that batch k did not
admit could be admitted by batch k+1's lookup, and batch k's update would then step it (the
sequential trainer steps only rows that existed at batch k's lookup). Deferring the inserts keeps
one exact path for every admission setting; only rows new to the table pay their lookup on the
critical path.

Not used (the model steps batch by batch as before), with the reason:

* a table with a TTL: a step's expiry (``expire_on_update``) or an ``expire`` call may remove a
  row the read found, and the read would keep its old value where the sequential lookup inserts a
  fresh one;
* a ``sequential`` model: it steps rows example by example inside its step (:mod:`trainer.sequential`);
  ``lookahead=True`` for one raises :class:`ValueError`.

On CUDA (no MixCache) the read also goes to the device on a second stream, staged in the
lookahead's own pinned ring; the compute stream waits on its event before the patched rows are
scattered in. With the MixCache the rows stay on the host until :meth:`trainer.mixcache.MixCache.assemble`
(which rows are hits is known only after batch k's admissions).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ps import PackedBatch

from .batch import SparseBatch
from .device import Transfers

if TYPE_CHECKING:
    from .model import SparseModel

__all__ = ["Lookahead", "lookahead_refusal"]


def lookahead_refusal(model: SparseModel) -> str | None:
    """Why ``model`` cannot look ahead exactly (None: it can)."""
    if model.cfg.sequential:
        return ("trainer.lookahead: a sequential model steps its rows example by example inside its "
                "step; the lookahead serves a model with sequential off")
    ttl = [n for n, t in model.tables.items() if t.config.ttl_ms is not None]
    if ttl:
        return f"trainer.lookahead: tables {ttl} have a TTL (expiry may remove a row a lookahead read)"
    if not model.ps._local:
        return "trainer.lookahead: remote shards"
    return None


@dataclass
class _Read:
    """One batch's read: packed ids, rows, which ids had a row, its device copy (CUDA) and event."""

    batch: SparseBatch
    pb: PackedBatch
    buf: np.ndarray
    found: np.ndarray
    dev: torch.Tensor | None
    ready: torch.cuda.Event | None


class Lookahead:
    """A :class:`trainer.model.SparseModel`'s reads of its next batch; see the module docstring."""

    def __init__(self, model: SparseModel) -> None:
        why = lookahead_refusal(model)
        if why is not None:
            raise ValueError(why)
        self.model = model
        # its own copier: Transfers' pinned ring is not shared between threads
        self.io = Transfers(model.io.device)
        self._stream = torch.cuda.Stream(model.io.device) if self.io.cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lookahead")
        self._next: tuple[SparseBatch, Future[_Read]] | None = None
        self._changed: dict[int, list[np.ndarray]] = {}  # table index -> ids changed since the read
        self.reads = self.rows_reread = 0

    def prefetch(self, batch: SparseBatch) -> None:
        """Start reading ``batch`` (the one :meth:`take` is next called with); a read of it already
        under way is kept."""
        if self._next is not None and self._next[0] is batch:
            return
        self._changed = {}  # a read begins after every change recorded so far
        self._next = (batch, self._pool.submit(self._read, batch))

    def _read(self, batch: SparseBatch) -> _Read:
        t0 = time.perf_counter()
        m = self.model
        batch = m.complete(batch)
        pb = m.pack(batch)
        found = np.empty(pb.ids.size, np.bool_)
        buf = m.ps.gather_packed(pb, found=found)
        dev = ready = None
        if self._stream is not None and m.cache is None:
            with torch.cuda.stream(self._stream):
                dev = self.io.to_device(buf)
                ready = torch.cuda.Event()
                ready.record(self._stream)
        m.timings["lookahead"] += time.perf_counter() - t0
        return _Read(batch, pb, buf, found, dev, ready)

    def applied(self, pb: PackedBatch) -> None:
        """A step applied gradients to ``pb``'s ids (call only after the PS took them)."""
        if self._next is not None:
            for k in range(len(pb.slots)):
                self._changed.setdefault(int(pb.slot_table[k]), []).append(pb.slot_ids(k))

    def written(self, table: int, ids: np.ndarray) -> None:
        """Rows of ``table`` (its index in the PS) were written on the host from outside a step."""
        if self._next is not None:
            self._changed.setdefault(table, []).append(ids.copy())

    def take(self, batch: SparseBatch, event_time: int):
        """``(completed batch, packed batch, host rows, device rows or None)`` of ``batch`` as the
        sequential lookup with insert at ``event_time`` would give them now; None if no read of
        ``batch`` is under way (a read of another batch is dropped)."""
        nxt, changed = self._next, self._changed
        self._next, self._changed = None, {}
        if nxt is None or nxt[0] is not batch:
            return None
        r = nxt[1].result()
        pb, buf = r.pb, r.buf
        again = ~r.found
        # per table its changed ids sorted once, each segment's ids found in them by binary search
        # (np.isin sorts both sides again for every segment: ~3x the time here)
        changed_ids = {ti: np.unique(np.concatenate(a)) for ti, a in changed.items()}
        for k in range(len(pb.slots)):
            u = changed_ids.get(int(pb.slot_table[k]))
            a, b = pb.offsets[k], pb.offsets[k + 1]
            if u is not None and u.size and b > a:
                ids = pb.ids[a:b]
                again[a:b] |= u[np.minimum(np.searchsorted(u, ids), u.size - 1)] == ids
        self.reads += 1
        dev = r.dev
        if dev is not None:
            torch.cuda.current_stream().wait_event(r.ready)
            dev.record_stream(torch.cuda.current_stream())
        n_again = int(again.sum())
        if 2 * n_again > again.size:
            # most of the read is stale (small vocabularies, or batches sharing most ids): one
            # lookup of the whole batch costs less than picking out and scattering back the most
            buf = self.model.ps.gather_packed(pb, insert=True, event_time=event_time)
            dev = None
            self.rows_reread += again.size
        elif n_again:
            self._reread(pb, buf, dev, again, event_time)
        return r.batch, pb, buf, dev

    def _reread(self, pb: PackedBatch, buf: np.ndarray, dev: torch.Tensor | None, again: np.ndarray,
                event_time: int) -> None:
        """Look ``pb``'s ids ``again`` up with insert (in packed order, as the sequential lookup
        meets them) and patch their rows into ``buf`` (and ``dev``)."""
        ps = self.model.ps
        upto = np.zeros(again.size + 1, np.int64)
        np.cumsum(again, out=upto[1:])
        offsets = upto[pb.offsets]  # each segment's re-read ids, back to back
        sub = PackedBatch(pb.slots, pb.ids[again], offsets, pb.slot_table)
        fresh = ps.gather_packed(sub, insert=True, event_time=event_time)
        # each re-read row's elements in the packed buffer, in the order gather_packed laid them out
        dims = ps._dims[pb.slot_table]
        out_off = np.zeros(len(pb.slots) + 1, np.int64)
        np.cumsum(np.diff(pb.offsets) * dims, out=out_off[1:])
        elems = np.concatenate([(out_off[k] + (np.flatnonzero(again[pb.offsets[k]:pb.offsets[k + 1]]) * d)[:, None]
                                 + np.arange(d)).reshape(-1) for k, d in enumerate(dims.tolist())])
        buf[elems] = fresh
        if dev is not None:
            dev[self.model.io.to_device(elems)] = self.model.io.to_device(fresh)
        self.rows_reread += sub.ids.size

    def close(self) -> None:
        self._next = None
        self._pool.shutdown(wait=True)
