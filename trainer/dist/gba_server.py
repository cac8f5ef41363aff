"""The owner's side of ``trainer.dist_mode = "gba"`` / ``"async"`` (:mod:`trainer.dist.gba_model`):
one rank's :class:`ShardServer` (its shard of every table, and on rank 0 the master dense head,
:class:`DenseOwner`), each behind a :class:`trainer.dist.gba.TokenBuffer`, answering the other
ranks' pulls and pushes on ``torch.distributed.rpc``'s threads through this module's handlers
(:func:`pull`, :func:`push`, :func:`ticket`), which find the process's server with
:func:`current`. A pull may wait for the global batch the requester's last push joined (the fresh
pull, :meth:`ShardServer.await_tokens`).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from ..config import ModelConfig
from ..head import DenseHead, make_dense_optimizer
from .gba import GBAStats, Release, TokenBuffer, combine
from .model import OwnerLookupError
from .owner import Owner
from .routing import starts, wire_tables

__all__ = ["DenseOwner", "ShardServer", "current", "install", "pull", "push", "reset_tickets", "ticket"]

log = logging.getLogger(__name__)

_SERVER: list[ShardServer | None] = [None]   # this process's server: what the RPC handlers call
_TICKETS = [0]                                # rank 0: the shared work counter (GBAModel.ticket)
_TICKET_LOCK = threading.Lock()


def install(server: ShardServer | None) -> None:
    """Make ``server`` the one this process's RPC handlers answer with (None: none)."""
    _SERVER[0] = server


def current() -> ShardServer:
    server = _SERVER[0]
    assert server is not None, "no GBA server in this process"
    return server


def pull(*args):
    """RPC handler: :meth:`ShardServer.pull` of this process's server."""
    return current().pull(*args)


def push(*args):
    """RPC handler: :meth:`ShardServer.push` of this process's server."""
    return current().push(*args)


def ticket() -> int:
    """RPC handler (rank 0): the next number of the shared counter."""
    with _TICKET_LOCK:
        _TICKETS[0] += 1
        return _TICKETS[0] - 1


def reset_tickets() -> None:
    _TICKETS[0] = 0


class DenseOwner:
    """Rank 0's master head and its optimizer behind a token buffer of its own."""

    def __init__(self, head: DenseHead, cfg: ModelConfig, buffer: TokenBuffer):
        self.head = head
        self.params = list(head.parameters())
        self.optimizer = make_dense_optimizer(cfg, head)
        self.buffer = buffer
        self.lock = threading.Lock()

    def pull(self, known: int | None):
        """``(flat parameters or None when ``known`` is the current token, token)``."""
        with self.lock:
            t = self.buffer.token
            if known == t:
                return None, t
            return torch.cat([p.detach().reshape(-1) for p in self.params]).clone(), t

    def push(self, token: int, examples: int, grads: torch.Tensor) -> int:
        with self.lock:
            joined = self.buffer.token
            self.apply(self.buffer.push(token, examples, grads))
            return joined

    def apply(self, rel: Release | None) -> None:
        flat = combine(rel, lambda g: g)
        if flat is None:
            return
        off = 0
        for p in self.params:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        # the pushes' label sums follow the gradients: GBA's ranks do not step together, so the
        # bias starts here, at the first global batch's labels, after the ranks scored their first
        # batches at their own (GBAModel.step); those batches' gradient of it is dropped (the start
        # replaces it)
        if self.head.start_bias(flat[off], flat[off + 1]):
            self.head.bias.grad = None
        self.head.hold_bias()
        self.optimizer.step()


class ShardServer:
    """One rank's shard of every table (and, on rank 0, the dense head) answering pulls and
    pushes; one lock orders lookups and updates on the shard."""

    def __init__(self, owner: Owner, world: int, global_batch: int, max_staleness: int, mode: str,
                 dense: DenseOwner | None):
        self.owner, self.world, self.dense = owner, world, dense
        self.buffer: TokenBuffer = TokenBuffer(global_batch, max_staleness, mode)
        self.lock = threading.Lock()
        self.moved = threading.Condition()  # notified after every push: a token may have moved

    def tokens(self) -> tuple[int, int]:
        return self.buffer.token, self.dense.buffer.token if self.dense is not None else -1

    def await_tokens(self, after: int, dense_after: int, wait_s: float) -> bool:
        """Wait up to ``wait_s`` until this owner (and, asked with ``dense_after >= 0``, the dense
        head) applied a global batch since the tokens ``after`` / ``dense_after``: whether it did."""
        def moved() -> bool:
            t, d = self.tokens()
            return t > after and (dense_after < 0 or d > dense_after)
        if wait_s <= 0 or after < 0:
            return moved()
        with self.moved:
            return self.moved.wait_for(moved, timeout=wait_s)

    def pull(self, requester: int, ids: np.ndarray, counts: np.ndarray, t_event: int, insert: bool,
             dense_known: int | None, after: int = -1, dense_after: int = -1, wait_s: float = 0.0,
             occ: np.ndarray | None = None):
        """``(rows, token, dense parameters or None, dense token, fresh)`` for ``ids`` (per-table
        ``counts``, wire order; ``occ``: each id's occurrences in the batch, for count or
        probabilistic admission), after waiting up to ``wait_s`` until the global batches the
        requester's last pushes joined (tokens ``after`` / ``dense_after``) are applied (``fresh``:
        they were)."""
        fresh = self.await_tokens(after, dense_after, wait_s)
        rcounts = np.zeros((self.world, counts.size), np.int64)
        rcounts[requester] = counts
        with self.lock:
            token = self.buffer.token
            reply, _, failed = self.owner.serve(ids, occ, rcounts, wire_tables(rcounts), t_event, insert)
        if failed.any():
            raise OwnerLookupError(f"rank {self.owner.rank}: the lookup of rank {requester}'s ids failed")
        dense, dtoken = self.dense.pull(dense_known) if self.dense is not None and dense_known != -1 else (None, -1)
        return reply, token, dense, dtoken, fresh

    def push(self, ids: np.ndarray, counts: np.ndarray, grads: np.ndarray, examples: int, token: int,
             t_event: int, dense: torch.Tensor | None, dense_token: int) -> tuple[int, int]:
        """Returns the tokens of the global batches the push joined (the shard's, the head's or -1)."""
        with self.lock:
            joined = self.buffer.token
            self.apply(self.buffer.push(token, examples, (counts, ids, grads, t_event)))
        dense_joined = -1
        if dense is not None and self.dense is not None:
            dense_joined = self.dense.push(dense_token, examples, dense)
        with self.moved:
            self.moved.notify_all()
        return joined, dense_joined

    def flush(self) -> None:
        """Apply what the buffers hold short of a global batch (the end of a run)."""
        with self.lock:
            self.apply(self.buffer.flush())
        if self.dense is not None:
            with self.dense.lock:
                self.dense.apply(self.dense.buffer.flush())

    def stats(self) -> GBAStats:
        return self.buffer.stats if self.dense is None else self.buffer.stats.add(self.dense.buffer.stats)

    def apply(self, rel: Release | None) -> None:
        """One aggregated update: per table every part's ``weight * scale * gradients``, summed per
        id by :meth:`ps.EmbeddingTable.apply_gradients` in one optimizer step."""
        if rel is None:
            return
        dims = self.owner.dims
        per: dict[int, tuple[list, list]] = {}
        t_max = 0
        for w, (counts, ids, grads, t_event) in rel.parts:
            t_max = max(t_max, t_event)
            f = np.float32(w * rel.scale)
            id_off, row_off = starts(counts), starts(counts * dims)
            for ti in np.flatnonzero(counts).tolist():
                n, d = int(counts[ti]), int(dims[ti])
                g = grads[row_off[ti]:row_off[ti] + n * d].reshape(n, d)
                ids_t, g_t = per.setdefault(ti, ([], []))
                ids_t.append(ids[id_off[ti]:id_off[ti] + n])
                g_t.append(g if f == 1.0 else g * f)
        for ti, (ids_t, g_t) in sorted(per.items()):
            try:
                self.owner.tables[ti].apply_gradients(np.concatenate(ids_t), np.concatenate(g_t), t_max)
            except Exception as err:  # noqa: BLE001 - other ranks' gradients: skip, count, never hang
                self.owner.failed_updates += 1
                log.error("rank %d: GBA update of table %s failed, skipped: %r", self.owner.rank,
                          self.owner.names[ti], err)
