"""Which of a ``/rank``'s candidates are impressions: the ones the client shows.

A ranker often scores many candidates and shows a few (ranks 500, shows the first 10). A
candidate that was answered but never shown was not passed over by the user: logged, the joiner
would make it a negative example, and the model would learn that what it already ranks low is
not clicked, which keeps it low (measured in ``bench/bench_position.py`` with ``CANDIDATES=30
SHOWN=10``). A request's ``shown`` says how many of the answer's first items the client shows:
only they are logged; the answer still carries every candidate, scored.

>>> logged_of([2, 0, 3, 1], shown=2).tolist()  # the best two, in the request's order
[0, 2]
>>> logged_of([2, 0, 3, 1], shown=None) is None, logged_of([2, 0, 3, 1], shown=9) is None  # all of them
(True, True)
>>> take([0, 2], ["a", "b", "c"], None)
(['a', 'c'], None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["logged_of", "take"]


def logged_of(order: Sequence[int] | np.ndarray, shown: int | None) -> np.ndarray | None:
    """The indexes (in the request's order) of the candidates the client shows: the answer's first
    ``shown`` (``order``: the answer's candidate indexes, best first); None when it shows all."""
    if shown is None or shown >= len(order):
        return None
    return np.sort(np.asarray(order)[:shown])


def take(indexes: Sequence[int] | np.ndarray, *columns: Sequence[Any] | None) -> tuple[list[Any] | None, ...]:
    """Each column (None stays None) at ``indexes``."""
    idx = [int(i) for i in indexes]
    return tuple(None if c is None else [c[i] for i in idx] for c in columns)
