"""Wire formats for the ``examples`` topic (issue 13): encode/decode speed and bytes per example.

Formats: the former one protobuf ``Example`` per record (decoded by the numba ``trainer.wire``
parser in the study's table; that parser is gone since the switch, so this row now decodes with
upb objects and ``SparseBatch.from_examples``), an Arrow IPC record batch per record (``services.example_batch``, list and large_list
offsets), and a protobuf ``ExampleBatch`` with packed little-endian byte columns (candidate b,
built here from a dynamic descriptor: it was not chosen, so no .proto for it in the repo).

"Decode" is bytes -> the arrays of ``trainer.batch.SparseBatch`` (+ 128-bit id hashes).
"lz4" is aiokafka's own lz4 codec over the bytes a Kafka record batch would compress (for the
per-example format: all records of the batch concatenated, so that compression sees them together).

    python bench/bench_example_format.py          # ~1-2 min
    QUICK=1 python bench/bench_example_format.py  # < 30 s

Last line: one JSON object (the chosen format's numbers under ``decode_ex_per_s`` etc.).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from aiokafka.codec import lz4_encode
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto import Example
from services import example_batch as eb
from trainer.batch import SparseBatch

QUICK = os.environ.get("QUICK") == "1"
N = 2000
SLOTS = [f"s{i}" for i in range(8)]
LABEL, DENSE = "click", ["d0"]
REPS = 3 if QUICK else 10


def make_examples(n: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        req = f"req-{seed:04d}-{i // 10:07d}"
        item = int(rng.integers(1, 50_000))
        e = Example(example_id=f"{req}/{item}", request_id=req, item_id=item, user_id=int(rng.integers(1, 10**6)),
                    event_time_ms=1_760_000_000_000 + i * 7, sample_rate=1.0 if i % 3 else 0.1, model_id="ranker-v3")
        e.labels["click"] = float(rng.random() < 0.1)
        e.labels["watch_s"] = float(rng.exponential(30.0))
        for s in SLOTS:  # hashed feature ids: mostly large values, like real fid hashes
            e.features.sparse[s].ids.extend(rng.integers(0, 2**62, int(rng.integers(1, 6))).tolist())
        e.features.dense["d0"] = float(rng.random())
        out.append(e)
    return out


def best(fn, reps: int = REPS) -> float:
    fn()
    t = []
    for _ in range(reps):
        s = time.perf_counter()
        fn()
        t.append(time.perf_counter() - s)
    return min(t)


# ------------------------------------------------------------------ candidate (b): packed protobuf
def _batch_proto():
    f = descriptor_pb2.FileDescriptorProto(name="bench_example_batch.proto", package="bench", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto

    def msg(name, *fields):
        m = f.message_type.add(name=name)
        for i, (fname, typ, rep, tn) in enumerate(fields, 1):
            fd = m.field.add(name=fname, number=i, type=typ,
                             label=T.LABEL_REPEATED if rep else T.LABEL_OPTIONAL)
            if tn:
                fd.type_name = tn
    B, S, M = T.TYPE_BYTES, T.TYPE_STRING, T.TYPE_MESSAGE
    msg("Column", ("name", S, 0, None), ("values", B, 0, None), ("offsets", B, 0, None))
    msg("ExampleBatch", ("size", T.TYPE_UINT32, 0, None), ("example_ids", B, 0, None), ("example_id_offsets", B, 0, None),
        ("id_hash", B, 0, None), ("request_ids", B, 0, None), ("request_id_offsets", B, 0, None),
        ("item_id", B, 0, None), ("user_id", B, 0, None), ("event_time_ms", B, 0, None), ("sample_rate", B, 0, None),
        ("model_ids", S, 1, None), ("model_index", B, 0, None), ("labels", M, 1, ".bench.Column"),
        ("sparse", M, 1, ".bench.Column"), ("dense", M, 1, ".bench.Column"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.ExampleBatch"))


PB = _batch_proto()


def _strings(xs):
    enc = [x.encode() for x in xs]
    offs = np.zeros(len(enc) + 1, np.int32)
    np.cumsum(np.fromiter(map(len, enc), np.int32, len(enc)), out=offs[1:])
    return b"".join(enc), offs.tobytes()


def pb_encode(c: eb.ExampleColumns) -> bytes:
    m = PB(size=c.size)
    m.example_ids, m.example_id_offsets = _strings(c.example_ids)
    m.request_ids, m.request_id_offsets = _strings(c.request_ids)
    m.id_hash = eb.hash_ids(c.example_ids).astype("<u8").tobytes()
    for k in ("item_id", "user_id", "event_time_ms"):
        setattr(m, k, np.asarray(getattr(c, k), "<i8").tobytes())
    m.sample_rate = np.asarray(c.sample_rate, "<f4").tobytes()
    names, idx = np.unique(np.array(c.model_ids, object), return_inverse=True)
    m.model_ids.extend(names.tolist())
    m.model_index = idx.astype("<i4").tobytes()
    for k, v in sorted(c.labels.items()):
        m.labels.add(name=k, values=np.asarray(v, "<f4").tobytes())
    for k, (ids, offs) in sorted(c.sparse.items()):
        m.sparse.add(name=k, values=np.asarray(ids, "<i8").tobytes(), offsets=np.asarray(offs, "<i4").tobytes())
    for k, v in sorted(c.dense.items()):
        m.dense.add(name=k, values=np.asarray(v, "<f4").tobytes())
    return m.SerializeToString()


def pb_decode_arrays(raws: list[bytes]) -> dict:
    """The same checks as the Arrow decoder that matter for the trainer (lengths, offsets, rates)."""
    parts = []
    for raw in raws:
        m = PB.FromString(raw)
        n = m.size
        col = lambda b, dt, k=n: _view(b, dt, k)  # noqa: E731
        t, rate = col(m.event_time_ms, "<i8"), col(m.sample_rate, "<f4")
        for o, b in ((col(m.example_id_offsets, "<i4", n + 1), m.example_ids),
                     (col(m.request_id_offsets, "<i4", n + 1), m.request_ids)):
            if o[0] != 0 or o[-1] != len(b) or np.any(np.diff(o) < 0):
                raise ValueError("bad string offsets")
        if np.any(t <= 0) or not np.all((rate > 0) & (rate <= 1)):
            raise ValueError("bad event time or rate")
        sparse = {}
        for s in m.sparse:
            o = col(s.offsets, "<i4", n + 1).astype(np.int64)
            ids = np.frombuffer(s.values, "<i8")
            if o[0] != 0 or o[-1] != ids.size or np.any(np.diff(o) < 0):
                raise ValueError("bad offsets")
            sparse[s.name] = ids, o
        parts.append(eb.ExampleColumns(range(n), range(n), col(m.item_id, "<i8"), col(m.user_id, "<i8"), t, rate,
                                       [""] * n, labels={c.name: col(c.values, "<f4") for c in m.labels},
                                       sparse=sparse, dense={c.name: col(c.values, "<f4") for c in m.dense},
                                       id_hash=col(m.id_hash, "<u8", 2 * n).reshape(n, 2)))
    return eb.to_sparse_batch_arrays(parts, SLOTS, LABEL, DENSE)


def _view(b: bytes, dt: str, n: int) -> np.ndarray:
    a = np.frombuffer(b, dt)
    if a.size != n:
        raise ValueError("column length")
    return a


# ------------------------------------------------------------------ run
def main() -> None:
    exs = make_examples(N)
    cols = eb.from_examples(exs)
    results = {}

    raws = [e.SerializeToString() for e in exs]

    def pe_decode():  # (the numba trainer.wire parser measured in the study is gone: upb objects)
        b = SparseBatch.from_examples([Example.FromString(r) for r in raws], SLOTS, LABEL, DENSE)
        assert b.size == N
        return b.ids, b.offsets
    results["protobuf_per_example"] = dict(
        encode=best(lambda: [e.SerializeToString() for e in exs]), decode=best(pe_decode),
        raw=sum(map(len, raws)), lz4=len(lz4_encode(b"".join(raws))), records=N)

    for name, large in (("arrow_list", False), ("arrow_large_list", True)):
        raw = eb.encode(cols, large_lists=large)
        results[name] = dict(
            encode=best(lambda large=large: eb.encode(cols, large_lists=large)),
            decode=best(lambda raw=raw: eb.to_sparse_batch_arrays([eb.decode(raw)], SLOTS, LABEL, DENSE)),
            raw=len(raw), lz4=len(lz4_encode(raw)), records=1)

    raw = pb_encode(cols)
    results["protobuf_packed_batch"] = dict(encode=best(lambda: pb_encode(cols)), decode=best(lambda: pb_decode_arrays([raw])),
                                            raw=len(raw), lz4=len(lz4_encode(raw)), records=1)

    # the formats agree on the batch they carry
    want = eb.to_sparse_batch_arrays([eb.decode(eb.encode(cols))], SLOTS, LABEL, DENSE)
    got_pb = pb_decode_arrays([pb_encode(cols)])
    ids, offs = pe_decode()
    for s in SLOTS:
        assert np.array_equal(want["ids"][s], ids[s]) and np.array_equal(want["offsets"][s], offs[s])
        assert np.array_equal(want["ids"][s], got_pb["ids"][s]) and np.array_equal(want["offsets"][s], got_pb["offsets"][s])
    hash_cost = best(lambda: eb.hash_ids(cols.example_ids)) / N
    from_ex = best(lambda: eb.from_examples(exs), reps=max(1, REPS // 3)) / N

    print(f"{N} examples, {len(SLOTS)} slots of 1-5 ids, 2 labels, 1 dense; best of {REPS}")
    print(f"{'format':24} {'encode ex/s':>12} {'decode ex/s':>12} {'B/ex raw':>9} {'B/ex lz4':>9}")
    for name, r in results.items():
        print(f"{name:24} {N / r['encode']:12,.0f} {N / r['decode']:12,.0f} {r['raw'] / N:9.1f} {r['lz4'] / N:9.1f}")
    print(f"blake2b-128 id hash: {hash_cost * 1e9:.0f} ns/example (part of the columnar encodes); "
          f"from_examples (protos -> columns): {from_ex * 1e6:.1f} us/example")
    chosen = results["arrow_list"]
    out = {"format": "arrow_ipc_list_int64", "examples": N, "decode_ex_per_s": round(N / chosen["decode"]),
           "encode_ex_per_s": round(N / chosen["encode"]), "record_bytes_per_example": round(chosen["raw"] / N, 1),
           "lz4_bytes_per_example": round(chosen["lz4"] / N, 1),
           "baseline_protobuf_decode_ex_per_s": round(N / results["protobuf_per_example"]["decode"]),
           "all": {k: {"encode_ex_per_s": round(N / r["encode"]), "decode_ex_per_s": round(N / r["decode"]),
                       "bytes_per_example": round(r["raw"] / N, 1), "lz4_bytes_per_example": round(r["lz4"] / N, 1)}
                   for k, r in results.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
