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


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


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
