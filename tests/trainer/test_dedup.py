"""The trainer's example-id dedup window (:mod:`trainer.dedup`), keyed by the shipped ``id_hash``."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.example_batch import hash_ids
from trainer.dedup import DedupWindow, duplicates


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
    w3.load(list(ref))  # snapshots written before the window held hashes: ids, hashed again
    assert np.array_equal(w3.state(), w.state())


def test_duplicates_of_the_window_the_batches_in_flight_and_the_batch_itself():
    w = DedupWindow(100)
    w.add_many(hash_ids(["old"]))
    got = duplicates(w, hash_ids(["b", "zz"]), hash_ids(["a", "old", "b", "a", "c", "new"]))
    assert got.tolist() == [False, True, True, True, False, False]
    assert duplicates(DedupWindow(0), np.zeros((0, 2), np.uint64), hash_ids(["a", "a"])).tolist() == [False, True]
