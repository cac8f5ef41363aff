"""Example bytes -> batch arrays without protobuf objects: a numba wire-format decoder and a
numba example-id dedup window.

The online trainer receives ``driftline.v1.Example`` records (``proto/example.proto``). Building a
Python message per example and walking its maps cost ~20 us/example and held the GIL; here the
records of one poll are concatenated into one buffer and decoded by :func:`_scan` (validate, one
record at a time, into per-example fields) and :func:`_emit` (the surviving examples' ids, straight
into the slot-major ``ids``/``offsets`` layout of :class:`trainer.batch.SparseBatch`), all with the
GIL released.

What "the same as protobuf" means here (property-tested against the upb parser in
``tests/trainer/test_wire.py``):

* every valid encoding: fields in any order, repeated ``ids`` packed or not (or both), a message
  field given several times is merged (``features`` twice: its maps are merged, last key wins; a
  map entry's ``SparseSlot`` value given twice within one entry: its ids are concatenated), last
  occurrence wins for scalars and map keys, unknown fields (groups included) are skipped, a known
  field with an unexpected wire type is an unknown field, 10-byte varints keep their low 64 bits,
  and a map entry holding an unknown field is left out of the map (upb moves it to the parent's
  unknown fields);
* what upb rejects is rejected: truncated input, varints over 10 bytes, tags over 32 bits or of
  field 0, wire types 6/7, unmatched end-groups, invalid UTF-8 in a string field or map key, more
  nested groups than upb's depth limit (100 levels including the enclosing messages).

Validation is the consumer codec's (``services.codecs.validate_example``) plus the trainer's own
checks (``OnlineTrainer._check``): the verdict is computed here, and for the (rare) rejected
records the caller re-decodes with protobuf to get the exact reason text for the dead letter.

Example ids are hashed to 128 bits (MurmurHash3 x64-128 of the UTF-8 bytes). The dedup window
compares full 128-bit hashes: two distinct ids collide with probability ~2^-128 per pair, i.e.
~1e-25 for a 200k-id window against a billion examples - never, in practice.
"""

from __future__ import annotations

import numpy as np

from ps._jit import njit

OK, UNDECODABLE, REJECT, DUPLICATE = 0, 1, 2, 3
#: upb's default recursion limit: nested messages + groups, counting from the Example (0)
MAX_DEPTH = 100

_U7F = np.uint64(0x7F)
_U32MAX = np.uint64(0xFFFFFFFF)
_SIZE_MAX = np.uint64(0x7FFFFFFF)


# ---------------------------------------------------------------------------------- primitives
@njit
def _varint(buf, p, end):
    """(value, next position); next position -1 when truncated or longer than 10 bytes."""
    result = np.uint64(0)
    shift = np.uint64(0)
    for _ in range(10):
        if p >= end:
            return np.uint64(0), -1
        b = buf[p]
        p += 1
        result |= (np.uint64(b) & _U7F) << shift
        if b < 0x80:
            return result, p
        shift += np.uint64(7)
    return np.uint64(0), -1


@njit
def _tag(buf, p, end):
    """(field, wire type, next position); position -1 when malformed (upb: <= 5 bytes, 32 bits)."""
    v, q = _varint(buf, p, end)
    if q < 0 or q - p > 5 or v > _U32MAX:
        return 0, 0, -1
    field = np.int64(v >> np.uint64(3))
    if field == 0:
        return 0, 0, -1
    return field, np.int64(v & np.uint64(7)), q


@njit
def _len(buf, p, end):
    """(payload start, payload end) of a length-delimited field; start -1 when malformed."""
    v, q = _varint(buf, p, end)
    if q < 0 or q - p > 5 or v >= _SIZE_MAX:  # upb: a 32-bit varint (at most 5 bytes)
        return -1, -1
    e = q + np.int64(v)
    if e > end:
        return -1, -1
    return q, e


@njit
def _f32(buf, p, scratch):
    scratch[0] = (np.uint32(buf[p]) | (np.uint32(buf[p + 1]) << np.uint32(8))
                  | (np.uint32(buf[p + 2]) << np.uint32(16)) | (np.uint32(buf[p + 3]) << np.uint32(24)))
    return scratch.view(np.float32)[0]


@njit
def _utf8(buf, s, e):
    """Strict UTF-8 (no overlongs, surrogates or code points over U+10FFFF), as upb checks it."""
    i = s
    while i < e:
        c = buf[i]
        if c < 0x80:
            i += 1
            continue
        if c < 0xC2:
            return False
        if c < 0xE0:
            n, lo, hi = 1, 0x80, 0xBF
        elif c < 0xF0:
            n = 2
            lo = 0xA0 if c == 0xE0 else 0x80
            hi = 0x9F if c == 0xED else 0xBF
        elif c < 0xF5:
            n = 3
            lo = 0x90 if c == 0xF0 else 0x80
            hi = 0x8F if c == 0xF4 else 0xBF
        else:
            return False
        if i + n >= e:
            return False
        b = buf[i + 1]
        if b < lo or b > hi:
            return False
        for k in range(2, n + 1):
            b = buf[i + k]
            if b < 0x80 or b > 0xBF:
                return False
        i += n + 1
    return True


@njit
def _skip_group(buf, p, end, field, budget):
    """Skip an unknown group whose start tag (``field``) was just read; nested groups count
    against ``budget`` (levels left). Returns the position after its end tag, or -1."""
    if budget < 1:
        return -1
    stack = np.empty(budget, np.int64)
    sp = 0
    stack[0] = field
    while True:
        f, wt, p = _tag(buf, p, end)
        if p < 0:
            return -1
        if wt == 4:
            if f != stack[sp]:
                return -1
            sp -= 1
            if sp < 0:
                return p
        elif wt == 3:
            sp += 1
            if sp >= budget:
                return -1
            stack[sp] = f
        else:
            p = _skip_scalar(buf, p, end, wt)
            if p < 0:
                return -1


@njit
def _skip_scalar(buf, p, end, wt):
    if wt == 0:
        _, p = _varint(buf, p, end)
        return p
    if wt == 1:
        return p + 8 if p + 8 <= end else -1
    if wt == 2:
        s, e = _len(buf, p, end)
        return e if s >= 0 else -1
    if wt == 5:
        return p + 4 if p + 4 <= end else -1
    return -1


@njit
def _skip(buf, p, end, field, wt, budget):
    """Skip one unknown field (tag already read); -1 when malformed."""
    if wt == 3:
        return _skip_group(buf, p, end, field, budget)
    return _skip_scalar(buf, p, end, wt)


@njit
def _find(buf, ks, ke, names, offs, guess):
    """Index of the name ``buf[ks:ke]`` in the table (``names`` bytes, ``offs`` [n+1]), or -1.
    Starts at ``guess`` (examples list their slots in the same order, so the next one usually)."""
    n = ke - ks
    m = offs.size - 1
    for t in range(m):
        k = guess + t
        if k >= m:
            k -= m
        a = offs[k]
        if offs[k + 1] - a != n:
            continue
        same = True
        for j in range(n):
            if buf[ks + j] != names[a + j]:
                same = False
                break
        if same:
            return k
    return -1


@njit
def _bytes_eq(buf, a, b, n):
    for j in range(n):
        if buf[a + j] != buf[b + j]:
            return False
    return True


@njit
def _slot_ids(buf, p, end, out, o):
    """Walk a SparseSlot message: count its ids (``out`` None-like: o < 0) or write them at
    ``out[o:]``. Returns (count, ok)."""
    c = 0
    while p < end:
        f, wt, p = _tag(buf, p, end)
        if p < 0:
            return c, False
        if f == 1 and wt == 2:
            s, e = _len(buf, p, end)
            if s < 0:
                return c, False
            p = s
            while p < e:
                v, p = _varint(buf, p, e)
                if p < 0:
                    return c, False
                if o >= 0:
                    out[o + c] = np.int64(v)
                c += 1
        elif f == 1 and wt == 0:
            v, p = _varint(buf, p, end)
            if p < 0:
                return c, False
            if o >= 0:
                out[o + c] = np.int64(v)
            c += 1
        else:
            p = _skip(buf, p, end, f, wt, MAX_DEPTH - 3)
            if p < 0:
                return c, False
    return c, True


# ---------------------------------------------------------------------------------- murmur3
_C1 = np.uint64(0x87C37B91114253D5)
_C2 = np.uint64(0x4CF5AD432745937F)
_F1 = np.uint64(0xFF51AFD7ED558CCD)
_F2 = np.uint64(0xC4CEB9FE1A85EC53)


@njit
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit
def _fmix(k):
    k ^= k >> np.uint64(33)
    k *= _F1
    k ^= k >> np.uint64(33)
    k *= _F2
    k ^= k >> np.uint64(33)
    return k


@njit
def _u64le(buf, p, n):
    v = np.uint64(0)
    for j in range(n):
        v |= np.uint64(buf[p + j]) << np.uint64(8 * j)
    return v


@njit
def murmur3_128(buf, s, e):
    """MurmurHash3 x64-128 (seed 0) of ``buf[s:e]``: (h1, h2)."""
    n = e - s
    h1 = np.uint64(0)
    h2 = np.uint64(0)
    nb = n // 16
    for b in range(nb):
        k1 = _u64le(buf, s + 16 * b, 8)
        k2 = _u64le(buf, s + 16 * b + 8, 8)
        k1 *= _C1
        k1 = _rotl(k1, 31)
        k1 *= _C2
        h1 ^= k1
        h1 = _rotl(h1, 27)
        h1 += h2
        h1 = h1 * np.uint64(5) + np.uint64(0x52DCE729)
        k2 *= _C2
        k2 = _rotl(k2, 33)
        k2 *= _C1
        h2 ^= k2
        h2 = _rotl(h2, 31)
        h2 += h1
        h2 = h2 * np.uint64(5) + np.uint64(0x38495AB5)
    t = s + 16 * nb
    rest = n - 16 * nb
    if rest > 8:
        k2 = _u64le(buf, t + 8, rest - 8)
        k2 *= _C2
        k2 = _rotl(k2, 33)
        k2 *= _C1
        h2 ^= k2
    if rest > 0:
        k1 = _u64le(buf, t, min(rest, 8))
        k1 *= _C1
        k1 = _rotl(k1, 31)
        k1 *= _C2
        h1 ^= k1
    h1 ^= np.uint64(n)
    h2 ^= np.uint64(n)
    h1 += h2
    h2 += h1
    h1 = _fmix(h1)
    h2 = _fmix(h2)
    h1 += h2
    h2 += h1
    return h1, h2


@njit
def _hash_all(buf, starts, out):
    for i in range(starts.size - 1):
        out[i, 0], out[i, 1] = murmur3_128(buf, starts[i], starts[i + 1])


def hash_ids(ids: list[str]) -> np.ndarray:
    """128-bit hashes ``uint64 [n, 2]`` of example ids (what the decoder computes from the wire)."""
    enc = [s.encode() for s in ids]
    starts = np.zeros(len(enc) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, enc), np.int64, len(enc)), out=starts[1:])
    out = np.zeros((len(enc), 2), np.uint64)
    _hash_all(np.frombuffer(b"".join(enc) or b"\0", np.uint8), starts, out)
    return out


# ---------------------------------------------------------------------------------- the scan
@njit
def _scan(buf, starts, slot_names, slot_offs, label, dense_names, dense_offs,
          status, labels, event_time, sample_rate, dense, eid_hash, ent_s, ent_e, counts):
    """Decode and validate every record ``buf[starts[i]:starts[i+1]]``: ``status[i]`` is OK,
    UNDECODABLE (protobuf would not parse it) or REJECT (it parses but the codec's or the
    trainer's validation refuses it; the reason is not computed here). For OK records: label,
    event time, sample rate, dense row, the id hash, and per slot the winning map entry's byte
    range and id count."""
    n = starts.size - 1
    n_slots = slot_offs.size - 1
    n_dense = dense_offs.size - 1
    scratch = np.zeros(1, np.uint32)
    no_out = np.empty(0, np.int64)
    dpres = np.zeros(max(n_dense, 1), np.bool_)
    max_len = 0
    for i in range(n):
        max_len = max(max_len, starts[i + 1] - starts[i])
    # every label map entry: key range, value (for "last key wins" on non-finite values)
    lab_ks = np.empty(max_len // 2 + 1, np.int64)
    lab_ke = np.empty(max_len // 2 + 1, np.int64)
    lab_v = np.empty(max_len // 2 + 1, np.float32)
    n_label = label.size
    guess = 0
    for i in range(n):
        p = starts[i]
        end = starts[i + 1]
        eid_s = p
        eid_e = p
        et = np.int64(0)
        sr = np.float32(0.0)
        has_label = False
        lab_val = np.float32(0.0)
        nl = 0
        for k in range(n_slots):
            ent_s[i, k] = -1
            counts[i, k] = 0
        for j in range(n_dense):
            dpres[j] = False
            dense[i, j] = 0.0
        st = OK
        refused = False  # parses, but validation refuses it (keep parsing: undecodable wins)
        while p < end and st == OK:
            f, wt, p = _tag(buf, p, end)
            if p < 0:
                st = UNDECODABLE
                break
            if f == 1 and wt == 2:
                s, e = _len(buf, p, end)
                if s < 0 or not _utf8(buf, s, e):
                    st = UNDECODABLE
                    break
                eid_s, eid_e, p = s, e, e
            elif (f == 2 or f == 9) and wt == 2:
                s, e = _len(buf, p, end)
                if s < 0 or not _utf8(buf, s, e):
                    st = UNDECODABLE
                    break
                p = e
            elif (f == 3 or f == 4 or f == 7) and wt == 0:
                v, p = _varint(buf, p, end)
                if p < 0:
                    st = UNDECODABLE
                    break
                if f == 7:
                    et = np.int64(v)
            elif f == 8 and wt == 5:
                if p + 4 > end:
                    st = UNDECODABLE
                    break
                sr = _f32(buf, p, scratch)
                p += 4
            elif f == 5 and wt == 2:  # labels entry: string key = 1, float value = 2
                s, e = _len(buf, p, end)
                if s < 0:
                    st = UNDECODABLE
                    break
                p = s
                ks = s
                ke = s
                val = np.float32(0.0)
                unknown = False
                while p < e:
                    f2, wt2, p = _tag(buf, p, e)
                    if p < 0:
                        break
                    if f2 == 1 and wt2 == 2:
                        s2, e2 = _len(buf, p, e)
                        if s2 < 0 or not _utf8(buf, s2, e2):
                            p = -1
                            break
                        ks, ke, p = s2, e2, e2
                    elif f2 == 2 and wt2 == 5:
                        if p + 4 > e:
                            p = -1
                            break
                        val = _f32(buf, p, scratch)
                        p += 4
                    else:
                        unknown = True
                        p = _skip(buf, p, e, f2, wt2, MAX_DEPTH - 1)
                        if p < 0:
                            break
                if p < 0:
                    st = UNDECODABLE
                    break
                if unknown:  # upb keeps a map entry with unknown fields out of the map
                    continue
                lab_ks[nl] = ks
                lab_ke[nl] = ke
                lab_v[nl] = val
                nl += 1
                if ke - ks == n_label:
                    same = True
                    for j in range(n_label):
                        if buf[ks + j] != label[j]:
                            same = False
                            break
                    if same:
                        has_label = True
                        lab_val = val
            elif f == 6 and wt == 2:  # features (merged when repeated)
                s, e = _len(buf, p, end)
                if s < 0:
                    st = UNDECODABLE
                    break
                p = s
                while p < e:
                    f2, wt2, p = _tag(buf, p, e)
                    if p < 0:
                        break
                    if (f2 == 1 or f2 == 2) and wt2 == 2:  # sparse / dense map entry
                        s2, e2 = _len(buf, p, e)
                        if s2 < 0:
                            p = -1
                            break
                        p = s2
                        ks = s2
                        ke = s2
                        cnt = 0
                        val = np.float32(0.0)
                        unknown = False
                        while p < e2:
                            f3, wt3, p = _tag(buf, p, e2)
                            if p < 0:
                                break
                            if f3 == 1 and wt3 == 2:
                                s3, e3 = _len(buf, p, e2)
                                if s3 < 0 or not _utf8(buf, s3, e3):
                                    p = -1
                                    break
                                ks, ke, p = s3, e3, e3
                            elif f3 == 2 and wt3 == 2 and f2 == 1:
                                s3, e3 = _len(buf, p, e2)
                                if s3 < 0:
                                    p = -1
                                    break
                                c, good = _slot_ids(buf, s3, e3, no_out, -1)
                                if not good:
                                    p = -1
                                    break
                                cnt += c
                                p = e3
                            elif f3 == 2 and wt3 == 5 and f2 == 2:
                                if p + 4 > e2:
                                    p = -1
                                    break
                                val = _f32(buf, p, scratch)
                                p += 4
                            else:
                                unknown = True
                                p = _skip(buf, p, e2, f3, wt3, MAX_DEPTH - 2)
                                if p < 0:
                                    break
                        if p < 0:
                            break
                        if unknown:  # upb keeps a map entry with unknown fields out of the map
                            continue
                        if f2 == 1:
                            k = _find(buf, ks, ke, slot_names, slot_offs, guess)
                            if k < 0:  # unknown or empty slot name: can never leave the map
                                refused = True
                                continue
                            guess = k + 1 if k + 1 < n_slots else 0
                            ent_s[i, k] = s2
                            ent_e[i, k] = e2
                            counts[i, k] = cnt
                        else:
                            j = _find(buf, ks, ke, dense_names, dense_offs, 0)
                            if j < 0:  # a dense feature the model does not read: wrong dim
                                refused = True
                                continue
                            dpres[j] = True
                            dense[i, j] = val
                    else:
                        p = _skip(buf, p, e, f2, wt2, MAX_DEPTH - 1)
                        if p < 0:
                            break
                if p < 0:
                    st = UNDECODABLE
                    break
            else:
                p = _skip(buf, p, end, f, wt, MAX_DEPTH)
                if p < 0:
                    st = UNDECODABLE
                    break
        if st == OK:
            if refused or eid_e == eid_s or et <= 0 or not (sr > 0.0 and sr <= 1.0) or not has_label:
                st = REJECT
        if st == OK:
            for j in range(nl):  # a non-finite label is an error unless a later entry replaces it
                if not np.isfinite(lab_v[j]):
                    replaced = False
                    for j2 in range(j + 1, nl):
                        if lab_ke[j2] - lab_ks[j2] == lab_ke[j] - lab_ks[j] and \
                                _bytes_eq(buf, lab_ks[j], lab_ks[j2], lab_ke[j] - lab_ks[j]):
                            replaced = True
                            break
                    if not replaced:
                        st = REJECT
                        break
        if st == OK:
            for j in range(n_dense):
                if not dpres[j] or not np.isfinite(dense[i, j]):
                    st = REJECT
                    break
        status[i] = st
        if st == OK:
            labels[i] = lab_val
            event_time[i] = et
            sample_rate[i] = sr
            eid_hash[i, 0], eid_hash[i, 1] = murmur3_128(buf, eid_s, eid_e)


@njit
def _emit(buf, keep, ent_s, ent_e, counts, ids, offsets):
    """Slot-major ids of the kept records: slot k's ids at ``offsets[k, 0]...``: ``offsets[k]`` is
    absolute into ``ids`` (the caller subtracts the slot's base)."""
    n_slots = ent_s.shape[1]
    m = keep.size
    o = 0
    for k in range(n_slots):
        for r in range(m):
            i = keep[r]
            offsets[k, r] = o
            s = ent_s[i, k]
            if s < 0:
                continue
            e = ent_e[i, k]
            p = s
            while p < e:  # the entry's SparseSlot values (merged when repeated)
                f, wt, p = _tag(buf, p, e)
                if f == 2 and wt == 2:
                    s3, e3 = _len(buf, p, e)
                    c, _ = _slot_ids(buf, s3, e3, ids, o)
                    o += c
                    p = e3
                else:
                    p = _skip(buf, p, e, f, wt, MAX_DEPTH - 2)
        offsets[k, m] = o


# ---------------------------------------------------------------------------------- dedup window
@njit
def _probe_home(h1, mask):
    return np.int64(h1 & np.uint64(mask))


@njit
def _win_find(table, ring, h1, h2):
    mask = table.size - 1
    j = _probe_home(h1, mask)
    while True:
        r = table[j]
        if r < 0:
            return -1
        if ring[r, 0] == h1 and ring[r, 1] == h2:
            return j
        j = (j + 1) & mask


@njit
def _win_delete(table, ring, j):
    """Backward-shift deletion at table position ``j`` (linear probing)."""
    mask = table.size - 1
    table[j] = -1
    i = j
    while True:
        j = (j + 1) & mask
        r = table[j]
        if r < 0:
            return
        home = _probe_home(ring[r, 0], mask)
        # keep r where it is when its home lies cyclically in (i, j]
        if i <= j:
            stay = home > i and home <= j
        else:
            stay = home > i or home <= j
        if not stay:
            table[i] = r
            table[j] = -1
            i = j


@njit
def _win_add(table, ring, meta, hashes):
    """Append ``hashes`` to the window (meta = [head, length]); the oldest leave past capacity."""
    cap = ring.shape[0]
    mask = table.size - 1
    for r in range(hashes.shape[0]):
        h1 = hashes[r, 0]
        h2 = hashes[r, 1]
        if _win_find(table, ring, h1, h2) >= 0:
            continue
        head = meta[0]
        if meta[1] == cap:  # full: evict the oldest, at head
            j = _win_find(table, ring, ring[head, 0], ring[head, 1])
            _win_delete(table, ring, j)
        else:
            meta[1] += 1
        ring[head, 0] = h1
        ring[head, 1] = h2
        j = _probe_home(h1, mask)
        while table[j] >= 0:
            j = (j + 1) & mask
        table[j] = head
        meta[0] = head + 1 if head + 1 < cap else 0


@njit
def _win_contains(table, ring, hashes, out):
    for r in range(hashes.shape[0]):
        out[r] = _win_find(table, ring, hashes[r, 0], hashes[r, 1]) >= 0


@njit
def _dedup(table, ring, inflight, hashes, status):
    """Mark DUPLICATE the OK records whose id is in the window, in flight, or earlier in this batch."""
    n = hashes.shape[0]
    m = inflight.shape[0]
    size = 16
    while size < 2 * (n + m):
        size *= 2
    mask = size - 1
    seen = np.full(size, -1, np.int64)  # index into the concatenation inflight ++ hashes
    for r in range(m + n):
        if r < m:
            h1 = inflight[r, 0]
            h2 = inflight[r, 1]
        else:
            if status[r - m] != OK:
                continue
            h1 = hashes[r - m, 0]
            h2 = hashes[r - m, 1]
            if table.size > 0 and _win_find(table, ring, h1, h2) >= 0:
                status[r - m] = DUPLICATE
                continue
        j = _probe_home(h1, mask)
        dup = False
        while seen[j] >= 0:
            q = seen[j]
            a1 = inflight[q, 0] if q < m else hashes[q - m, 0]
            a2 = inflight[q, 1] if q < m else hashes[q - m, 1]
            if a1 == h1 and a2 == h2:
                dup = True
                break
            j = (j + 1) & mask
        if dup:
            if r >= m:
                status[r - m] = DUPLICATE
        else:
            seen[j] = r


class DedupWindow:
    """The 128-bit hashes of the last ``capacity`` example ids (insertion order), in a numba
    open-addressing table over a ring buffer: lookups and inserts of a whole batch in one call."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = int(capacity)
        size = 16
        while size < 2 * self.capacity:
            size *= 2
        self._table = np.full(size if self.capacity > 0 else 0, -1, np.int64)
        self._ring = np.zeros((max(self.capacity, 1), 2), np.uint64)
        self._meta = np.zeros(2, np.int64)  # head (next write), length

    def __len__(self) -> int:
        return int(self._meta[1])

    def add_many(self, hashes: np.ndarray) -> None:
        if self.capacity > 0 and len(hashes):
            _win_add(self._table, self._ring, self._meta, np.ascontiguousarray(hashes, np.uint64))

    def contains_many(self, hashes: np.ndarray) -> np.ndarray:
        hashes = np.ascontiguousarray(hashes, np.uint64).reshape(-1, 2)
        out = np.zeros(len(hashes), np.bool_)
        if self.capacity > 0:
            _win_contains(self._table, self._ring, hashes, out)
        return out

    def __contains__(self, eid: str) -> bool:
        return bool(self.contains_many(hash_ids([eid]))[0])

    def add(self, eid: str) -> None:
        if eid:
            self.add_many(hash_ids([eid]))

    def state(self) -> np.ndarray:
        """The window's hashes, oldest first (``uint64 [n, 2]``)."""
        head, n = int(self._meta[0]), int(self._meta[1])
        if n < self.capacity or self.capacity == 0:
            return self._ring[:n].copy()
        return np.concatenate([self._ring[head:], self._ring[:head]])

    def load(self, state) -> None:
        """From :meth:`state`, or from a list of example id strings (snapshots before the hashes)."""
        self.__init__(self.capacity)
        if isinstance(state, np.ndarray):
            hashes = state.reshape(-1, 2)
        else:
            hashes = hash_ids(list(state))
        self.add_many(hashes[-self.capacity:] if self.capacity else hashes[:0])


# ---------------------------------------------------------------------------------- decoder
class ExampleDecoder:
    """Decode a poll's Example records straight into a batch.

    ``decode(raws, window, inflight)`` returns ``(status int8 [n], batch arrays of the OK records)``
    where status is OK, UNDECODABLE, REJECT or DUPLICATE per record.
    """

    def __init__(self, slots: list[str], label: str, dense_features: list[str]):
        self.slots = list(slots)
        self.label = np.frombuffer(label.encode(), np.uint8).copy()
        self.dense_features = list(dense_features)
        self._slot_names, self._slot_offs = _name_table(self.slots)
        self._dense_names, self._dense_offs = _name_table(self.dense_features)

    def decode(self, raws: list[bytes], window: DedupWindow | None = None,
               inflight: np.ndarray | None = None) -> "DecodedBatch":
        n = len(raws)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, raws), np.int64, n), out=starts[1:])
        return self.decode_concat(np.frombuffer(b"".join(raws), np.uint8), starts, window, inflight)

    def decode_concat(self, buf: np.ndarray, starts: np.ndarray, window: DedupWindow | None = None,
                      inflight: np.ndarray | None = None) -> "DecodedBatch":
        """:meth:`decode` of records already concatenated: record ``i`` is ``buf[starts[i]:starts[i + 1]]``
        (``buf`` uint8, ``starts`` int64 ``[n + 1]``)."""
        n = starts.size - 1
        S, D = len(self.slots), len(self.dense_features)
        status = np.empty(n, np.int8)
        labels = np.empty(n, np.float32)
        event_time = np.empty(n, np.int64)
        sample_rate = np.empty(n, np.float32)
        dense = np.empty((n, D), np.float32)
        eid_hash = np.zeros((n, 2), np.uint64)
        ent_s = np.empty((n, S), np.int64)
        ent_e = np.empty((n, S), np.int64)
        counts = np.empty((n, S), np.int64)
        _scan(buf, starts, self._slot_names, self._slot_offs, self.label, self._dense_names, self._dense_offs,
              status, labels, event_time, sample_rate, dense, eid_hash, ent_s, ent_e, counts)
        if window is not None:
            inflight = np.zeros((0, 2), np.uint64) if inflight is None else inflight
            _dedup(window._table, window._ring, inflight, eid_hash, status)
        keep = np.flatnonzero(status == OK)
        m = keep.size
        total = int(counts[keep].sum())
        ids = np.empty(total, np.int64)
        offsets = np.empty((S, m + 1), np.int64)
        if m:
            _emit(buf, keep, ent_s, ent_e, counts, ids, offsets)
        else:
            offsets[:] = 0
        return DecodedBatch(status, keep, labels[keep], event_time[keep], sample_rate[keep],
                            dense[keep] if D else None, eid_hash[keep], ids, offsets)


class DecodedBatch:
    __slots__ = ("status", "keep", "labels", "event_time_ms", "sample_rate", "dense", "hashes", "_ids", "_offsets")

    def __init__(self, status, keep, labels, event_time_ms, sample_rate, dense, hashes, ids, offsets):
        self.status, self.keep = status, keep
        self.labels, self.event_time_ms, self.sample_rate, self.dense = labels, event_time_ms, sample_rate, dense
        self.hashes, self._ids, self._offsets = hashes, ids, offsets

    @property
    def size(self) -> int:
        return int(self.keep.size)

    def slot_arrays(self, slots: list[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Per slot: ids (a view of one array) and offsets ``[size + 1]`` starting at 0."""
        ids, offs = {}, {}
        for k, s in enumerate(slots):
            o = self._offsets[k]
            base = int(o[0])
            ids[s] = self._ids[base:int(o[-1])]
            offs[s] = o - base if base else o
        return ids, offs


def _name_table(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    enc = [n.encode() for n in names]
    offs = np.zeros(len(enc) + 1, np.int64)
    np.cumsum([len(b) for b in enc], out=offs[1:])
    return np.frombuffer(b"".join(enc) or b"\0", np.uint8).copy(), offs
