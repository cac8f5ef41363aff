"""Meta-learned starting points (:mod:`trainer.meta`, ``ModelConfig.meta``) on N ranks, ``sync``.

The :class:`trainer.meta.MetaLearner` of each rank's local model keeps what it keeps in 1 process
(the starting accumulators and their Adam state, replicated on every rank and stepped with the
same summed gradient, as the dense head is; the rank's own tasks and their examples). What
changes is where rows live:

* **The start** is given by the owner of a new id: in the engine's lookup (step 4 of
  :mod:`trainer.dist.model`), before the rows are served, :meth:`RankMeta.start` finds the
  requested ids of the task slot's tables that the shard does not hold and inserts them with the
  starting point (:meth:`trainer.meta.MetaLearner.give_start`: what 1 process does before its
  step); then one more ``all_to_all`` tells each requester which of its task ids were new
  (:meth:`RankMeta.new_tasks`), and the requester opens a task for each.
* **Tasks** are per rank: a rank keeps the examples of the tasks it opened, from its own batches.
  A user whose examples reach two ranks opens a task on each (each fills from its own examples);
  the joiner keys the examples topic by user id (``joiner/kafka_io.py``) and the online ranks
  split it by partition, so a user's examples stay on one rank.
* **The outer step** is collective: after each step the ranks sum their counts of filled tasks
  (:meth:`RankMeta.due`, a one-number ``all_reduce``) and, when the sum reaches
  ``tasks_per_step``, every rank runs it over its own filled tasks (maybe none): two reads of the
  tasks' rows through the engine's lookup without inserting (:meth:`RankMeta.read`), then one
  ``all_reduce`` of the gradient sums, the task counts and a failure flag (:meth:`RankMeta.reduce`),
  so each replica takes the same Adam step. A failure anywhere skips the step everywhere.

A ``sequential`` model's first-order rows live whole on rank 0 and skip the lookups when
training (:mod:`trainer.dist.sequential`): rank 0 gives the task slot's new ones their start at
the top of its pass (:meth:`RankMeta.start_pass`); its embedding rows (sharded, or whole on rank 0
with ``sequential_embeddings``) start in the lookups as above.

With each task's examples on one rank this equals 1 process on the concatenated batches, up to
float summation order, sequential models included (tests/trainer/distributed/test_meta_ranks.py).
Needs the task slot's tables to itself (the owner tells new ids apart by table).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["RankMeta"]


class RankMeta:
    """The glue between a :class:`trainer.dist.model.DistributedModel` (``engine``) and its local
    model's :class:`trainer.meta.MetaLearner` (module docstring). Raises ``ValueError`` for a model
    it cannot run."""

    def __init__(self, engine, group):
        self.engine, self.group = engine, group
        self.learner = learner = engine.model.meta
        cfg = engine.cfg
        if cfg.sequential and learner.parts[0].block != 0:
            raise ValueError("model.meta on N ranks with a sequential model needs the task slot's embedding "
                             "(its new ids are told apart in the lookups, which its first-order rows skip)")
        uses = cfg.table_slots()
        for p in learner.parts:
            other = [s for _, s in uses[p.table] if s != cfg.meta.task_slot]
            if other:
                raise ValueError(f"model.meta on N ranks: table {p.table!r} is read by {other} too; the owner "
                                 "tells the task slot's new ids apart by table")
        names = list(engine.model.ps.table_names)
        self.part_tables = [names.index(p.table) for p in learner.parts]
        # a sequential model's first-order rows live whole on rank 0 and skip the lookups when
        # training: rank 0 starts them in its pass (start_pass)
        self.pass_parts = [(i, f"l:{cfg.meta.task_slot}") for i, p in enumerate(learner.parts)
                           if cfg.sequential and p.block == 1]
        learner.due, learner.read, learner.reduce = self.due, self.read, self.reduce

    def start(self, r_ids: np.ndarray, r_tab: np.ndarray, t_event: int) -> np.ndarray:
        """The owner's side (lookup, inserting): give the requested ids of the task slot's tables
        that this shard lacks the starting point; returns, for each requested id of the first part's
        table (wire order), whether it was new."""
        acc, flags = self.learner.start(), None
        for i, ti in enumerate(self.part_tables):
            table = self.engine.model.tables[self.learner.parts[i].table]
            keys = r_ids[r_tab == ti]
            new = ~table.contains(keys) if keys.size else np.zeros(0, bool)
            if flags is None:
                flags = new
            if new.any():
                self.learner.give_start(i, table, np.unique(keys[new]), t_event, acc)
        assert flags is not None
        return flags

    def start_pass(self, slots: tuple, parts: list, t_event: int) -> None:
        """Rank 0, a sequential model's pass (:mod:`trainer.dist.sequential`), before it runs: give
        the task slot's new first-order ids in the ranks' ``parts`` (over ``slots``) the starting
        point, as the lookups do for the embedding rows."""
        for i, key in self.pass_parts:
            j = slots.index(key)
            keys = np.concatenate([np.split(p.ids, np.cumsum(p.lens.sum(1))[:-1])[j] for p in parts])
            table = self.engine.model.tables[self.learner.parts[i].table]
            new = np.unique(keys[~table.contains(keys)]) if keys.size else keys
            if new.size:
                self.learner.give_start(i, table, new, t_event)

    def new_tasks(self, flags: np.ndarray, rcounts: np.ndarray, counts: np.ndarray, u_ids: np.ndarray,
                  u_tab: np.ndarray) -> np.ndarray:
        """Collective (the lookups' group): each owner's ``flags`` (:meth:`start`) back to their
        requesters; returns this rank's task ids that were new, sorted (``counts``, ``u_ids``,
        ``u_tab``: this rank's plan; its ids of a table, in wire order, are owner by owner)."""
        t0 = self.part_tables[0]
        got = self.engine._a2a(flags.astype(np.uint8), rcounts[:, t0], counts[:, t0], self.group).astype(bool)
        return np.sort(self.learner.parts[0].keys(u_ids[u_tab == t0][got]))

    def due(self, ready: int) -> bool:
        """Collective: whether the ranks' filled tasks add up to ``tasks_per_step``."""
        t = torch.tensor([float(ready)])
        dist.all_reduce(t, group=self.group)
        return int(t.item()) >= self.learner.meta.tasks_per_step

    def read(self, batch) -> tuple:
        """Collective: ``batch``'s rows through the engine's lookup, nothing inserted."""
        lk = self.engine._lookup(batch, insert=False)
        return lk.batch, lk.pb, lk.buf

    def reduce(self, g: torch.Tensor, n: int, failed: bool) -> tuple[torch.Tensor, int, bool]:
        """Collective: the outer step's gradient sums, task counts and failures over the ranks."""
        flat = torch.cat([g.detach().reshape(-1).float(), torch.tensor([float(n), float(failed)])])
        dist.all_reduce(flat, group=self.group)
        return flat[:-2].view_as(g), int(flat[-2].item()), bool(flat[-1].item())
