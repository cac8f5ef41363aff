"""What a trainer process has learned, batch by batch: :class:`Learned` (one per trainer process,
the 1-process trainer's and each rank's) keeps the examples counted, the streaming AUC and loss,
the sample rates, the dedup window's ids and the partitions' next offsets, and asks for their
commit; :class:`LearnedFields` names its counts as the trainers' snapshots, results and tests do.
(Kept apart from :mod:`trainer.metrics`: it owns the offsets, the dedup window and the commits,
more than metrics.)"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from .metrics import (
    AUC,
    BASELINE_AUC,
    EXAMPLES,
    EXAMPLES_PER_S,
    LOG_LOSS,
    LOSS,
    PLACE_CLICK_RATIO,
    RANK_EXAMPLES,
    RECENT_AUC,
    TRAILS_RECENT_COUNTS,
    PSCounts,
    StreamingAUC,
)


class Learned:
    """The bookkeeping of learned batches, one per trainer process (the 1-process trainer's and each
    rank's alike): the streaming AUC (progressive validation: ``probs`` scored before the update),
    the sample rates, the examples counted and their gauges, the loss EMA, and per batch done its
    ids into the dedup window, its partitions' next offsets and a commit request. ``auc``,
    ``sample_rates``, ``dedup``, ``published`` (the publisher's ``applied``) belong to the trainer;
    ``commit`` is set once its committer exists; ``rank``: a rank's examples are also counted by rank.

    With ``recent_baseline`` (a :class:`trainer.count_baseline.CountBaseline` with a half-life) the
    model, ``baseline`` and it are also judged on the recent examples (:attr:`recent`: AUCs whose
    examples' weights halve every ``recent_baseline.half_life`` examples): the lifetime AUC of a long
    stream hardly moves when the traffic changes, these do, and a model whose recent AUC is below
    that of counting recent clicks follows the change slower than counting does
    (``driftline_trainer_trails_recent_counts``, once two half-lives of examples were judged).

    >>> from trainer.sample_rates import SampleRateTracker
    >>> from trainer.batch import SparseBatch
    >>> b = SparseBatch.from_slot_dicts([{"a": [1]}, {"a": [2]}], slots=["a"], labels=[1.0, 0.0], event_time_ms=[5, 6],
    ...                                 sample_rate=[1.0, 0.5])
    >>> book = Learned("doc", StreamingAUC(), SampleRateTracker(1e6))
    >>> book.batch(b, 0.5, np.array([0.9, 0.1]), np.array([0, 0]))
    >>> book.done(None, {0: 7}); book.done(None, {0: 3})  # offsets only move forward
    >>> book.examples, book.loss_ema, book.auc.value(), book.offsets
    (2, 0.5, 1.0, {0: 7})
    """

    def __init__(self, model_id: str, auc: StreamingAUC, sample_rates, dedup=None,
                 published: Callable[[np.ndarray, np.ndarray], None] | None = None, ps_counts: PSCounts | None = None,
                 rank: int | None = None, baseline=None, recent_baseline=None):
        self.model_id, self.auc, self.sample_rates, self.dedup = model_id, auc, sample_rates, dedup
        #: a :class:`trainer.count_baseline.CountBaseline` scored beside the model (None: none)
        self.baseline = baseline
        self.recent_baseline = recent_baseline
        half_life = None if recent_baseline is None else recent_baseline.half_life
        #: scorer -> its AUC on the recent examples ({}: none kept)
        self.recent: dict[str, StreamingAUC] = {} if half_life is None else {
            name: StreamingAUC(1024, half_life) for name in ("model", "counts", "recent_counts")}
        self.recent_examples = 0  # labelled examples the recent AUCs have judged
        self.log_loss_sum, self.log_loss_n = 0.0, 0  # the model's progressive log loss
        self.published, self.ps_counts = published, ps_counts
        self.by_rank = None if rank is None else RANK_EXAMPLES.labels(model_id, str(rank))
        self.commit: Callable[[], None] = lambda: None
        self.examples = 0
        self.loss_ema = float("nan")
        self.offsets: dict[int, int] = {}  # partition -> next offset of everything done
        self._rate_mark = (time.monotonic(), 0)

    def batch(self, batch, loss: float, probs: np.ndarray, arrival_ms: np.ndarray | None) -> None:
        """``batch`` was learned (``probs``: its scores before the update; ``loss``: the step's)."""
        self.auc.update(probs, batch.labels)
        self.sample_rates.update(batch.slice_ids, batch.slice_names, batch.sample_rate, batch.labels)
        self.examples += batch.size
        if self.published is not None:
            self.published(batch.event_time_ms, arrival_ms)
        if self.ps_counts is not None:
            self.ps_counts.update()
        self.loss_ema = loss if math.isnan(self.loss_ema) else 0.98 * self.loss_ema + 0.02 * loss
        self._score(batch, probs)
        EXAMPLES.labels(self.model_id, "online").inc(batch.size)
        if self.by_rank is not None:
            self.by_rank.inc(batch.size)
        LOSS.labels(self.model_id, "online").set(self.loss_ema)
        AUC.labels(self.model_id, "online").set(self.auc.value())

    def _score(self, batch, probs: np.ndarray) -> None:
        """The model's progressive log loss, and the baseline scored and counted on the same batch."""
        known = ~np.isnan(batch.labels)
        y = batch.labels[known].astype(np.float64)
        q = np.clip(np.asarray(probs, np.float64)[known], 1e-7, 1 - 1e-7)
        self.log_loss_sum -= float((y * np.log(q) + (1 - y) * np.log1p(-q)).sum())
        self.log_loss_n += int(y.size)
        if self.log_loss_n:
            LOG_LOSS.labels(self.model_id, "model").set(self.log_loss_sum / self.log_loss_n)
        counted = self.baseline.score_batch(batch) if self.baseline is not None else None
        if counted is not None and self.baseline.examples:
            BASELINE_AUC.labels(self.model_id, "counts").set(self.baseline.auc.value())
            LOG_LOSS.labels(self.model_id, "counts").set(self.baseline.log_loss)
            for place, ratio in self.baseline.place_ratios().items():
                PLACE_CLICK_RATIO.labels(self.model_id, str(place)).set(ratio)
        if self.recent:
            self._recent(batch, probs, counted)

    def _recent(self, batch, probs: np.ndarray, counted: np.ndarray | None) -> None:
        recent = self.recent_baseline.score_batch(batch)
        self.recent["model"].update(probs, batch.labels)
        self.recent_examples += int((~np.isnan(batch.labels)).sum())
        for name, p in (("counts", counted), ("recent_counts", recent)):
            if p is not None:
                self.recent[name].update(p, batch.labels)
        values = {name: a.value() for name, a in self.recent.items()}
        for name, v in values.items():
            if not math.isnan(v):
                RECENT_AUC.labels(self.model_id, name).set(v)
        gap = values["recent_counts"] - values["model"]
        judged = self.recent_examples >= 2 * self.recent_baseline.half_life
        TRAILS_RECENT_COUNTS.labels(self.model_id).set(gap if judged and gap > 0 else 0.0)

    def scores(self) -> dict:
        """The model's progressive log loss beside the baseline's AUC and log loss, and every scorer's
        recent AUC (a result line's)."""
        b = self.baseline
        return {"log_loss": self.log_loss_sum / self.log_loss_n if self.log_loss_n else None,
                "baseline_auc": b.auc.value() if b is not None and b.examples else None,
                "baseline_log_loss": b.log_loss if b is not None and b.examples else None,
                "recent_auc": {name: _or_none(a.value()) for name, a in self.recent.items()}}

    def scores_state(self) -> dict:
        """The model's log loss sums, both baselines' states and the recent AUCs, for a snapshot."""
        return {"log_loss": [self.log_loss_sum, self.log_loss_n],
                "count_baseline": None if self.baseline is None else self.baseline.state(),
                "recent_counts": None if self.recent_baseline is None else self.recent_baseline.state(),
                "recent_auc": {name: [a.pos, a.neg] for name, a in self.recent.items()},
                "recent_examples": self.recent_examples}

    def load_scores(self, state: dict | None) -> None:
        """Continue from :meth:`scores_state` (None, or a snapshot written before it existed: afresh)."""
        if not state:
            return
        self.log_loss_sum, self.log_loss_n = float(state["log_loss"][0]), int(state["log_loss"][1])
        if self.baseline is not None and state.get("count_baseline"):
            self.baseline.load(state["count_baseline"])
        if self.recent_baseline is not None and state.get("recent_counts"):
            self.recent_baseline.load(state["recent_counts"])
        saved = state.get("recent_auc") or {}
        if self.recent and set(saved) == set(self.recent):  # (else: judged afresh from here)
            for name, (pos, neg) in saved.items():
                if len(pos) == self.recent[name].bins:
                    self.recent[name].load(pos, neg)
            self.recent_examples = int(state.get("recent_examples", 0))

    def done(self, hashes: np.ndarray | None, offsets: dict[int, int]) -> None:
        """A polled batch is done (learned, dead-lettered or dropped as duplicates): its ids enter
        the dedup window (only now: a snapshot never marks as seen an example not learned), its
        offsets move on, and a commit of them is asked for."""
        if self.dedup is not None and hashes is not None:
            self.dedup.add_many(hashes)
        for part, off in offsets.items():
            if off > self.offsets.get(part, -1):
                self.offsets[part] = off
        self.commit()

    def rate(self, now: float) -> None:
        """Export the examples/s since the last export, at most once a second (monotonic ``now``)."""
        t, n = self._rate_mark
        if now - t >= 1.0:
            EXAMPLES_PER_S.labels(self.model_id, "online").set((self.examples - n) / (now - t))
            self._rate_mark = (now, self.examples)


def _or_none(x: float) -> float | None:
    return None if math.isnan(x) else x


class LearnedFields:
    """A trainer's counts, kept by its :class:`Learned` (``self.learned``), under the names its
    snapshots, results and tests use."""

    learned: Learned

    @property
    def examples_applied(self) -> int:
        return self.learned.examples

    @examples_applied.setter
    def examples_applied(self, n: int) -> None:
        self.learned.examples = n

    @property
    def applied_offsets(self) -> dict[int, int]:
        return self.learned.offsets

    @applied_offsets.setter
    def applied_offsets(self, offsets: dict[int, int]) -> None:
        self.learned.offsets = offsets

    @property
    def loss_ema(self) -> float:
        return self.learned.loss_ema
