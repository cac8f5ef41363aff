"""The counting baseline the online trainer keeps beside its model: per-user and per-item click
rates, scored and counted on the same examples in the same order (progressive validation: each
example scored from the counts of the examples before it, then counted).

A learned model that cannot beat counting clicks has not learned the features yet; the trainer
exports both scores' AUC and log loss (``driftline_trainer_baseline_auc``,
``driftline_trainer_log_loss{scorer=...}``), and the status page draws them side by side.

The score is ``logit(user rate) + logit(item rate) - logit(global rate)``, each key's rate smoothed
toward the global rate so far by ``prior`` examples (``(clicks + prior * global) / (seen +
prior)``; the trainer's is ``eval.count_prior``, tuned by ``driftline eval tune``); a model without
a ``user_id`` slot counts items alone. A model that reads where items were shown (its
``position_slot``) has ``+ logit(position rate) - logit(global rate)`` counted beside: its scores
know the places, and a baseline that did not would lose to it by the places alone. The keys are
the first id of the ``item_id``, ``user_id`` (and position) slots: the ids ``/rank`` carries for
every project, not a data set's features. Counts are exact
(:class:`ps.hashmap.HashIndex`, one row per key: about 40 bytes per user and item, next to the
model's own rows for them; counts with a half-life 8 more: the trainer keeps both, the lifetime
counts and the recent ones) and saved in the trainer's snapshots.
``evaluation.baselines`` scores its ``counts`` baseline with this class too.

>>> import numpy as np
>>> c = CountBaseline(prior=1.0)  # no users: item 7's rate, smoothed toward the global rate
>>> p = c.score_and_count(None, np.array([7, 7, 7]), np.array([1.0, 1.0, 0.0]))
>>> [round(float(x), 3) for x in p], c.examples, round(c.log_loss, 3)
([0.5, 0.833, 0.917], 3, 1.12)
"""

from __future__ import annotations

import numpy as np

from ps.hashmap import HashIndex

from .metrics import StreamingAUC

__all__ = ["ITEM_SLOT", "USER_SLOT", "CountBaseline", "first_ids"]

ITEM_SLOT, USER_SLOT = "item_id", "user_id"
#: the places :meth:`CountBaseline.place_ratios` reports by default (the first page of most lists)
PLACES_SHOWN = 20


def first_ids(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each bag's first id; -1 for an empty bag (-1 is then one more key, "no id").

    >>> first_ids(np.array([5, 6, 9]), np.array([0, 2, 2, 3])).tolist()
    [5, -1, 9]
    """
    starts = offsets[:-1]
    out = np.full(starts.size, -1, np.int64)
    has = offsets[1:] > starts
    out[has] = ids[starts[has]]
    return out


class _KeyCounts:
    """Clicks and examples per key (exact: one row per key); with ``half_life``, each count's weight
    halves every ``half_life`` examples counted after it (by any key): kept per key as the counts at
    the clock of its last batch (``at``), decayed when the key is read again."""

    def __init__(self, capacity: int = 1024, half_life: float | None = None) -> None:
        self.index = HashIndex(capacity)
        self.half_life = half_life
        self.clicks = np.zeros(capacity, np.float64)
        self.seen = np.zeros(capacity, np.float64)
        self.at = np.zeros(capacity if half_life is not None else 0, np.float64)
        self.keys = np.zeros(capacity, np.int64)
        self.n = 0

    def rows(self, uniq: np.ndarray) -> np.ndarray:
        """The rows of distinct ``uniq`` keys, new keys given new rows."""
        rows = self.index.lookup(uniq)
        missing = rows < 0
        if missing.any():
            new = uniq[missing]
            if self.n + new.size > self.clicks.size:
                size = max(2 * self.clicks.size, self.n + new.size)
                self.clicks, self.seen, self.keys = (np.resize(a, size) for a in (self.clicks, self.seen, self.keys))
                self.clicks[self.n:] = self.seen[self.n:] = 0
                if self.half_life is not None:
                    self.at = np.resize(self.at, size)
                    self.at[self.n:] = 0
            fresh = np.arange(self.n, self.n + new.size, dtype=np.int64)
            self.index.reserve(self.n + new.size)
            self.index.insert(new, fresh)
            self.keys[fresh] = new
            self.n += new.size
            rows[missing] = fresh
        return rows

    def _decayed(self, rows: np.ndarray, clock: float) -> tuple[np.ndarray, np.ndarray]:
        if self.half_life is None:
            return self.clicks[rows], self.seen[rows]
        keep = 0.5 ** ((clock - self.at[rows]) / self.half_life)
        return self.clicks[rows] * keep, self.seen[rows] * keep

    def rates(self, keys: np.ndarray, y: np.ndarray, known: np.ndarray, g: np.ndarray, prior: float,
              clock: float = 0.0) -> np.ndarray:
        """Each example's smoothed rate from its key's counts before it (earlier batches and earlier
        in this one), then the batch counted; ``clock``: the examples counted before this batch."""
        uniq, inv = np.unique(keys, return_inverse=True)
        rows = self.rows(uniq)
        o = np.argsort(inv, kind="stable")
        k = inv[o]
        first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        start = np.repeat(first, np.diff(np.r_[first, k.size]))
        both = np.stack([y[o], known[o]], 1)
        run = np.cumsum(both, 0) - both
        before = np.empty_like(both)
        before[o] = run - run[start]
        old_clicks, old_seen = self._decayed(rows, clock)
        clicks = old_clicks[inv] + before[:, 0]
        seen = old_seen[inv] + before[:, 1]
        self.clicks[rows] = old_clicks + np.bincount(inv, weights=y, minlength=uniq.size)
        self.seen[rows] = old_seen + np.bincount(inv, weights=known, minlength=uniq.size)
        if self.half_life is not None:
            self.at[rows] = clock
        return (clicks + prior * g) / (seen + prior)

    def frozen_rates(self, keys: np.ndarray, g: float, prior: float, clock: float = 0.0) -> np.ndarray:
        """Each key's smoothed rate from the counts so far, counting nothing (an unseen key: ``g``)."""
        rows = self.index.lookup(np.asarray(keys, np.int64))
        seen = rows >= 0
        clicks, n = self._decayed(np.where(seen, rows, 0), clock)
        return (np.where(seen, clicks, 0.0) + prior * g) / (np.where(seen, n, 0.0) + prior)

    def state(self) -> dict[str, np.ndarray]:
        n = self.n
        state = {"keys": self.keys[:n].copy(), "clicks": self.clicks[:n].copy(), "seen": self.seen[:n].copy()}
        if self.half_life is not None:
            state["at"] = self.at[:n].copy()
        return state

    @classmethod
    def loaded(cls, state: dict[str, np.ndarray], half_life: float | None = None) -> _KeyCounts:
        keys = np.asarray(state["keys"], np.int64)
        counts = cls(max(1024, keys.size), half_life)
        rows = counts.rows(keys)
        counts.clicks[rows] = state["clicks"]
        counts.seen[rows] = state["seen"]
        if half_life is not None and "at" in state:  # (counts saved without a half-life: no decay owed)
            counts.at[rows] = state["at"]
        return counts


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


class CountBaseline:
    """Progressive per-user + per-item click-rate counts; ``auc`` and ``log_loss`` of their scores.

    ``half_life`` (examples; None: every example counts alike) makes it a count of *recent* clicks:
    each example's weight in every rate halves every ``half_life`` examples counted after it. It
    follows a change in the traffic (an item whose appeal changed) where lifetime counts take as
    long as the item's history to; a model that cannot keep up with it is slow to follow changes.

    >>> now, ever = CountBaseline(prior=1.0, half_life=10), CountBaseline(prior=1.0)
    >>> for c in (now, ever):  # item 7 clicked 20 times, then not 8 times
    ...     _ = c.score_and_count(None, np.full(20, 7), np.ones(20))
    ...     for _ in range(8):
    ...         _ = c.score_and_count(None, np.array([7]), np.zeros(1))
    >>> round(float(now.score(None, np.array([7]))[0]), 2), round(float(ever.score(None, np.array([7]))[0]), 2)
    (0.33, 0.71)
    """

    def __init__(self, prior: float, position_slot: str | None = None, half_life: float | None = None) -> None:
        self.prior = prior
        self.position_slot = position_slot
        self.half_life = half_life
        self.users, self.items = _KeyCounts(half_life=half_life), _KeyCounts(half_life=half_life)
        self.positions = _KeyCounts(half_life=half_life) if position_slot is not None else None
        self.clicks = 0.0  # the global rate's counts (decayed with half_life) ...
        self.seen = 0.0
        self.at = 0.0  # ... as of this clock
        self.examples = 0  # labelled examples counted: the clock of the decay
        self.auc = StreamingAUC()
        self.loss_sum = 0.0

    @property
    def log_loss(self) -> float:
        return self.loss_sum / self.examples if self.examples else float("nan")

    def _global(self) -> tuple[float, float]:
        """The global counts (clicks, seen) as of now."""
        if self.half_life is None:
            return self.clicks, self.seen
        keep = 0.5 ** ((self.examples - self.at) / self.half_life)
        return self.clicks * keep, self.seen * keep

    def score_and_count(self, users: np.ndarray | None, items: np.ndarray, labels: np.ndarray,
                        positions: np.ndarray | None = None) -> np.ndarray:
        """Score each example from the counts before it, then count it; ``users`` None: items alone;
        ``positions``: each example's place (counted only with a ``position_slot``). Labels that are
        NaN (unknown) are scored but neither counted nor judged.

        >>> c = CountBaseline(prior=1.0, position_slot="pos")
        >>> _ = c.score_and_count(None, np.array([7, 8, 7, 8]), np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 1, 0, 1]))
        >>> [round(float(x), 3) for x in c.score(None, np.array([7, 7]), np.array([0, 1]))]  # one item, two places
        [0.962, 0.5]
        """
        known = ~np.isnan(labels)
        y = np.where(known, labels, 0.0).astype(np.float64)
        k = known.astype(np.float64)
        clicks, seen = self._global()
        clock = float(self.examples)
        g = (clicks + np.cumsum(y) - y + 1.0) / (seen + np.cumsum(k) - k + 2.0)  # global rate so far
        z = _logit(self.items.rates(items, y, k, g, self.prior, clock))
        if users is not None:
            z += _logit(self.users.rates(users, y, k, g, self.prior, clock)) - _logit(g)
        if positions is not None and self.positions is not None:
            z += _logit(self.positions.rates(positions, y, k, g, self.prior, clock)) - _logit(g)
        p = 1.0 / (1.0 + np.exp(-z))
        self.clicks, self.seen, self.at = clicks + float(y.sum()), seen + float(k.sum()), clock
        self.examples += int(known.sum())
        self.auc.update(p[known], y[known])
        q = np.clip(p[known], 1e-7, 1 - 1e-7)
        self.loss_sum -= float((y[known] * np.log(q) + (1 - y[known]) * np.log1p(-q)).sum())
        return p.astype(np.float32)

    def score(self, users: np.ndarray | None, items: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """Scores from the counts so far, counting nothing (a held-out set scored by frozen counts).

        >>> c = CountBaseline(prior=1.0)
        >>> _ = c.score_and_count(None, np.array([7, 7, 8]), np.array([1.0, 1.0, 0.0]))
        >>> [round(float(x), 3) for x in c.score(None, np.array([7, 9]))]  # 9: unseen, the global rate
        [0.867, 0.6]
        """
        clicks, seen = self._global()
        g = (clicks + 1.0) / (seen + 2.0)
        clock = float(self.examples)
        z = _logit(self.items.frozen_rates(items, g, self.prior, clock))
        if users is not None:
            z += _logit(self.users.frozen_rates(users, g, self.prior, clock)) - _logit(np.float64(g))
        if positions is not None and self.positions is not None:
            z += _logit(self.positions.frozen_rates(positions, g, self.prior, clock)) - _logit(np.float64(g))
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)

    def place_ratios(self, places: int = PLACES_SHOWN) -> dict[int, float]:
        """The click rate at each of the first ``places`` places counted so far over the first
        place's (empty without places, or before the first place has a click): how much less an
        item is clicked further down. A ratio, so negative sampling (the same rate at every
        place) does not change it.

        >>> c = CountBaseline(prior=1.0, position_slot="pos")
        >>> _ = c.score_and_count(None, np.arange(6), np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), np.array([0, 0, 1, 1, 2, 2]))
        >>> c.place_ratios()
        {0: 1.0, 1: 0.5, 2: 0.0}
        """
        if self.positions is None:
            return {}
        keys = np.arange(places, dtype=np.int64)
        rows = self.positions.index.lookup(keys)
        seen = rows >= 0
        if not seen[0] or self.positions.clicks[rows[0]] == 0:
            return {}
        rates = self.positions.clicks[rows[seen]] / self.positions.seen[rows[seen]]
        return {int(k): float(r / rates[0]) for k, r in zip(keys[seen], rates)}

    def positions_of(self, batch) -> np.ndarray | None:
        """The batch's first ``position_slot`` ids (None: no such slot, or none in the batch)."""
        if self.position_slot is None or self.position_slot not in batch.ids:
            return None
        return first_ids(*batch.bag(self.position_slot))

    def score_batch(self, batch) -> np.ndarray | None:
        """:meth:`score_and_count` on a :class:`trainer.batch.SparseBatch` (None: no ``item_id`` slot)."""
        if ITEM_SLOT not in batch.ids or batch.labels is None:
            return None
        users = first_ids(*batch.bag(USER_SLOT)) if USER_SLOT in batch.ids else None
        return self.score_and_count(users, first_ids(*batch.bag(ITEM_SLOT)), batch.labels.astype(np.float64),
                                    self.positions_of(batch))

    def state(self) -> dict:
        state = {"prior": self.prior, "users": self.users.state(), "items": self.items.state(), "clicks": self.clicks,
                 "seen": self.seen, "at": self.at, "examples": self.examples, "auc_pos": self.auc.pos,
                 "auc_neg": self.auc.neg, "loss_sum": self.loss_sum}
        if self.positions is not None:
            state["positions"] = self.positions.state()
        return state

    def load(self, state: dict) -> None:
        """A saved state (one without places, saved before the model read them: places counted from now)."""
        h = self.half_life
        self.users, self.items = _KeyCounts.loaded(state["users"], h), _KeyCounts.loaded(state["items"], h)
        if self.positions is not None:
            self.positions = _KeyCounts.loaded(state["positions"], h) if "positions" in state else _KeyCounts(half_life=h)
        self.clicks, self.examples = float(state["clicks"]), int(state["examples"])
        # (a state saved before the global counts had their own: every example counted, none decayed)
        self.seen, self.at = float(state.get("seen", self.examples)), float(state.get("at", self.examples))
        self.auc.load(state["auc_pos"], state["auc_neg"])
        self.loss_sum = float(state["loss_sum"])
