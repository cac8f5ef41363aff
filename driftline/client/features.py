"""Plain feature values in, checked and hashed ids out: what every client sends is what the model reads.

A :class:`FeatureEncoder` holds the project's features (:class:`driftline.project.FeatureSpec`)
and turns a plain dict (``{"device": "ios", "tags": ["a", "b"], "hour": 14}``) into the sparse
slots (int64 ids; strings hashed with :func:`services.hashing.string_id`) and dense values the
contracts carry. Everything is checked here, before a byte goes out, and each refusal is an
:class:`InvalidInput` (a ``ValueError``) naming the feature: a request the model cannot read would
otherwise be a 422 at best, or an impression the trainer dead-letters at worst (the Kafka path has
no serving to check it).

Where a feature may be given follows its ``source``: request-wide values (``context`` and
``user`` features: a ``user`` value overrides the store's, as serving does) in the context,
per-candidate values (``candidate``, ``item`` and ``position``) in a candidate's features. Every
dense feature of a ``context`` or ``candidate`` source must be given (the scorer has no default for
it); a dense ``user`` or ``item`` feature comes from the store unless the request gives it, and a
``position`` is the place serving answers the candidate at unless given (a feature log written
straight to Kafka has no serving to place its candidates: each must give it).

>>> from driftline.project import FeatureSpec
>>> enc = FeatureEncoder([FeatureSpec(name="device", source="context", ids="string"),
...                       FeatureSpec(name="hour", source="context", kind="dense"),
...                       FeatureSpec(name="pos", source="candidate")])
>>> sparse, dense = enc.context({"device": "ios", "hour": 14})
>>> sparse == {"device": [string_id("ios")]}, dense
(True, {'hour': 14.0})
>>> enc.candidate({"pos": 3}, 0)
({'pos': [3]}, {})
>>> enc.context({"device": "ios", "hour": 1, "browser": "x"})
Traceback (most recent call last):
...
driftline.client.features.UnknownFeature: context: unknown feature 'browser' (known: device, hour, pos)
>>> enc.candidate({"pos": "top"}, 2)
Traceback (most recent call last):
...
driftline.client.features.WrongValue: candidates[2].pos: 'pos' has int ids, got the string 'top' (declare ids = "string" to hash strings)
>>> enc.context({"device": "ios"})
Traceback (most recent call last):
...
driftline.client.features.MissingFeature: context: dense feature 'hour' missing (the model reads it on every request)
>>> stored = [FeatureSpec(name="ctr", source="user", kind="dense")]
>>> FeatureEncoder(stored).context({})  # serving takes the store's
({}, {})
>>> FeatureEncoder(stored, store=False).context({})  # a feature log written to Kafka must carry it
Traceback (most recent call last):
...
driftline.client.features.MissingFeature: context: dense feature 'ctr' missing (the model reads it on every request)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from driftline.project import FeatureSpec
from services.hashing import string_id, string_key

__all__ = ["FeatureEncoder", "InvalidInput", "MissingFeature", "UnknownAction", "UnknownFeature", "WrongValue",
           "item_id_of"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: dense values travel as float32: a larger magnitude would become inf, which the joiner refuses
FLOAT32_MAX = 3.4028234663852886e38
#: serving's per-slot cap (``serving.schemas.FeaturesIn``)
MAX_IDS_PER_SLOT = 256

Slots = dict[str, list[int]]
Dense = dict[str, float]

#: where a value of each source is given: request-wide or per candidate
_CONTEXT_SOURCES = frozenset({"context", "user"})
_CANDIDATE_SOURCES = frozenset({"candidate", "item", "position"})


class InvalidInput(ValueError):
    """The client refuses this input before sending anything; the message names the culprit."""


class UnknownFeature(InvalidInput):
    """A feature the project does not declare, or given where its source does not allow."""


class WrongValue(InvalidInput):
    """A value of the wrong type or range for its feature (a string for an int feature, a NaN...)."""


class MissingFeature(InvalidInput):
    """A dense feature the model reads was not given."""


class UnknownAction(InvalidInput):
    """An action type the project has no label for (the joiner would not learn from it)."""


def item_id_of(value: str | int) -> int:
    """The non-negative int64 id serving takes for an item or a user (``/rank`` ids are >= 0).

    Strings: :func:`services.hashing.string_key` (``string_id`` with the sign bit cleared, as
    ``features load`` keys the store); ints pass through.

    >>> item_id_of(42), item_id_of("movie-42") == string_key("movie-42") == string_id("movie-42") & (2**63 - 1)
    (42, True)
    >>> item_id_of(-1)
    Traceback (most recent call last):
    ...
    driftline.client.features.WrongValue: id -1 is negative (ids are 0 .. 2**63-1; strings are hashed)
    """
    if isinstance(value, str):
        return string_key(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongValue(f"id {value!r} is neither a string nor an int")
    if not 0 <= value <= INT64_MAX:
        raise WrongValue(f"id {value} is negative (ids are 0 .. 2**63-1; strings are hashed)"
                         if value < 0 else f"id {value} is over int64")
    return value


def _sparse_ids(spec: FeatureSpec, where: str, value: Any) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    if len(values) > MAX_IDS_PER_SLOT:
        raise WrongValue(f"{where}: {len(values)} ids, at most {MAX_IDS_PER_SLOT} per feature")
    out = []
    for v in values:
        if spec.hashed:
            if not isinstance(v, str):
                raise WrongValue(f"{where}: {spec.name!r} has string ids, got {v!r} ({type(v).__name__})")
            out.append(string_id(v))
        elif isinstance(v, str):
            raise WrongValue(f"{where}: {spec.name!r} has int ids, got the string {v!r} "
                             "(declare ids = \"string\" to hash strings)")
        elif isinstance(v, bool) or not isinstance(v, int) or not INT64_MIN <= v <= INT64_MAX:
            raise WrongValue(f"{where}: {spec.name!r} takes int64 ids, got {v!r}")
        else:
            out.append(v)
    return out


def _dense_value(spec: FeatureSpec, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongValue(f"{where}: dense feature {spec.name!r} takes a number, got {value!r}")
    f = float(value)
    if not math.isfinite(f) or abs(f) > FLOAT32_MAX:
        raise WrongValue(f"{where}: dense feature {spec.name!r} is {f!r}: not a finite float32")
    return f


class FeatureEncoder:
    """Checks and hashes plain feature dicts against the project's features (see the module)."""

    def __init__(self, features: Sequence[FeatureSpec], action_types: Iterable[str] | None = None,
                 store: bool = True) -> None:
        """``action_types``: the project's labelled action types (None: any type is sent);
        ``store``: serving fills the values of ``user`` and ``item`` features from the feature
        store (False for a feature log written straight to Kafka: its dense values must be given)."""
        self.specs = {f.name: f for f in features}
        if len(self.specs) != len(features):
            raise InvalidInput("features: a name is declared twice")
        self.action_types = None if action_types is None else frozenset(action_types)
        # dense values of user and item features come from the store when the request has none
        context, candidate = ({"context"}, {"candidate"}) if store else (_CONTEXT_SOURCES, _CANDIDATE_SOURCES)
        self._dense_context = [f.name for f in features if f.kind == "dense" and f.source in context]
        self._dense_candidate = [f.name for f in features if f.kind == "dense" and f.source in candidate]
        self._position = None if store else next((f.name for f in features if f.source == "position"), None)

    def _encode(self, values: Mapping[str, Any] | None, where: str, sources: frozenset[str]) -> tuple[Slots, Dense]:
        sparse: Slots = {}
        dense: Dense = {}
        for name, value in (values or {}).items():
            spec = self.specs.get(name)
            if spec is None:
                known = ", ".join(sorted(self.specs)) or "none"
                raise UnknownFeature(f"{where}: unknown feature {name!r} (known: {known})")
            if spec.source not in sources:
                place = "the context" if spec.source in _CONTEXT_SOURCES else "each candidate's features"
                raise UnknownFeature(f"{where}: {name!r} is a {spec.source} feature: give it in {place}")
            if value is None:  # absent: the store's value (sparse) or a MissingFeature below (dense)
                continue
            if spec.kind == "dense":
                dense[name] = _dense_value(spec, f"{where}.{name}", value)
            else:
                sparse[name] = ids = _sparse_ids(spec, f"{where}.{name}", value)
                if spec.source == "position" and (len(ids) != 1 or ids[0] < 0):
                    raise WrongValue(f"{where}.{name}: a position is the one place the item is shown at, 0 or more "
                                     f"(0 = first), got {value!r}")
        return sparse, dense

    def context(self, values: Mapping[str, Any] | None) -> tuple[Slots, Dense]:
        """The request-wide features: (sparse slots, dense values); raises :class:`InvalidInput`."""
        sparse, dense = self._encode(values, "context", _CONTEXT_SOURCES)
        for name in self._dense_context:
            if name not in dense:
                raise MissingFeature(f"context: dense feature {name!r} missing (the model reads it on every request)")
        return sparse, dense

    def candidate(self, values: Mapping[str, Any] | None, index: int) -> tuple[Slots, Dense]:
        """Candidate ``index``'s own features: (sparse slots, dense values)."""
        where = f"candidates[{index}]"
        sparse, dense = self._encode(values, where, _CANDIDATE_SOURCES)
        for name in self._dense_candidate:
            if name not in dense:
                raise MissingFeature(f"{where}: dense feature {name!r} missing (the model reads it for every candidate)")
        if self._position is not None and self._position not in sparse:
            raise MissingFeature(f"{where}: position {self._position!r} missing (no serving places the candidates "
                                 "of a feature log written to Kafka: give the place each was shown at, 0 = first)")
        return sparse, dense

    def action_type(self, action_type: str, where: str = "action") -> str:
        """``action_type`` if the project labels it; :class:`UnknownAction` otherwise."""
        if not isinstance(action_type, str) or not action_type:
            raise WrongValue(f"{where}: action_type must be a non-empty string, got {action_type!r}")
        if self.action_types is not None and action_type not in self.action_types:
            raise UnknownAction(f"{where}: action type {action_type!r} has no label "
                                f"(labelled: {', '.join(sorted(self.action_types)) or 'none'})")
        return action_type
