"""Message codecs: bytes on a topic <-> a validated protobuf message.

Protobuf alone accepts almost any bytes (unknown fields are skipped, missing fields read as
zero), so every message type also has a validator for what our services rely on. Examples are
the exception: they travel as columnar batches, one per record, which their consumers decode and
validate whole, vectorized (:func:`services.example_batch.decode`); their codec
(:class:`ExampleBatchBytes`) keeps a record's value as bytes. A message that
fails either step raises :class:`MalformedMessage` with a reason short enough for a metric label
and a dead-letter record.

>>> from proto import Action
>>> codec = codec_for(Action)
>>> raw = codec.encode(Action(request_id="r1", item_id=5, action_type="click", event_time_ms=1000))
>>> codec.decode(raw).item_id
5
>>> codec.decode(b"\\xff\\xff")
Traceback (most recent call last):
...
services.codecs.MalformedMessage: undecodable: Action does not parse
>>> codec.decode(Action(item_id=5, action_type="click", event_time_ms=1).SerializeToString())
Traceback (most recent call last):
...
services.codecs.MalformedMessage: invalid: Action.request_id is empty
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.message import DecodeError, Message

from proto import Action, DeadLetter, Example, FeatureLog, Features, ParameterDelta

M = TypeVar("M", bound=Message)


class MalformedMessage(ValueError):
    """A message that cannot be used. ``kind`` is ``undecodable``, ``invalid``, (decoded, but
    processing it failed) ``failed``, or (decoded, and its consumer would not use it) ``refused``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def _invalid(detail: str) -> MalformedMessage:
    return MalformedMessage("invalid", detail)


def _check_features(features: Features, where: str) -> None:
    for name, value in features.dense.items():
        if not math.isfinite(value):
            raise _invalid(f"{where}.dense[{name}] is not finite")
    for name in features.sparse:
        if not name:
            raise _invalid(f"{where}.sparse has an empty slot name")


def processing_failed(err: BaseException) -> MalformedMessage:
    """The dead-letter reason for a record that decoded but failed later (kind ``failed``), so
    a consumer moves past it instead of crash-looping on it.

    >>> str(processing_failed(ValueError("year 292278994 is out of range")))
    'failed: ValueError: year 292278994 is out of range'
    """
    return MalformedMessage("failed", f"{type(err).__name__}: {err}"[:500])


def event_time_error(event_time_ms: int, now_ms: int, max_past_s: float, max_future_s: float) -> str | None:
    """Why an event time is refused at an edge (outside ``[now - past, now + future]``), or None.

    >>> now = 1_700_000_000_000
    >>> event_time_error(now - 1000, now, 86400, 300) is None
    True
    >>> event_time_error(2**63 - 1, now, 86400, 300)
    'event_time_ms 9223372036854775807 is 9223370336854776.000 s ahead of the clock (at most 300 s allowed: event_time.max_future_s)'
    >>> event_time_error(0, now, 86400, 300)
    'event_time_ms 0 is 1700000000.000 s behind the clock (at most 86400 s allowed: event_time.max_past_s)'
    """
    if event_time_ms > now_ms + max_future_s * 1000:
        return (f"event_time_ms {event_time_ms} is {(event_time_ms - now_ms) / 1000:.3f} s ahead of the "
                f"clock (at most {max_future_s:g} s allowed: event_time.max_future_s)")
    if event_time_ms < now_ms - max_past_s * 1000:
        return (f"event_time_ms {event_time_ms} is {(now_ms - event_time_ms) / 1000:.3f} s behind the "
                f"clock (at most {max_past_s:g} s allowed: event_time.max_past_s)")
    return None


def validate_feature_log(m: FeatureLog) -> None:
    if not m.request_id:
        raise _invalid("FeatureLog.request_id is empty")
    if m.event_time_ms <= 0:
        raise _invalid("FeatureLog.event_time_ms is not set")
    if not m.candidates:
        raise _invalid("FeatureLog has no candidates")
    _check_features(m.context, "FeatureLog.context")
    for c in m.candidates:
        _check_features(c.features, "FeatureLog.candidates.features")


def validate_action(m: Action) -> None:
    if not m.request_id:
        raise _invalid("Action.request_id is empty")
    if not m.action_type:
        raise _invalid("Action.action_type is empty")
    if m.event_time_ms <= 0:
        raise _invalid("Action.event_time_ms is not set")


def validate_parameter_delta(m: ParameterDelta) -> None:
    if not m.model_id:
        raise _invalid("ParameterDelta.model_id is empty")
    if m.chunk_count == 0 or m.chunk_index >= m.chunk_count:
        raise _invalid(f"ParameterDelta chunk {m.chunk_index} of {m.chunk_count}")
    kind = m.WhichOneof("payload")
    if kind is None:
        raise _invalid("ParameterDelta has no payload")
    if kind == "sparse":
        rows = m.sparse
        if rows.dim == 0:
            raise _invalid("SparseRows.dim is 0")
        if len(rows.keys) % 8 or len(rows.tombstones) % 8:
            raise _invalid("SparseRows keys/tombstones are not whole int64s")
        if len(rows.values) != len(rows.keys) // 8 * rows.dim * 4:
            raise _invalid("SparseRows.values length does not match keys * dim")
    else:
        for t in m.dense.tensors:
            if len(t.values) != 4 * math.prod(t.shape):
                raise _invalid(f"Tensor {t.name} values do not match its shape")


def validate_dead_letter(m: DeadLetter) -> None:
    if not m.reason:
        raise _invalid("DeadLetter.reason is empty")


@dataclass(frozen=True)
class Codec(Generic[M]):
    """Encode and decode one message type, with its validator."""

    message_type: type[M]
    validate: Callable[[M], None]

    @property
    def name(self) -> str:
        return self.message_type.__name__

    def encode(self, message: M) -> bytes:
        return message.SerializeToString()

    def decode(self, raw: bytes | None) -> M:
        if raw is None:
            raise MalformedMessage("undecodable", f"{self.name} value is null")
        message = self.message_type()
        try:
            message.ParseFromString(raw)
        except (DecodeError, RuntimeError, ValueError):
            raise MalformedMessage("undecodable", f"{self.name} does not parse") from None
        self.validate(message)
        return message


class ExampleBatchBytes:
    """The codec of the ``examples`` topic: a record's value stays bytes (``Record.value is
    Record.raw``), an example batch for its consumer to :func:`services.example_batch.decode`;
    only a null value is refused here.

    >>> codec_for(Example).decode(b"batch bytes")
    b'batch bytes'
    >>> codec_for(Example).decode(None)
    Traceback (most recent call last):
    ...
    services.codecs.MalformedMessage: undecodable: ExampleBatch value is null
    """

    message_type = Example
    name = "ExampleBatch"

    def encode(self, message: bytes) -> bytes:
        return message

    def decode(self, raw: bytes | None) -> bytes:
        if raw is None:
            raise MalformedMessage("undecodable", f"{self.name} value is null")
        return raw


_CODECS: dict[type[Message], Codec[Any]] = {
    FeatureLog: Codec(FeatureLog, validate_feature_log),
    Action: Codec(Action, validate_action),
    Example: ExampleBatchBytes(),  # type: ignore[dict-item]
    ParameterDelta: Codec(ParameterDelta, validate_parameter_delta),
    DeadLetter: Codec(DeadLetter, validate_dead_letter),
}


def codec_for(message_type: type[M]) -> Codec[M]:
    """The codec of a message type."""
    return _CODECS[message_type]
