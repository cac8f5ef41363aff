"""trainer.wire against the protobuf library (upb): the same verdict and the same batch for any bytes.

The reference for a record is what the old path did: ``codec_for(Example).decode`` (upb parse +
``validate_example``), then ``check_example``, then ``SparseBatch.from_examples``. Records are
random Examples serialized normally, re-encoded by a randomizing encoder (fields shuffled and
repeated, packed/unpacked/split ids, several ``features`` and map entries for one key, unknown
fields and groups, known fields with the wrong wire type, padded varints), and byte mutations of
those (truncations, flips, insertions) for the malformed side.
"""

from __future__ import annotations

import math
import os
import random
import struct
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from proto import Example
from services.codecs import MalformedMessage, codec_for
from trainer.batch import SparseBatch
from trainer.online import check_example
from trainer.wire import DUPLICATE, OK, REJECT, UNDECODABLE, DedupWindow, ExampleDecoder, hash_ids

SLOTS = ["age", "genres", "item_id", "user_id"]
DENSE = ["d0", "d1"]
LABEL = "click"
CODEC = codec_for(Example)


# ------------------------------------------------------------------------- reference (old path)
def reference(raws: list[bytes], slots, dense):
    status, good = [], []
    for raw in raws:
        try:
            ex = CODEC.decode(raw)
        except MalformedMessage as err:
            status.append(UNDECODABLE if err.kind == "undecodable" else REJECT)
            continue
        if check_example(ex, set(slots), LABEL, dense) is not None:
            status.append(REJECT)
            continue
        status.append(OK)
        good.append(ex)
    return np.array(status, np.int8), good


def assert_same(raws: list[bytes], slots=SLOTS, dense=DENSE):
    dec = ExampleDecoder(slots, LABEL, dense).decode(raws)
    want_status, good = reference(raws, slots, dense)
    assert dec.status.tolist() == want_status.tolist(), [(r, s) for r, s in zip(raws, want_status)]
    assert dec.size == len(good)
    if not good:
        return dec
    ref = SparseBatch.from_examples(good, slots, LABEL, dense)
    ids, offs = dec.slot_arrays(slots)
    for s in slots:
        assert ids[s].tolist() == ref.ids[s].tolist(), s
        assert offs[s].tolist() == ref.offsets[s].tolist(), s
    assert dec.labels.tobytes() == ref.labels.tobytes()
    assert dec.event_time_ms.tolist() == ref.event_time_ms.tolist()
    assert dec.sample_rate.tobytes() == ref.sample_rate.tobytes()
    if dense:
        assert dec.dense.tobytes() == ref.dense.tobytes()
    else:
        assert dec.dense is None
    assert np.array_equal(dec.hashes, hash_ids([e.example_id for e in good]))
    return dec


# ------------------------------------------------------------------------- a randomizing encoder
def varint(n: int, rng: random.Random | None = None, limit: int = 10) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            break
    pad = rng.choice([0, 0, 0, 1, 2]) if rng else 0
    pad = min(pad, limit - len(out))
    if pad > 0:  # non-canonical but valid: trailing 0x80 ... 0x00 continuation bytes
        out[-1] |= 0x80
        out += b"\x80" * (pad - 1) + b"\x00"
    return bytes(out)


def tag(field: int, wt: int, rng=None) -> bytes:
    return varint(field << 3 | wt, rng, limit=5)


def ld(field: int, payload: bytes, rng=None) -> bytes:
    return tag(field, 2, rng) + varint(len(payload), rng, limit=5) + payload


def unknown(rng: random.Random, depth: int = 0) -> bytes:
    f = rng.choice([10, 11, 15, 16, 100, 2047, 2048, (1 << 29) - 1])
    wt = rng.choice([0, 1, 2, 5, 3] if depth < 3 else [0, 1, 2, 5])
    if wt == 0:
        return tag(f, 0, rng) + varint(rng.getrandbits(64), rng)
    if wt == 1:
        return tag(f, 1, rng) + rng.randbytes(8)
    if wt == 5:
        return tag(f, 5, rng) + rng.randbytes(4)
    if wt == 2:
        return ld(f, rng.randbytes(rng.randint(0, 6)), rng)
    inner = b"".join(unknown(rng, depth + 1) for _ in range(rng.randint(0, 2)))
    return tag(f, 3, rng) + inner + tag(f, 4, rng)


def maybe_unknown(rng: random.Random) -> list[bytes]:
    return [unknown(rng) for _ in range(rng.choice([0, 0, 0, 1, 2]))]


def f32(v: float) -> bytes:
    return struct.pack("<f", v)


def enc_slot(ids: list[int], rng: random.Random) -> bytes:
    """SparseSlot: ids split in runs, each run packed or unpacked."""
    parts, i = [], 0
    while i < len(ids):
        k = rng.randint(1, len(ids) - i)
        run = ids[i:i + k]
        i += k
        if rng.random() < 0.5:
            parts.append(ld(1, b"".join(varint(x, rng) for x in run), rng))
        else:
            parts += [tag(1, 0, rng) + varint(x, rng) for x in run]
    if rng.random() < 0.2:
        parts.append(ld(1, b"", rng))  # an empty packed run
    parts += maybe_unknown(rng)
    rng.shuffle(parts) if rng.random() < 0.1 else None  # (reorders ids: the reference follows the bytes)
    return b"".join(parts)


def enc_entry(key: str | None, value: bytes | None, value_field_wt: int, rng: random.Random) -> bytes:
    parts = []
    if key is not None:
        parts.append(ld(1, key.encode(), rng))
    if value is not None:
        parts.append((ld(2, value, rng)) if value_field_wt == 2 else tag(2, 5, rng) + value)
    parts += maybe_unknown(rng)
    rng.shuffle(parts)
    return b"".join(parts)


def encode(spec: dict, rng: random.Random) -> bytes:
    """Top-level fields of ``spec`` as shuffled pieces (the joiner concatenates pre-encoded fields)."""
    pieces = []
    if spec["example_id"] is not None:
        pieces.append(ld(1, spec["example_id"].encode(), rng))
    pieces.append(ld(2, b"req", rng))
    pieces.append(tag(3, 0, rng) + varint(spec["item_id"], rng))
    pieces.append(tag(4, 0, rng) + varint(7, rng))
    if spec["event_time_ms"] is not None:
        pieces.append(tag(7, 0, rng) + varint(spec["event_time_ms"], rng))
    if spec["sample_rate"] is not None:
        pieces.append(tag(8, 5, rng) + f32(spec["sample_rate"]))
    pieces.append(ld(9, "model-é".encode(), rng))
    for k, v in spec["labels"]:
        pieces.append(ld(5, enc_entry(k, None if v is None else f32(v), 5, rng), rng))
    entries = []
    for k, ids in spec["sparse"]:
        if ids is None:
            entries.append(ld(1, enc_entry(k, None, 2, rng), rng))
        elif len(ids) > 1 and rng.random() < 0.3:  # the value message twice in one entry: merged
            cut = rng.randint(1, len(ids) - 1)
            e = ld(1, k.encode(), rng) + ld(2, enc_slot(ids[:cut], rng), rng) + ld(2, enc_slot(ids[cut:], rng), rng)
            entries.append(ld(1, e, rng))
        else:
            entries.append(ld(1, enc_entry(k, enc_slot(ids, rng), 2, rng), rng))
    for k, v in spec["dense"]:
        entries.append(ld(2, enc_entry(k, None if v is None else f32(v), 5, rng), rng))
    # features: entries in order (last key wins), over one or more `features` occurrences
    while entries:
        k = rng.randint(1, len(entries))
        body = entries[:k] + maybe_unknown(rng)
        entries = entries[k:]
        pieces.append(ld(6, b"".join(body), rng))
    # known fields with the wrong wire type are unknown fields
    if rng.random() < 0.2:
        pieces.append(rng.choice([tag(1, 0) + varint(5), tag(7, 2) + varint(1) + b"\x01", tag(8, 0) + varint(1),
                                  tag(6, 0) + varint(3), tag(5, 5) + b"abcd"]))
    pieces += maybe_unknown(rng)
    # pieces for different map keys/fields commute; keep the relative order of the map entries
    if rng.random() < 0.5:
        rng.shuffle(pieces)
    return b"".join(pieces)


FLOATS = st.sampled_from([0.0, 1.0, 0.5, -1.0, 1.5, 1e-30, math.nan, math.inf, -math.inf, 2.0 ** -149])
IDS = st.lists(st.one_of(st.integers(0, 300), st.integers(-(1 << 63), (1 << 63) - 1)), max_size=5)
NAMES = st.sampled_from(SLOTS + ["unknown", "", "user_i", "user_idd", "ü"])


@st.composite
def specs(draw):
    return {
        "example_id": draw(st.sampled_from(["e1", "e2", "e1", "", "ünï/3", None])),
        "item_id": draw(st.integers(-(1 << 63), (1 << 63) - 1)),
        "event_time_ms": draw(st.sampled_from([1, 1_700_000_000_000, 0, -5, None, (1 << 63) - 1])),
        "sample_rate": draw(st.sampled_from([1.0, 0.25, 0.0, -0.5, 1.0000001, math.nan, None, 1e-40])),
        "labels": draw(st.lists(st.tuples(st.sampled_from([LABEL, "like", "", None]),
                                          st.one_of(FLOATS, st.none())), max_size=3).map(
            lambda ls: ls if any(k == LABEL for k, _ in ls) or not ls else ls)),
        "sparse": draw(st.lists(st.tuples(st.one_of(NAMES, st.sampled_from(SLOTS)),
                                          st.one_of(IDS, st.none())), max_size=7)),
        "dense": draw(st.lists(st.tuples(st.sampled_from(DENSE + ["d2", ""]), st.one_of(FLOATS, st.none())),
                               max_size=4)),
    }


@st.composite
def valid_specs(draw):
    """Mostly-valid examples (so that OK records and their batches are well covered)."""
    s = draw(specs())
    s["example_id"] = draw(st.sampled_from(["e1", "e2", "ünï/3", "x" * 40]))
    s["event_time_ms"] = draw(st.sampled_from([1, 1_700_000_000_000]))
    s["sample_rate"] = draw(st.sampled_from([1.0, 0.25, 1e-40]))
    s["labels"] = draw(st.lists(st.tuples(st.sampled_from(["like", LABEL]), st.sampled_from([0.0, 1.0, math.nan])),
                                max_size=2)) + [(LABEL, draw(st.sampled_from([0.0, 1.0])))]
    s["sparse"] = [(k, ids) for k, ids in s["sparse"] if k in SLOTS]
    s["dense"] = [(d, draw(st.sampled_from([0.5, -2.0, math.nan]))) for d in DENSE] + \
        [(d, draw(st.sampled_from([0.5, -2.0]))) for d in DENSE if draw(st.booleans())]
    return s


def mutate(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(4)
        if op == 0 and b:
            del b[rng.randrange(len(b)):]
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2:
            b.insert(rng.randint(0, len(b)), rng.randrange(256))
        elif b:
            del b[rng.randrange(len(b))]
    return bytes(b)


#: ``WIRE_FUZZ_EXAMPLES=5000`` for a long differential run
N_FUZZ = int(os.environ.get("WIRE_FUZZ_EXAMPLES", "100"))
HYP = settings(max_examples=N_FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYP
@given(st.lists(st.one_of(specs(), valid_specs()), min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_randomized_encodings_match_protobuf(spec_list, rng):
    raws = [encode(s, rng) for s in spec_list]
    assert_same(raws)
    assert_same(raws, slots=["genres", "item_id"], dense=[])


@HYP
@given(st.lists(valid_specs(), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_protobuf_serialization_matches(spec_list, rng):
    """Messages the library builds and serializes (canonical encoding), then pieces concatenated."""
    raws = []
    for s in spec_list:
        ex = Example.FromString(encode(s, rng)) if True else None
        raws.append(ex.SerializeToString())
        # concatenation of one-field Examples, in field order then shuffled
        pieces = [Example(example_id=ex.example_id).SerializeToString(),
                  Example(event_time_ms=ex.event_time_ms, sample_rate=ex.sample_rate).SerializeToString()]
        pieces += [Example(labels={k: v}).SerializeToString() for k, v in ex.labels.items()]
        for k, slot in ex.features.sparse.items():
            e = Example()
            e.features.sparse[k].ids.extend(slot.ids)
            pieces.append(e.SerializeToString())
        for k, v in ex.features.dense.items():
            e = Example()
            e.features.dense[k] = v
            pieces.append(e.SerializeToString())
        rng.shuffle(pieces)
        raws.append(b"".join(pieces))
    dec = assert_same(raws)
    assert (dec.status == OK).sum() >= 0


@HYP
@given(st.lists(st.one_of(specs(), valid_specs()), min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_mutated_bytes_match_protobuf(spec_list, rng):
    assert_same([mutate(encode(s, rng), rng) for s in spec_list])


@settings(max_examples=2 * N_FUZZ, deadline=None)
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=10))
def test_arbitrary_bytes_match_protobuf(raws):
    assert_same(raws)


def _v(n):
    return varint(n)


def _nest(k: int, field: int = 3) -> bytes:
    return tag(field, 3) * k + tag(field, 4) * k


GOOD = Example(example_id="a", event_time_ms=5, sample_rate=1.0, labels={LABEL: 1.0},
               features={"dense": {"d0": 1.0, "d1": 2.0}}).SerializeToString()


@pytest.mark.parametrize("extra", [
    b"", b"\x0c", b"\x00\x05", b"\x0e", b"\x0f", b"\x0b\x08\x01\x14",      # end group alone, field 0, wt 6/7, bad end
    b"\xb8\x00\x05", b"\xb8\x80\x80\x80\x80\x00\x05", b"\xb8\x80\x80\x80\x70\x05",  # padded / 6-byte / >32-bit tag
    b"\x38" + b"\xff" * 9 + b"\x7f", b"\x38" + b"\xff" * 10 + b"\x01",     # 10-byte varint high bits, 11 bytes
    b"\x12\x80\x80\x80\x80\x00", b"\x12\xff\xff\xff\xff\x07", b"\x12\x80\x80\x80\x80\x80\x00",  # padded lengths
    b"\x12\x02\xc3\x28", b"\x12\x03\xed\xa0\x80", b"\x12\x04\xf4\x90\x80\x80", b"\x12\x02\xc0\x80",  # bad UTF-8
    b"\x12\x04\xf0\x9f\x98\x80", b"\x12\x03\xe2\x82\xac",                  # good UTF-8
    b"\x32\x01\x0c", b"\x32\x02\x0b\x0c",                                  # end group in features, group in features
])
def test_edge_encodings(extra):
    assert_same([GOOD + extra, extra + GOOD, extra])


@pytest.mark.parametrize("k", [95, 96, 97, 98, 99, 100, 101])
def test_group_depth_limit(k):
    """upb counts nested groups and messages against one limit of 100."""
    g = _nest(k)
    slot = ld(1, ld(1, b"age") + ld(2, g))            # groups inside a SparseSlot (depth 3)
    entry = ld(1, ld(1, b"age") + g)                  # inside a sparse map entry (depth 2)
    dentry = ld(2, ld(1, b"d0") + g + tag(2, 5) + f32(1.0))
    raws = [GOOD + g, GOOD + ld(6, g), GOOD + ld(6, slot), GOOD + ld(6, entry), GOOD + ld(5, ld(1, b"x") + g),
            GOOD + ld(6, dentry)]
    assert_same(raws)


def test_hash_is_murmur3_x64_128():
    # reference vectors of MurmurHash3_x64_128 (seed 0), e.g. mmh3.hash64(s, signed=False)
    got = hash_ids(["", "hello", "The quick brown fox jumps over the lazy dog"])
    assert got[0].tolist() == [0, 0]
    assert got[1].tolist() == [0xCBD8A7B341BD9B02, 0x5B1E906A48AE1D19]
    assert got[2].tolist() == [0xE34BBC7BBC071B6C, 0x7A433CA9C49A9347]
    many = hash_ids([f"{i}@{i * 7}/{i % 3}" for i in range(200_000)])
    assert len({tuple(r) for r in many.tolist()}) == 200_000


# ------------------------------------------------------------------------- dedup window
@settings(max_examples=100, deadline=None)
@given(st.integers(0, 9), st.lists(st.lists(st.integers(0, 25), max_size=8), max_size=12))
def test_dedup_window_is_a_fifo_of_the_last_ids(capacity, batches):
    w, ref = DedupWindow(capacity), OrderedDict()
    for b in batches:
        ids = [f"id{x}" for x in b]
        assert w.contains_many(hash_ids(ids)).tolist() == [i in ref for i in ids]
        w.add_many(hash_ids(ids))
        for i in ids:
            if i not in ref:
                ref[i] = None
                if len(ref) > capacity:
                    ref.popitem(last=False)
        assert len(w) == len(ref)
        assert np.array_equal(w.state(), hash_ids(list(ref)).reshape(-1, 2))
    w2 = DedupWindow(capacity)
    w2.load(w.state())
    assert np.array_equal(w2.state(), w.state())
    w3 = DedupWindow(capacity)
    w3.load(list(ref))  # snapshots written before the window held hashes
    assert np.array_equal(w3.state(), w.state())


def test_decoder_dedup_window_inflight_and_batch():
    def ex(eid):
        return Example(example_id=eid, event_time_ms=5, sample_rate=1.0, labels={LABEL: 1.0},
                       features={"dense": {"d0": 1.0, "d1": 2.0}}).SerializeToString()
    dec = ExampleDecoder(SLOTS, LABEL, DENSE)
    w = DedupWindow(100)
    w.add_many(hash_ids(["old"]))
    bad = Example(example_id="e1").SerializeToString()  # invalid: refused before dedup
    d = dec.decode([ex("a"), ex("old"), ex("b"), ex("a"), bad, ex("c"), ex("new")], w, hash_ids(["b", "zz"]))
    assert d.status.tolist() == [OK, DUPLICATE, DUPLICATE, DUPLICATE, REJECT, OK, OK]
    assert np.array_equal(d.hashes, hash_ids(["a", "c", "new"]))
