"""MovieLens side information as driftline features: named sparse slots of int64 ids.

Eight slots, as the trainer's benchmark model expects: five on the user side (``user_id``,
``gender``, ``age``, ``occupation``, ``zip``) and three on the item side (``item_id``,
``genres``, a multi-valued slot, and ``year``). Integer values are used as ids directly; strings
become a stable 63-bit hash, so the same value gets the same id in every process and every run.
Ids need only be unique within a slot: each slot has its own table in the parameter server.

>>> stable_id("M") == stable_id("M") and stable_id("M") != stable_id("F")
True
>>> stable_id("M") >= 0
True
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

import pyarrow as pa

from proto import Candidate, FeatureLog, Features

#: the item content slot (the input of a content encoder, trainer.content): title words and genres
#: as token ids (:func:`content_tokens`); not one of :data:`SLOTS` (no PS table reads it)
ITEM_CONTENT = "item_content"
#: words a title's tokens leave out: articles and the like, in the languages of ml-1m's titles
STOPWORDS = frozenset("a an and the of in on to for with at by from or is it la le les l el de du des der die das "
                      "und il lo".split())
USER_SLOTS: tuple[str, ...] = ("user_id", "gender", "age", "occupation", "zip")
ITEM_SLOTS: tuple[str, ...] = ("item_id", "genres", "year")
SLOTS: tuple[str, ...] = USER_SLOTS + ITEM_SLOTS


@lru_cache(maxsize=1 << 16)
def stable_id(value: str) -> int:
    """A process-independent, non-negative 63-bit id for a string value."""
    digest = hashlib.blake2b(value.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def content_tokens(title: str | None, genres: list[str] | None) -> list[int]:
    """An item's content tokens: its title's words (lowercased, a trailing ``(YYYY)`` and
    :data:`STOPWORDS` left out) and its genres, each a :func:`stable_id`.

    >>> content_tokens("American President, The (1995)", ["Comedy"]) == [
    ...     stable_id("word=american"), stable_id("word=president"), stable_id("genre=Comedy")]
    True
    """
    words = re.findall(r"[a-z0-9]+", re.sub(r"\(\d{4}\)\s*$", "", title or "").lower())
    return ([stable_id(f"word={w}") for w in words if w not in STOPWORDS]
            + [stable_id(f"genre={g}") for g in genres or []])


def _features(slots: dict[str, list[int]]) -> Features:
    f = Features()
    for name, ids in slots.items():
        f.sparse[name].ids.extend(ids)
    return f


class MovieLensFeatures:
    """User and item features of a MovieLens dataset, built once, served from memory.

    ``user_slots``/``item_slots`` give plain dicts (what the Redis feature store holds);
    ``*_features`` give protobuf messages; ``*_field_bytes`` give pre-encoded protobuf fields of a
    ``FeatureLog`` so the replay can assemble a message by concatenation (protobuf merges
    concatenated fields), which is several times faster than building messages.
    """

    def __init__(self, users: pa.Table, items: pa.Table) -> None:
        self._users: dict[int, dict[str, list[int]]] = {}
        for row in users.to_pylist():
            self._users[int(row["user_id"])] = {
                "user_id": [int(row["user_id"])],
                "gender": [stable_id(f"gender={row['gender']}")],
                "age": [int(row["age"])],
                "occupation": [stable_id(f"occupation={row['occupation']}")],
                "zip": [stable_id(f"zip={row['zip']}")],
            }
        self._items: dict[int, dict[str, list[int]]] = {}
        self._content: dict[int, list[int]] = {}
        for row in items.to_pylist():
            self._items[int(row["item_id"])] = {
                "item_id": [int(row["item_id"])],
                "genres": [stable_id(f"genre={g}") for g in (row["genres"] or [])],
                "year": [int(row["year"])] if row["year"] is not None else [],
            }
            self._content[int(row["item_id"])] = content_tokens(row["title"], row["genres"])
        self._context_field: dict[int, bytes] = {}
        self._candidate_field: dict[int, bytes] = {}

    @property
    def user_ids(self) -> list[int]:
        return list(self._users)

    @property
    def item_ids(self) -> list[int]:
        return list(self._items)

    def user_slots(self, user_id: int) -> dict[str, list[int]]:
        """The user's sparse slots; an unknown user gets only its id."""
        return self._users.get(user_id) or {"user_id": [user_id]}

    def item_slots(self, item_id: int) -> dict[str, list[int]]:
        """The item's sparse slots; an unknown item gets only its id."""
        return self._items.get(item_id) or {"item_id": [item_id]}

    def item_content(self, item_id: int) -> list[int]:
        """The item's :data:`ITEM_CONTENT` tokens (none for an unknown item)."""
        return self._content.get(item_id, [])

    def user_features(self, user_id: int) -> Features:
        return _features(self.user_slots(user_id))

    def item_features(self, item_id: int) -> Features:
        return _features(self.item_slots(item_id))

    def context_field_bytes(self, user_id: int) -> bytes:
        """``FeatureLog.context`` for this user, encoded as a field of a FeatureLog."""
        cached = self._context_field.get(user_id)
        if cached is None:
            cached = FeatureLog(context=self.user_features(user_id)).SerializeToString()
            self._context_field[user_id] = cached
        return cached

    def candidate_field_bytes(self, item_id: int) -> bytes:
        """One ``FeatureLog.candidates`` entry for this item, encoded as a field of a FeatureLog."""
        cached = self._candidate_field.get(item_id)
        if cached is None:
            candidate = Candidate(item_id=item_id, features=self.item_features(item_id))
            cached = FeatureLog(candidates=[candidate]).SerializeToString()
            self._candidate_field[item_id] = cached
        return cached
