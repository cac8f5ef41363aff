"""What ``/rank`` scores and logs for one request: the features the served model declares, and no other.

The served model declares its features (:class:`Declared`: its sparse slots and its dense
features in input order, from its :class:`trainer.config.ModelConfig`). Serving adds a slot of its
own only when the model reads it: ``user_id`` (the request's) and ``item_id`` (the candidate's)
when the store holds none for them, ``recent_items`` (the user's last clicks). Stored user and item slots the
model does not read are left out: the store is shared, and a feature logged that the model does not
know makes the trainer dead-letter the example (``unknown_slot``).

A request that names a feature the model does not know, or leaves out one of its dense features,
is a client error (:class:`BadFeatures`, a 422 naming the feature): a 200 would log an impression
the trainer refuses; with ``serving.unknown_features = "ignore"`` such features are dropped
(:func:`drop_unknown`) and counted instead. Dense values come from the request, else from the
store (a user's or an item's, :func:`logged_dense`); a candidate's value (its own, else its item's
stored one) replaces the context's (the request's, else the user's stored one) of the same name:
the joiner merges the logged values the same way, so training sees what was scored.

>>> d = Declared.of(["item_id", "user_id"], ["hour"])
>>> user, items, keys = slots_for(d, 7, {"age": [3]}, [], [None, {"item_id": [2], "genres": [1]}, {}],
...                               [1, 2, 3], [None, b"item_id=2;genres=1", b""])
>>> user, items
({'user_id': [7]}, [{'item_id': [1]}, {'item_id': [2]}, {'item_id': [3]}])
>>> keys[0] == b"\x01" + d.token, keys[1] == b"item_id=2;genres=1" + bytes(1) + d.token, keys[2] == bytes(1) + d.token
(True, True, True)
>>> dense_for(d, {"hour": 3.0}, [None, {"hour": 5.0}]).tolist()
[[3.0], [5.0]]
>>> check_names(d, "context.sparse", ["device"])
Traceback (most recent call last):
...
serving.request_features.BadFeatures: context.sparse: the model has no sparse feature 'device' (its sparse features: item_id, user_id)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from trainer.config import RECENT_ITEMS  # the real-time slot (:mod:`serving.realtime`)

Slots = dict[str, list[int]]

#: the slots /rank's own fields fill: the request's user_id, each candidate's item_id
USER_ID = "user_id"
ITEM_ID = "item_id"


class BadFeatures(ValueError):
    """A request's features do not fit the served model (a 422 with this message)."""


@dataclass(frozen=True)
class Declared:
    """The features a model reads: sparse slot names and dense feature names (in input order).

    ``token`` names the declaration in cache keys: an item's stored value with slots left out
    encodes differently under another declaration. ``position``: the slot of the place a
    candidate is shown at (:mod:`serving.positions`), if the model reads one."""

    slots: frozenset[str]
    dense: tuple[str, ...]
    token: bytes
    position: str | None = None

    @classmethod
    def of(cls, slots: Iterable[str], dense: Sequence[str] = (), position: str | None = None) -> Declared:
        slots, dense = frozenset(slots), tuple(dense)
        token = hashlib.blake2b(repr((sorted(slots), dense, position)).encode(), digest_size=8).digest()
        return cls(slots, dense, token, position)


def drop_unknown(declared: Declared, names: dict, dense: bool = False) -> int:
    """Remove from ``names`` (in place) the features the model does not declare; how many.

    >>> feats = {"item_id": [1], "device": [2]}
    >>> drop_unknown(Declared.of(["item_id"]), feats), feats
    (1, {'item_id': [1]})
    """
    known = set(declared.dense) if dense else declared.slots
    unknown = [n for n in names if n not in known]
    for name in unknown:
        del names[name]
    return len(unknown)


def check_names(declared: Declared, where: str, names: Iterable[str], dense: bool = False) -> None:
    """Raise :class:`BadFeatures` for the first name in ``names`` the model does not declare."""
    known = set(declared.dense) if dense else declared.slots
    for name in names:
        if name not in known:
            kind = "dense" if dense else "sparse"
            listed = ", ".join(sorted(known)) or "none"
            raise BadFeatures(f"{where}: the model has no {kind} feature {name!r} (its {kind} features: {listed})")


def slots_for(declared: Declared, user_id: int, user: Slots | None, recent: list[int],
              items: Sequence[Slots | None], item_ids: Sequence[int],
              raws: Sequence[bytes | None] | None = None) -> tuple[Slots, list[Slots], list[bytes | None]]:
    """The user's and each candidate's sparse slots from the store, reduced to what the model reads
    (the request's own features are added by the caller), and each candidate's feature-log cache
    key (:class:`serving.feature_log.FeatureLogEncoder`): its raw stored value (``raws``), qualified
    by the declaration when the served slots differ from the stored ones (some left out, or
    ``item_id`` added); for an item the store does not hold, the declaration's token (its row is
    the same for every such item but its ``item_id``). A candidate's row may be the
    store's cached value itself or one shared between requests (no copy per candidate): replace
    it, never change it in place."""
    slots = declared.slots
    user_slots: Slots = {k: v for k, v in user.items() if k in slots} if user is not None else {}
    if USER_ID in slots and USER_ID not in user_slots:
        user_slots[USER_ID] = [user_id]
    if recent and RECENT_ITEMS in slots:
        user_slots[RECENT_ITEMS] = recent
    if raws is None:
        pairs = [_item_row(declared, item_id, stored, None) for item_id, stored in zip(item_ids, items)]
        return user_slots, [row for row, _ in pairs], [key for _, key in pairs]
    # A row and its key depend only on (item_id, raw stored value) under one declaration: looked
    # up in one C-level pass (map over zip), computed in Python only for the ones not seen yet.
    memo = _ROWS.get(declared.token)
    if memo is None or len(memo) > _ROWS_MAX:
        memo = _ROWS[declared.token] = {}
    wanted = list(zip(item_ids, raws))
    found = list(map(memo.get, wanted))
    if None in found:
        for i, hit in enumerate(found):
            if hit is None:
                item_id, raw = wanted[i]
                hit = found[i] = _item_row(declared, item_id, items[i], raw)
                if raw is not None or items[i] is None:  # (id, None): only an item the store lacks
                    memo[wanted[i]] = hit
    return user_slots, [row for row, _ in found], [key for _, key in found]


#: declaration token -> {(item_id, raw stored value or None): (row, feature-log key)}
_ROWS: dict[bytes, dict[tuple[int, bytes | None], tuple[Slots, bytes | None]]] = {}
_ROWS_MAX = 200_000


def _item_row(declared: Declared, item_id: int, stored: Slots | None, raw: bytes | None) -> tuple[Slots, bytes | None]:
    """One candidate's served row and feature-log key (:func:`slots_for`)."""
    slots = declared.slots
    add_item = ITEM_ID in slots
    if stored is None:
        row: Slots = {}
    elif stored.keys() <= slots:
        if not add_item or ITEM_ID in stored:  # the store's decoded value itself: shared, never changed
            # (dense parts are logged as the declaration filters them: the key names it then)
            return stored, raw if raw is None or b":" not in raw else raw + b"\x00" + declared.token
        row = dict(stored)
    else:
        row = {k: v for k, v in stored.items() if k in slots}
    if add_item and ITEM_ID not in row:
        row[ITEM_ID] = [item_id]
    if stored is None:  # its row depends on the declaration alone (no raw value starts with \x01)
        return row, None if raw is not None else b"\x01" + declared.token
    return row, None if raw is None else raw + b"\x00" + declared.token


def dense_for(declared: Declared, context: Mapping[str, float] | None,
              candidates: Sequence[Mapping[str, float] | None], default: float | None = None) -> np.ndarray | None:
    """float32 ``[n, len(declared.dense)]`` in the model's input order (None: the model has no
    dense features); :class:`BadFeatures` naming the first candidate missing one, or ``default``
    for it (scoring on default features when the store could not answer)."""
    names = declared.dense
    if not names:
        return None
    context = context or {}
    out = np.empty((len(candidates), len(names)), np.float32)
    for i, own in enumerate(candidates):
        merged = {**context, **own} if own else context
        if default is not None:
            out[i] = [merged.get(name, default) for name in names]
            continue
        try:
            out[i] = [merged[name] for name in names]
        except KeyError as err:
            raise BadFeatures(
                f"candidates[{i}]: dense feature {err.args[0]!r} missing (the model reads {list(names)}: "
                "give each in context.dense or in every candidate's features.dense, or load it into the "
                "feature store as a user or item feature)") from None
    return out


def logged_dense(declared: Declared, request: Mapping[str, float] | None, stored: Mapping[str, float] | None
                 ) -> dict[str, float] | None:
    """The dense values one level of the feature log carries (the context, or a candidate): the
    request's, over the store's (the user's, or the item's) of the features the model reads.

    >>> logged_dense(Declared.of([], ["price", "ctr"]), {"price": 2.0}, {"price": 1.0, "ctr": 0.1, "old": 5.0})
    {'price': 2.0, 'ctr': 0.1}
    """
    if not stored:
        return dict(request) if request else None
    kept = {k: v for k, v in stored.items() if k in declared.dense}
    return {**kept, **request} if request else kept or None
