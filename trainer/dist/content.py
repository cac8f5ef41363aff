"""The content encoder (:mod:`trainer.content`) on N ranks: run by the owner of each item.

Rank ``r`` owns the items whose (salted) id of ``content.item_slot`` is in shard ``r``, the shard
that holds the item's embedding row, and reads their content from a :class:`ContentStore` (the
item features it is loaded with; in a deployment the item feature store).

``mode="row"`` (the default; ``join = "item"``, ``sync``): the encoder's output rides in the
item's embedding row, which crosses the engine's all-to-all anyway, so the encoder sends nothing
of its own. In the engine's lookup (:class:`trainer.dist.model.DistributedModel`, step 4) the
owner adds the encoder's output for each item it serves to the row it sends
(:meth:`OwnerEncoder.add_to_rows`); the requester's forward reads the sum as the item's field,
which is the 1-process ``join = "item"`` (the row plus the content's vector). The row's gradient
is the output's gradient: the owner receives it in step 8 and, in ``sync``, that exchange runs
before the dense sum, so the owner back-propagates it into the encoder
(:meth:`OwnerEncoder.backward_rows`) and the sum carries the encoder's gradients with the head's.
The stored row stays the row alone (snapshots and deltas as without content). Needs the item's
embedding table to itself (another slot reading it would read the content too) and ``sync``
(``hybrid`` steps the rows after the dense sum).

``mode="owners"``: an exchange of its own; per forward, every rank (collective, on a process
group of its own):

1. deduplicates its examples' items and sends each to its owner (counts, then ids: int64);
2. the owner runs the encoder on the content of the ids it is asked for (forward, with the
   graph when training) and sends back ``dim`` float32 per id (:class:`_Exchange`);
3. in ``loss.backward()`` the requester sends each id's summed output gradient back the same
   way and the owner back-propagates it into the encoder: its parameters' gradients are then the
   owner's share, and the engine's all-reduce of the head's gradients (the encoder is part of the
   head) sums the shares: every replica steps the same encoder, as in 1 process.

``mode="raw"`` is the comparison: the owner sends the items' content itself (int32 token rows
``id % buckets`` and int32 lengths) and the requester runs the encoder; nothing travels back in
the backward. :attr:`OwnerEncoder.bytes` counts what each way sent to other ranks.

Every rank must run the forward (and, when training, the backward) of every step together:
:meth:`OwnerEncoder.finish` takes part with nothing where this rank's own part failed before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..sharding import shard_of
from ..torch_quirks import backward
from .routing import starts

__all__ = ["ContentStore", "OwnerEncoder"]

MODES = ("row", "owners", "raw")


class ContentStore:
    """Items' content tokens by item id (CSR): what an owner reads for the items it is asked for."""

    def __init__(self, content: Mapping[int, Sequence[int]]):
        keys = np.array(sorted(content), np.int64)
        lens = np.array([len(content[int(k)]) for k in keys], np.int64)
        self.keys, self.offsets = keys, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.tokens = np.array([t for k in keys for t in content[int(k)]], np.int64)

    def bags(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, offsets [n + 1])`` of ``items`` (an unknown item: an empty bag)."""
        if not self.keys.size:
            return np.zeros(0, np.int64), np.zeros(items.size + 1, np.int64)
        pos = np.minimum(np.searchsorted(self.keys, items), self.keys.size - 1)
        known = self.keys[pos] == items
        lens = np.where(known, self.offsets[pos + 1] - self.offsets[pos], 0)
        offs = np.zeros(items.size + 1, np.int64)
        np.cumsum(lens, out=offs[1:])
        starts = np.repeat(self.offsets[pos] - offs[:-1], lens)
        return self.tokens[starts + np.arange(offs[-1], dtype=np.int64)], offs


class _Exchange(torch.autograd.Function):
    """Owner rows out, requested rows in (forward); requested rows' gradients back to the owners
    (backward). Collective in both directions."""

    @staticmethod
    def forward(ctx, out, enc, send, recv):  # type: ignore[override]
        ctx.enc, ctx.send, ctx.recv = enc, send, recv
        return enc.a2a(out.detach().reshape(-1), send, recv).view(-1, out.shape[1])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        enc = ctx.enc
        enc.backward_done = True
        back = enc.a2a(g.contiguous().reshape(-1), ctx.recv, ctx.send).view(-1, g.shape[1])
        return back, None, None, None


class OwnerEncoder:
    """The content field of :class:`trainer.model.SparseModel` on N ranks (its ``content_source``)."""

    def __init__(self, model, store: ContentStore, rank: int, world: int, mode: str = "row"):
        if mode not in MODES:
            raise ValueError(f"content mode must be one of {MODES}, got {mode!r}")
        self.model, self.store, self.rank, self.world, self.mode = model, store, rank, world, mode
        cfg = model.cfg
        self.slot, self.dim = cfg.content.item_slot, cfg.embed_dim
        self.table = cfg.slots[self.slot]
        self.salt = cfg.salts()[(self.table, self.slot)]
        if mode == "row":
            if cfg.content.join != "item":
                raise ValueError("content mode 'row' adds the encoder's output to the item's row: it needs "
                                 "content.join = 'item' (use 'owners' for 'field')")
            others = [s for r, s in cfg.table_slots()[self.table] if (r, s) != ("emb", self.slot)]
            if others:
                raise ValueError(f"content mode 'row': table {self.table!r} is read by {others} too, which "
                                 "would read the item's content with it (use 'owners')")
        self.pending: tuple[torch.Tensor, np.ndarray] | None = None  # row mode: the last lookup's outputs
        self.group = dist.new_group(backend="gloo")  # its collectives never interleave with the lookups'
        self.bytes = 0      # sent to other ranks, every exchange of this encoder
        self.examples = 0   # examples encoded on this rank (bytes per example = bytes / examples)
        self.forward_done, self.backward_done = True, True
        self.last: torch.Tensor | None = None  # the last exchange's rows (their backward is collective)

    def a2a(self, send: torch.Tensor, send_splits, recv_splits) -> torch.Tensor:
        s, r = [int(x) for x in send_splits], [int(x) for x in recv_splits]
        out = torch.empty(sum(r), dtype=send.dtype)
        dist.all_to_all_single(out, send.cpu().contiguous(), r, s, group=self.group)
        self.bytes += (send.numel() - s[self.rank]) * send.element_size()
        return out

    def __call__(self, batch) -> torch.Tensor:
        """``[B, dim]``: each example's item's encoder output (collective; ``row``: zeros, the
        output is in the item's row already)."""
        offs = batch.offsets[self.slot]
        if batch.size and not (np.diff(offs) == 1).all():
            raise ValueError(f"content on the owners: every example needs one {self.slot!r} id")
        if self.mode == "row":
            self.examples += batch.size
            return torch.zeros(batch.size, self.dim)
        keys = batch.ids[self.slot][offs[:-1]]
        keys = keys ^ self.salt if self.salt else keys
        return self._rows(keys, torch.is_grad_enabled())

    def _rows(self, keys: np.ndarray, grad: bool) -> torch.Tensor:
        self.examples += keys.size
        u, inv = np.unique(keys, return_inverse=True)
        own = shard_of(u, self.world)
        order = np.argsort(own, kind="stable")  # the wire order: by owner
        where = np.empty(u.size, np.int64)
        where[order] = np.arange(u.size)
        u = u[order]
        counts = np.bincount(own, minlength=self.world).astype(np.int64)
        rcounts = self.a2a(torch.from_numpy(counts), [1] * self.world, [1] * self.world).numpy()
        asked = self.a2a(torch.from_numpy(u), counts, rcounts).numpy()
        tokens, toffs = self.store.bags(asked ^ self.salt if self.salt else asked)
        self.forward_done, self.backward_done = True, not grad or self.mode == "raw"
        if self.mode == "raw":
            rows = self._raw(tokens, toffs, counts, rcounts)
        else:
            out = self.model.head.content(torch.from_numpy(tokens), torch.from_numpy(toffs[:-1]))
            rows = self.last = _Exchange.apply(out, self, rcounts * self.dim, counts * self.dim)
        return rows[torch.from_numpy(where[inv])]

    def _raw(self, tokens, toffs, counts, rcounts) -> torch.Tensor:
        """The comparison: the content itself to the requester, the encoder run there."""
        enc = self.model.head.content
        lens = self.a2a(torch.from_numpy(np.diff(toffs).astype(np.int32)), rcounts, counts).numpy().astype(np.int64)
        # tokens per peer: the asked ids come grouped by requester (rcounts), the answers by owner (counts)
        send_tok = np.diff(toffs[np.r_[0, np.cumsum(rcounts)]])
        recv_tok = np.diff(np.r_[0, np.cumsum(lens)][np.r_[0, np.cumsum(counts)]])
        got = self.a2a(torch.from_numpy((tokens % enc.buckets).astype(np.int32)), send_tok, recv_tok).long()
        starts = np.cumsum(lens) - lens
        return enc(got, torch.from_numpy(starts))

    def add_to_rows(self, reply: np.ndarray, r_ids: np.ndarray, r_tab: np.ndarray, dims: np.ndarray,
                    names: tuple, grad: bool) -> None:
        """``row`` mode, the owner's lookup: add the encoder's output to each served row of the
        item table in ``reply`` (the engine's wire layout: ``r_ids`` the ids as packed, salted,
        ``r_tab`` their tables (:func:`~trainer.dist.routing.wire_tables`), ``dims`` floats each), keeping the output's
        graph for :meth:`backward_rows` when ``grad``."""
        self.pending = None
        ti = names.index(self.table)
        sel = np.flatnonzero(r_tab == ti)
        if not sel.size:
            return
        elem = (starts(dims[r_tab])[sel][:, None] + np.arange(self.dim)).reshape(-1)
        ids = r_ids[sel] ^ self.salt if self.salt else r_ids[sel]
        tokens, toffs = self.store.bags(ids)
        with torch.set_grad_enabled(grad):
            out = self.model.head.content(torch.from_numpy(tokens), torch.from_numpy(toffs[:-1]))
        reply[elem] += out.detach().numpy().reshape(-1)
        if grad:
            self.pending = (out, elem)

    def backward_rows(self, r_grads: np.ndarray) -> None:
        """``row`` mode, step 8 on the owner (before the dense sum): the served item rows'
        gradients (``r_grads``, the reply's layout) back-propagated into the encoder."""
        if self.pending is None:
            return
        out, elem = self.pending
        self.pending = None
        backward(out, torch.from_numpy(np.ascontiguousarray(r_grads[elem], np.float32).reshape(out.shape)))

    def begin(self) -> None:
        """A training step starts (every rank): :meth:`finish` ends it."""
        self.forward_done, self.backward_done, self.last = False, False, None

    def finish(self) -> None:
        """Take part in whatever exchange this rank's step has not run (its own part failed
        before or between them), with nothing of its own: the other ranks are not left waiting
        (this rank's gradients are dropped with its failed step)."""
        if self.mode == "row":  # no exchange of its own
            return
        if not self.forward_done:
            self._rows(np.zeros(0, np.int64), True)
        if not self.backward_done and self.last is not None:
            backward(self.last, torch.zeros_like(self.last))
        self.forward_done, self.backward_done, self.last = True, True, None
