"""Kafka producers of the contracts, for systems that rank on their own and log to Kafka instead
of calling ``/rank``: :class:`FeatureLogProducer` (topic ``features``) and :class:`ActionProducer`
(topic ``actions``), plain values in, the protobuf messages of :mod:`proto` out.

They stand in for serving, so they do what serving does before a message leaves: values checked
and strings hashed against the project's features (:mod:`driftline.client.features`), event times
checked against ``settings.event_time`` (the joiner's windows are event time: an event from the
far past or future would be joined wrongly or never), every message validated by its codec
(:mod:`services.codecs`, what the consumers will check), and records **keyed by request id** on
the producer settings serving uses (:func:`services.kafka.producer`, which also connects with
``settings.kafka``'s TLS and SASL settings, README: Security): with equal partition counts a
request's feature log and actions land on the same partition number, which the joiner relies on.
Like serving, a FeatureLog gets an ``item_id`` / ``user_id`` slot from the candidate's / the
request's id when the project declares one and the caller did not give it.

Building a message needs no broker:

>>> from driftline.project import FeatureSpec
>>> from services.settings import Settings, get_settings
>>> logs = FeatureLogProducer([FeatureSpec(name="item_id", source="item"),
...                            FeatureSpec(name="device", source="context", ids="string")], Settings())
>>> m = logs.build("r1", ["a", {"item_id": 5, "score": 0.5}], context={"device": "ios"},
...                event_time_ms=int(time.time() * 1000))
>>> m.request_id, m.model_version.model_id, m.candidates[1].item_id, m.candidates[1].score
('r1', 'deepfm', 5, 0.5)
>>> list(m.candidates[1].features.sparse["item_id"].ids), m.candidates[0].item_id == item_id_of("a")
([5], True)
>>> ActionProducer([], Settings()).build("r1", "a", "click", event_time_ms=1).event_time_ms
Traceback (most recent call last):
...
driftline.client.features.WrongValue: action: event_time_ms 1 is ... behind the clock (at most 604800 s allowed: event_time.max_past_s)
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaProducer

from driftline.client.features import FeatureEncoder, InvalidInput, WrongValue, item_id_of
from driftline.project import FeatureSpec
from proto import Action, FeatureLog, Features, ModelVersion
from proto.feature_log_pb2 import Candidate
from services.codecs import MalformedMessage, codec_for, event_time_error
from services.kafka import producer, start_client
from services.settings import Settings, get_settings

__all__ = ["ActionProducer", "Blocking", "FeatureLogProducer"]

_USER_ID, _ITEM_ID = "user_id", "item_id"  # the slots serving fills from /rank's own ids
_RECORD_OVERHEAD = 1024  # a record's and its batch's headers on top of key + value (as serving.feature_log)


def _features(sparse: Mapping[str, list[int]], dense: Mapping[str, float]) -> Features:
    f = Features()
    for name, ids in sparse.items():
        f.sparse[name].ids.extend(ids)
    for name, value in dense.items():
        f.dense[name] = value
    return f


class _Producer:
    """One aiokafka producer on serving's settings; ``async with`` or ``start()`` / ``stop()``."""

    def __init__(self, features: Sequence[FeatureSpec], settings: Settings, action_types: Iterable[str] | None,
                 topic: str) -> None:
        self.settings = settings
        self.encoder = FeatureEncoder(features, action_types, store=False)  # no serving fills the store's values
        self.topic = topic
        self.producer: AIOKafkaProducer | None = None

    def _event_time(self, where: str, event_time_ms: int | None) -> int:
        now = int(time.time() * 1000)
        if event_time_ms is None:
            return now
        bounds = self.settings.event_time
        error = event_time_error(int(event_time_ms), now, bounds.max_past_s, bounds.max_future_s)
        if error is not None:
            raise WrongValue(f"{where}: {error}")
        return int(event_time_ms)

    async def start(self) -> None:
        # serving's feature-log limit, and the producer sized for it (as serving.feature_log does)
        self.producer = producer(self.settings, max_request_size=self.settings.serving.feature_log_max_bytes
                                 + _RECORD_OVERHEAD)
        await start_client(self.producer, self.settings)

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
            self.producer = None

    async def __aenter__(self) -> _Producer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _send(self, messages: Sequence[Action | FeatureLog]) -> None:
        """Send keyed by request id and wait for Kafka's acknowledgement of all of them."""
        if self.producer is None:
            raise RuntimeError("the producer is not started: use `async with` or await start()")
        limit = self.settings.serving.feature_log_max_bytes
        records = []
        for m in messages:  # all checked before any is sent
            try:
                codec_for(type(m)).validate(m)
            except MalformedMessage as err:
                raise InvalidInput(str(err)) from None
            key, value = m.request_id.encode(), m.SerializeToString()
            if len(key) + len(value) > limit:
                # the topic could never take it (serving answers such a request 413)
                raise InvalidInput(f"{type(m).__name__} {m.request_id!r} is {len(key) + len(value)} bytes, over "
                                   f"serving.feature_log_max_bytes ({limit}): fewer candidates or features")
            records.append((key, value))
        futures = [await self.producer.send(self.topic, value, key=key) for key, value in records]
        await asyncio.gather(*futures)


class FeatureLogProducer(_Producer):
    """Writes what *your* ranker scored as FeatureLogs (see the module docstring)."""

    def __init__(self, features: Sequence[FeatureSpec], settings: Settings | None = None, *, model_id: str | None = None,
                 topic: str | None = None) -> None:
        """``model_id``: the slice the impressions belong to (None: ``settings.serving.model_id``)."""
        settings = settings or _settings()
        super().__init__(features, settings, None, topic or settings.topics.features)
        self.model_id = model_id or self.settings.serving.model_id
        self._item_slot = _ITEM_ID in self.encoder.specs and self.encoder.specs[_ITEM_ID].kind == "sparse"
        self._user_slot = _USER_ID in self.encoder.specs and self.encoder.specs[_USER_ID].kind == "sparse"

    def build(self, request_id: str | None, candidates: Sequence[Any], *, user_id: str | int | None = None,
              context: Mapping[str, Any] | None = None, event_time_ms: int | None = None) -> FeatureLog:
        """The FeatureLog of one request (no I/O). ``candidates``: items or dicts ``{"item_id": ...,
        "features": {...}, "score": float}``; ``request_id`` None: a new one (read it off the message)."""
        if not candidates:
            raise InvalidInput("candidates: at least one is needed")
        sparse, dense = self.encoder.context(context)
        user = item_id_of(user_id) if user_id is not None else 0
        if self._user_slot and _USER_ID not in sparse and user:
            sparse[_USER_ID] = [user]
        m = FeatureLog(request_id=request_id or uuid.uuid4().hex, user_id=user, context=_features(sparse, dense),
                       event_time_ms=self._event_time("feature log", event_time_ms),
                       model_version=ModelVersion(model_id=self.model_id))
        for i, value in enumerate(candidates):
            item, features, score = (value.get("item_id"), value.get("features"), value.get("score", 0.0)) \
                if isinstance(value, Mapping) else (value, None, 0.0)
            if item is None:
                raise InvalidInput(f"candidates[{i}]: no item_id")
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise WrongValue(f"candidates[{i}].score: {score!r} is not a finite number")
            item_id = item_id_of(item)
            c_sparse, c_dense = self.encoder.candidate(features, i)
            if self._item_slot and _ITEM_ID not in c_sparse:
                c_sparse[_ITEM_ID] = [item_id]
            m.candidates.append(Candidate(item_id=item_id, features=_features(c_sparse, c_dense), score=float(score)))
        return m

    async def send(self, request_id: str | None, candidates: Sequence[Any], **fields: Any) -> str:
        """Build (as :meth:`build`) and produce one FeatureLog; returns its request id once Kafka has it."""
        m = self.build(request_id, candidates, **fields)
        await self._send([m])
        return m.request_id

    async def send_many(self, logs: Iterable[Mapping[str, Any]]) -> list[str]:
        """Produce dicts with the arguments of :meth:`build` (``request_id``, ``candidates``, ...);
        every one is checked before any is sent. Returns their request ids."""
        messages = [self.build(log.get("request_id"), log.get("candidates", ()),
                               **{k: v for k, v in log.items() if k not in ("request_id", "candidates")})
                    for log in logs]
        await self._send(messages)
        return [m.request_id for m in messages]


class ActionProducer(_Producer):
    """Writes what users did with the served items as Actions (see the module docstring)."""

    def __init__(self, features: Sequence[FeatureSpec] = (), settings: Settings | None = None, *,
                 action_types: Iterable[str] | None = None, topic: str | None = None) -> None:
        """``action_types``: the project's labelled types (None: any type is sent)."""
        settings = settings or _settings()
        super().__init__(features, settings, action_types, topic or settings.topics.actions)

    def build(self, request_id: str, item_id: str | int, action_type: str, *, user_id: str | int | None = None,
              event_time_ms: int | None = None) -> Action:
        if not request_id:
            raise InvalidInput("action: request_id is empty")
        return Action(request_id=str(request_id), item_id=item_id_of(item_id),
                      action_type=self.encoder.action_type(action_type),
                      user_id=item_id_of(user_id) if user_id is not None else 0,
                      event_time_ms=self._event_time("action", event_time_ms))

    async def send(self, request_id: str, item_id: str | int, action_type: str, **fields: Any) -> None:
        await self._send([self.build(request_id, item_id, action_type, **fields)])

    async def send_many(self, actions: Iterable[Mapping[str, Any]]) -> int:
        """Produce dicts with the arguments of :meth:`build`; every one is checked before any is sent."""
        messages = [self.build(**a) for a in actions]
        await self._send(messages)
        return len(messages)


def _settings() -> Settings:
    return get_settings()  # read when needed: a caller passing its own settings never reads the environment


P = TypeVar("P", bound=_Producer)


class Blocking(Generic[P]):
    """A producer for code without asyncio: ``Blocking(FeatureLogProducer(...))`` runs it on an
    event loop of its own, in a background thread; its coroutine methods (``send``,
    ``send_many``) block until Kafka acknowledged, its plain ones (``build``) are called as they
    are: ``with Blocking(ActionProducer(...)) as actions: actions.send("r1", "sku-1", "click")``.
    """

    def __init__(self, producer: P) -> None:
        """Starts ``producer`` (raises :class:`services.kafka.BrokerUnavailable` without a broker)."""
        self.producer = producer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="driftline-producer", daemon=True)
        self._thread.start()
        try:
            self._run(producer.start())
        except BaseException:
            self._halt()
            raise

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        """The producer's attribute: a coroutine method wrapped to block, anything else as it is."""
        attr = getattr(self.producer, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        return lambda *args, **kwargs: self._run(attr(*args, **kwargs))

    def _halt(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        """Flush and stop the producer, then its loop."""
        if self._loop.is_closed():
            return
        try:
            self._run(self.producer.stop())
        finally:
            self._halt()

    def __enter__(self) -> Blocking[P]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
