"""Building Example bytes without building Example objects.

Protobuf parsing *merges* repeated occurrences of a field: a later scalar wins, map entries and
sub-messages merge. So an Example is written as ``base + tail``: ``base`` (ids, times, the
context features and then the candidate's features, merged by the parser) is built once when the
impression arrives and stored; ``tail`` (labels, sample_rate, and for corrections a new
example_id) is appended when it is emitted. No Example object is built per impression, and the
bytes parse to exactly the message ``Example(...)`` with merged features would give.
"""

from __future__ import annotations

import struct

from proto import Example

_F32 = struct.Struct("<f")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_SMALL = [_varint(n) for n in range(1 << 14)]


def varint(n: int) -> bytes:
    """Unsigned varint (n >= 0); the common small values come from a table."""
    return _SMALL[n] if n < 16384 else _varint(n)


def length_delimited(field: int, payload: bytes) -> bytes:
    return varint((field << 3) | 2) + varint(len(payload)) + payload


def features_field(features_bytes: bytes) -> bytes:
    """Example.features (field 6) from serialized Features; b"" for empty features."""
    return length_delimited(6, features_bytes) if features_bytes else b""


def base_example(
    example_id: str, request_id: str, item_id: int, user_id: int, event_time_ms: int, model_id: str,
    context_field: bytes, candidate_features: bytes,
) -> bytes:
    head = Example(
        example_id=example_id, request_id=request_id, item_id=item_id, user_id=user_id,
        event_time_ms=event_time_ms, model_id=model_id,
    ).SerializeToString()
    return head + context_field + features_field(candidate_features)


def _int_field(tag: bytes, n: int) -> bytes:
    """A proto3 int64 field (omitted when 0, as the serializer does)."""
    return tag + varint(n & 0xFFFFFFFFFFFFFFFF) if n else b""


def _str_field(tag: bytes, s: bytes) -> bytes:
    return tag + varint(len(s)) + s if s else b""


def request_head(request_id: bytes, user_id: int, event_time_ms: int, model_id: str, context: bytes) -> bytes:
    """The Example fields every candidate of one FeatureLog shares (request_id, user_id,
    event_time_ms, model_id, the context features), encoded once per request."""
    return (_str_field(b"\x12", request_id) + _int_field(b"\x20", user_id) + _int_field(b"\x38", event_time_ms)
            + _str_field(b"\x4a", model_id.encode()) + features_field(context))


def candidate_example(head: bytes, example_id: bytes, item_id: int, candidate_features: bytes) -> bytes:
    """Base bytes of one candidate's Example: example_id, the request's ``head``, item_id, then
    the candidate's serialized Features as a second Example.features occurrence (merged after
    the context by the parser). Same message as :func:`base_example`."""
    small = _SMALL
    n = len(candidate_features)
    m = len(example_id)
    return (b"\x0a" + (small[m] if m < 16384 else _varint(m)) + example_id + head
            + (b"\x18" + (small[item_id] if 0 < item_id < 16384 else varint(item_id & 0xFFFFFFFFFFFFFFFF))
               if item_id else b"")
            + ((b"\x32" + (small[n] if n < 16384 else _varint(n)) + candidate_features) if n else b""))


def label_entry(name: str, value: float) -> bytes:
    """One entry of Example.labels (field 5, map<string, float>)."""
    key = name.encode()
    entry = b"\x0a" + varint(len(key)) + key + b"\x15" + _F32.pack(value)
    return length_delimited(5, entry)


def sample_rate_field(rate: float) -> bytes:
    return b"\x45" + _F32.pack(rate)  # field 8, fixed32


def example_id_field(example_id: str) -> bytes:
    return length_delimited(1, example_id.encode())


class TailCache:
    """Memoised ``labels + sample_rate`` tails by (label mask, rate)."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self._on = [label_entry(n, 1.0) for n in labels]
        self._off = [label_entry(n, 0.0) for n in labels]
        self._cache: dict[tuple[int, float], bytes] = {}

    def tail(self, mask: int, rate: float) -> bytes:
        key = (mask, rate)
        t = self._cache.get(key)
        if t is None:
            parts = [self._on[i] if mask >> i & 1 else self._off[i] for i in range(len(self.labels))]
            t = b"".join(parts) + sample_rate_field(rate)
            self._cache[key] = t
        return t
