"""Display positions: what ``/rank`` scores a position feature at, and what it logs of it.

Where an item is shown changes whether it is clicked (the first place is looked at most), so a
model that learns from clicks learns the places too: a project may declare one feature with
``source = "position"`` (:attr:`trainer.config.ModelConfig.position_slot`). A request cannot know
the places yet (the ranking decides them), so serving scores every candidate at the first place
(0, or the request's ``first_position`` for a later page), the same for all: the ranking is then
by what the model learned of the items, users and context, not by where items happened to be
shown before. The feature log carries, for each candidate, the place serving answered it at
(``first_position`` + its place in the answer), which is where a client that shows the answer in
order shows it: the trainer learns from the places the clicks came at.

A candidate that gives its own position (a replayed log's, or a client that places items itself
and says where) is scored and logged as given: one place, 0 or more (:func:`check_given`). A
request-wide position is refused (:func:`check_context`): it is per candidate.

>>> user, items = scored_at_first("pos", {"user_id": [7]}, [{"item_id": [1]}, {"item_id": [2], "pos": [4]}],
...                               given=[1])
>>> user, items
({'user_id': [7]}, [{'item_id': [1], 'pos': [0]}, {'item_id': [2], 'pos': [4]}])
>>> rows, keys = logged_at_answer("pos", [{"item_id": [1]}, {"item_id": [2], "pos": [4]}], [b"k1", None],
...                               order=[1, 0], given=[1])
>>> rows, keys
([{'item_id': [1], 'pos': [1]}, {'item_id': [2], 'pos': [4]}], [b'k1\\x00@1', None])

The second page of a list of 20 starts at place 20 (``/rank``'s ``first_position``):

>>> logged_at_answer("pos", [{"item_id": [1]}, {"item_id": [2]}], [None, None], order=[1, 0], given=[], first=20)[0]
[{'item_id': [1], 'pos': [21]}, {'item_id': [2], 'pos': [20]}]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from serving.request_features import BadFeatures, Slots

__all__ = ["check_context", "check_given", "given_by", "logged_at_answer", "scored_at_first"]


def check_context(position: str, context_slots: Iterable[str]) -> None:
    """:class:`BadFeatures` when the request's context names the position (it is per candidate)."""
    if position in context_slots:
        raise BadFeatures(f"context.sparse: {position!r} is the position a candidate is shown at: give it in a "
                          "candidate's features, or leave it out (serving logs the place it answers each candidate at)")


def check_given(position: str, where: str, slots: Mapping[str, Sequence[int]]) -> None:
    """:class:`BadFeatures` unless a candidate's own position, if it gives one, is one place >= 0.

    >>> check_given("pos", "candidates[2].features.sparse", {"pos": [1, 2]})
    Traceback (most recent call last):
    ...
    serving.request_features.BadFeatures: candidates[2].features.sparse: 'pos' is the place the candidate is shown at: one id, 0 or more (0 = first), got [1, 2]
    """
    ids = slots.get(position)
    if ids is not None and (len(ids) != 1 or ids[0] < 0):
        raise BadFeatures(f"{where}: {position!r} is the place the candidate is shown at: one id, 0 or more "
                          f"(0 = first), got {list(ids)}")


def given_by(position: str, item_slots: Sequence[Slots], featured: Iterable[int]) -> list[int]:
    """The candidates (of those with features of their own, ``featured``) that give their position."""
    return [i for i in featured if position in item_slots[i]]


def scored_at_first(position: str, user_slots: Slots, item_slots: Sequence[Slots],
                    given: Sequence[int], first: int = 0) -> tuple[Slots, list[Slots]]:
    """The slots to score: every candidate at the answer's first place (``first``: 0, or where a
    later page starts) but those that gave theirs (``given``). With none given the position joins
    the user's slots (scored once per request, and the rows, which may be the store's shared
    ones, are not copied); ``user_slots`` is left as it is."""
    user = {k: v for k, v in user_slots.items() if k != position}
    if not given:
        user[position] = [first]
        return user, list(item_slots)
    own = set(given)
    return user, [row if i in own else {**row, position: [first]} for i, row in enumerate(item_slots)]


def logged_at_answer(position: str, item_slots: Sequence[Slots], keys: Sequence[bytes | None],
                     order: Sequence[int] | np.ndarray, given: Sequence[int],
                     first: int = 0) -> tuple[list[Slots], list[bytes | None]]:
    """Each candidate's logged slots and feature-log cache key with the place it was answered at
    (``order``: the answer's candidate indexes, best first; ``first``: the place of the answer's
    first item), but those that gave theirs. A key names the candidate's whole logged features,
    so the place is part of it."""
    n = len(item_slots)
    place = np.empty(n, np.int64)
    place[np.asarray(order, np.int64)] = np.arange(first, first + n)
    places = place.tolist()
    own = set(given)
    rows: list[Slots] = []
    out_keys: list[bytes | None] = []
    for i, (row, key) in enumerate(zip(item_slots, keys)):
        if i in own:
            rows.append(row)
            out_keys.append(key)
            continue
        rows.append({**row, position: [places[i]]})
        out_keys.append(None if key is None else key + b"\x00@%d" % places[i])
    return rows, out_keys
