"""Train a batch without letting one record stop the trainer: find the records a step fails on.

A record can pass every check and still make the training step raise (a value no check foresaw,
a bug a rare input reaches). Raising would stop the trainer, and the restart would fetch the same
record and stop again: a crash loop. Instead, when a batch's step raises, the batch is split in
halves and each half is trained on its own, recursively, down to single records: the records whose
step fails alone are returned (the trainer dead-letters them with the error), every other record is
trained once, in order.

This relies on a failing step changing no parameter (:meth:`trainer.model.SparseModel.train_step`
checks the loss and gradients before it applies anything), so a half can be retried. What a failed
step does leave: the rows its forward pass inserted (a later step would insert them anyway) and
their admission counts (an id seen in a failed step counts once more towards ``min_count``).

>>> import numpy as np
>>> from trainer.batch import SparseBatch
>>> b = SparseBatch.from_slot_dicts([{"a": [i]} for i in range(5)], slots=["a"], labels=[0.0] * 5)
>>> def step(batch):  # fails on any batch holding id 3
...     if (batch.ids["a"] == 3).any():
...         raise ValueError("id 3")
...     return 0.5, np.full(batch.size, 0.25, np.float32)
>>> r = train_isolating(step, b)
>>> r.applied.tolist(), [(row, str(err)) for row, err in r.failed], r.probs.tolist(), r.loss
([0, 1, 2, 4], [(3, 'id 3')], [0.25, 0.25, 0.25, 0.25], 0.5)

Out of memory on every record alone is the machine's fault, not the records': it is raised (the
trainer stops, to be restarted from its snapshot) rather than every record dead-lettered and its
offset committed. One record that runs out of memory while the others train (ids by the million)
is that record's fault, and dead-lettered like any other.

>>> def starved(batch):
...     raise MemoryError("no memory")
>>> train_isolating(starved, b)
Traceback (most recent call last):
...
MemoryError: no memory
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .batch import SparseBatch

log = logging.getLogger(__name__)

Step = Callable[[SparseBatch], tuple[float, np.ndarray]]


@dataclass
class StepResult:
    """A batch's training: mean ``loss`` and ``probs`` of the rows applied (``applied``: their row
    indices in the batch, None when all were), and ``failed``: ``(row, error)`` of each record
    whose step failed on its own (nothing of it was learned)."""

    loss: float
    probs: np.ndarray
    applied: np.ndarray | None = None
    failed: list[tuple[int, Exception]] = field(default_factory=list)


def train_isolating(step: Step, batch: SparseBatch) -> StepResult:
    """``step(batch)``; if it raises, bisect (see the module docstring). Never raises for a
    record's sake: if every record fails on its own, each is returned as failed (and it is logged
    as an error: the trainer itself may be broken, which the dead letters then show)."""
    try:
        loss, probs = step(batch)
        return StepResult(loss, probs)
    except Exception as err:  # noqa: BLE001 - any step failure is isolated, then reported
        log.warning("a training step on %d examples failed (%s: %s); isolating the record(s) it fails on",
                    batch.size, type(err).__name__, err)
        first = err
    done: list[tuple[np.ndarray, float, np.ndarray]] = []
    failed: list[tuple[int, Exception]] = []
    _bisect(step, batch, np.arange(batch.size, dtype=np.int64), first, done, failed)
    if batch.size > 1 and len(failed) == batch.size:
        if all(out_of_memory(e) for _, e in failed):
            raise failed[0][1]
        log.error("every one of %d examples failed its training step on its own (%r): a broken "
                  "trainer rather than poison records?", batch.size, first)
    if not done:
        return StepResult(float("nan"), np.zeros(0, np.float32), np.zeros(0, np.int64), failed)
    rows = np.concatenate([r for r, _, _ in done])
    n = int(rows.size)
    loss = sum(part_loss * r.size for r, part_loss, _ in done) / n
    return StepResult(float(loss), np.concatenate([p for _, _, p in done]), rows, failed)


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed (numpy's ``MemoryError``, torch's CPU allocator,
    which raises a plain ``RuntimeError``, or its ``OutOfMemoryError`` on a GPU).

    >>> out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"))
    True
    >>> out_of_memory(ValueError("id 3"))
    False
    """
    if isinstance(err, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def _bisect(step: Step, batch: SparseBatch, rows: np.ndarray, err: Exception,
            done: list, failed: list) -> None:
    """``rows`` failed together with ``err``: train each half alone, recursing into failing ones
    (halves in order, so the rows applied stay in batch order)."""
    if rows.size == 1:
        failed.append((int(rows[0]), err))
        return
    mid = rows.size // 2
    for half in (rows[:mid], rows[mid:]):
        try:
            loss, probs = step(batch.select(half))
        except Exception as e:  # noqa: BLE001 - narrowed down further
            _bisect(step, batch, half, e, done, failed)
        else:
            done.append((half, loss, probs))


def train_isolating_lockstep(step: Step, batch: SparseBatch, own_error: Callable[[Exception], Exception | None],
                             more: Callable[[int], bool]) -> StepResult:
    """:func:`train_isolating` for ranks that step together (:mod:`trainer.dist.rank_trainer`): every rank
    calls it with its batch (empty when idle) and every call of ``step`` is collective. A failed
    step raises on every rank at once and applies nothing anywhere; ``own_error(err)`` is this
    rank's own error in it (None: another rank's batch failed, re-raised when not a step failure).
    Then every rank works through a queue of its rows, one piece per collective step (an empty
    piece when it has none left): a piece that failed here is halved (a single row is failed), a
    piece that was fine but stepped with a failing one is retried. ``more(pieces left here)``:
    whether any rank has pieces left (collective, once per retry round). Rows are applied in order.

    >>> b = SparseBatch.from_slot_dicts([{"a": [i]} for i in range(4)], slots=["a"], labels=[0.0] * 4)
    >>> def step(batch):  # one rank: its own failure
    ...     if (batch.ids["a"] == 2).any():
    ...         raise ValueError("id 2")
    ...     return 0.5, np.full(batch.size, 0.25, np.float32)
    >>> r = train_isolating_lockstep(step, b, lambda err: err, lambda left: left > 0)
    >>> r.applied.tolist(), [(row, str(err)) for row, err in r.failed]
    ([0, 1, 3], [(2, 'id 2')])
    """
    try:
        loss, probs = step(batch)
        return StepResult(loss, probs)
    except Exception as err:  # noqa: BLE001 - own_error re-raises what is not a step failure
        mine = own_error(err)
    rows = np.arange(batch.size, dtype=np.int64)
    pieces: deque[np.ndarray] = deque()
    done: list[tuple[np.ndarray, float, np.ndarray]] = []
    failed: list[tuple[int, Exception]] = []

    def settle(piece: np.ndarray, err: Exception | None) -> None:
        if err is None:
            pieces.appendleft(piece)  # fine here: another rank's piece failed the step
        elif piece.size == 1:
            failed.append((int(piece[0]), err))
        else:
            mid = piece.size // 2
            pieces.extendleft([piece[mid:], piece[:mid]])

    if rows.size:
        settle(rows, mine)
    while more(len(pieces)):
        piece = pieces.popleft() if pieces else rows[:0]
        try:
            loss, probs = step(batch.select(piece))
        except Exception as err:
            mine = own_error(err)
            if piece.size == 0 and mine is not None:
                raise  # an empty piece failed here: the trainer, not an example
            if piece.size:
                settle(piece, mine)
        else:
            if piece.size:
                done.append((piece, loss, probs))
    if batch.size > 1 and len(failed) == batch.size and all(out_of_memory(e) for _, e in failed):
        raise failed[0][1]  # (the machine's fault, as in train_isolating: the group restarts from its manifest)
    if failed:
        log.warning("%d example(s) failed their training step on their own: %s", len(failed),
                    "; ".join(f"row {r}: {e!r}" for r, e in failed[:3]))
    if not done:
        return StepResult(float("nan"), np.zeros(0, np.float32), np.zeros(0, np.int64), failed)
    order = np.argsort(np.concatenate([r for r, _, _ in done]), kind="stable")
    applied = np.concatenate([r for r, _, _ in done])[order]
    n = int(applied.size)
    loss = sum(part_loss * r.size for r, part_loss, _ in done) / n
    return StepResult(float(loss), np.concatenate([p for _, _, p in done])[order], applied, failed)


def train_isolating_ranks(dm, batch: SparseBatch) -> StepResult:
    """``dm.step(batch)`` of a :class:`trainer.dist.model.DistributedModel` (its ``hybrid``
    overlap included: a failed step raises before its sparse update is deferred), finding the
    examples a failed step fails on with :func:`train_isolating_lockstep` (collective, as the step;
    a failure no example of any rank caused is raised)."""
    import torch
    import torch.distributed as dist

    from .dist.model import RankStepError

    def own(err: Exception) -> Exception | None:
        if not isinstance(err, RankStepError):
            raise err
        return err.local if dm.rank in err.failed else None

    def any_left(left: int) -> bool:
        t = torch.tensor([left], dtype=torch.int64)
        dist.all_reduce(t, group=dm.group)
        return int(t) > 0

    return train_isolating_lockstep(dm.step, batch, own, any_left)
