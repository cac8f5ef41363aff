"""The Python client of a driftline stack: plain values in, checked and hashed against the
project's features, the serving API or the Kafka contracts out.

* :class:`RankClient` / :class:`AsyncRankClient`: ``rank(...)`` (``POST /rank``) and
  ``actions(...)`` (``POST /actions``), sync or asyncio;
* :class:`FeatureLogProducer` / :class:`ActionProducer`: for a system that ranks on its own and
  logs to Kafka instead (topics ``features`` and ``actions``, keyed by request id); asyncio, or
  blocking in :class:`Blocking`.

Feature values are plain: a string or an int (or a list of them) for a sparse feature, a number for
a dense one; string values are hashed with :func:`services.hashing.string_id`, string items and
users with :func:`item_id_of`. A value the project's features do not allow is an
:class:`InvalidInput` naming it, raised before any network call; serving's own refusals (4xx)
are :class:`Rejected` with serving's message.

>>> from driftline.project import FeatureSpec
>>> features = [FeatureSpec(name="device", source="context", ids="string"),
...             FeatureSpec(name="pos", source="candidate"),
...             FeatureSpec(name="price", source="candidate", kind="dense")]
>>> client = RankClient(features, "http://127.0.0.1:8000")
>>> client.rank(user_id="u-1", context={"device": "ios"},
...             candidates=[{"item_id": "sku-1", "features": {"pos": 0, "price": 9.5}},
...                         {"item_id": "sku-2", "features": {"pos": "1", "price": 3.0}}])
Traceback (most recent call last):
...
driftline.client.features.WrongValue: candidates[1].pos: 'pos' has int ids, got the string '1' (declare ids = "string" to hash strings)
>>> client.close()

Against a running serving, ``client.rank(...)`` returns a :class:`Ranking`: ``request_id`` (send
the actions with it) and ``items`` best first, each with the caller's ``item`` and its ``score``;
``client.actions([{"request_id": r.request_id, "item_id": "sku-2", "action_type": "click"}])``.
"""

from driftline.client.features import (
                                       FeatureEncoder,
                                       InvalidInput,
                                       MissingFeature,
                                       UnknownAction,
                                       UnknownFeature,
                                       WrongValue,
                                       item_id_of,
)
from driftline.client.http import AsyncRankClient, RankClient, Ranking, Rejected, ScoredItem, ServingError
from driftline.client.kafka import ActionProducer, Blocking, FeatureLogProducer

__all__ = [
    "ActionProducer", "AsyncRankClient", "Blocking", "FeatureEncoder", "FeatureLogProducer", "InvalidInput",
    "MissingFeature", "RankClient", "Ranking", "Rejected", "ScoredItem", "ServingError", "UnknownAction",
    "UnknownFeature", "WrongValue", "item_id_of",
]
