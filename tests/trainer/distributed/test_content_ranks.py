"""The content encoder on the items' owners (trainer.dist.content), 2 gloo ranks: its gradients
(and so the whole model) equal 1 process on the global batch up to summation order, with the
owners adding its output to the item rows they send, with the owners sending it in an exchange of
its own, and with the raw content sent to the requesters; bytes through the all-to-all per
example, each way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.distributed.rank_local import refusals
from trainer.batch import SparseBatch, concat_batches
from trainer.config import ContentConfig, ModelConfig, deepfm_config
from trainer.dist.content import ContentStore
from trainer.dist.model import DistributedModel
from trainer.model import SparseModel

SLOT = "content"
#: examples per rank per step: an idle rank on step 1
SIZES = [(12, 12), (12, 0), (6, 12)]
ITEMS = 10


def _cfg() -> ModelConfig:
    cfg = deepfm_config(dim=4, mlp=[8], slots=("user_id", "genres", "item_id"), sequential=False,
                        recent_items=False)
    content = ContentConfig(slot=SLOT, item_slot="item_id", buckets=64, token_dim=4, hidden=[8])
    return ModelConfig.model_validate({**cfg.model_dump(), "content": content.model_dump()})


def _content() -> dict[int, list[int]]:
    rng = np.random.default_rng(3)
    # item 9 has no content: an empty bag
    return {i: rng.integers(0, 1 << 40, int(rng.integers(1, 6))).tolist() for i in range(ITEMS - 1)}


def _batch(step: int, rank: int, n: int) -> SparseBatch:
    rng = np.random.default_rng(100 * step + rank)
    content = _content()
    rows = []
    for _ in range(n):
        item = int(rng.integers(0, ITEMS))
        rows.append({"user_id": [int(rng.integers(0, 40))], "item_id": [item],
                     "genres": rng.integers(0, 5, int(rng.integers(0, 3))).tolist(), SLOT: content.get(item, [])})
    return SparseBatch.from_slot_dicts(rows, slots=_cfg().all_slots, labels=rng.integers(0, 2, n),
                                       event_time_ms=1_000 * step + rng.integers(0, 500, n))


def _grads(head) -> dict:
    return {k: p.grad.detach().numpy().copy() for k, p in head.named_parameters() if k.startswith("content.")}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for mode in ("row", "owners", "raw"):
        dm = DistributedModel(_cfg(), content=ContentStore(_content()), content_mode=mode)
        grads, probs = [], []
        for s, sizes in enumerate(SIZES):
            b = _batch(s, rank, sizes[rank])
            # (the batch's own content slot is not read: the owners read the store)
            b = SparseBatch(b.size, {k: v for k, v in b.ids.items() if k != SLOT},
                            {k: v for k, v in b.offsets.items() if k != SLOT}, b.labels, b.event_time_ms)
            probs.append(dm.train_step(b)[1])
            grads.append(_grads(dm.head))
        out[mode] = {"grads": grads, "probs": probs, "head": {k: v.detach().numpy().copy()
                                                              for k, v in dm.head.state_dict().items()},
                     "bytes": dm._content.bytes, "examples": dm._content.examples,
                     "engine": dm.alltoall_bytes}
        dm.close()
    return out


def _reference() -> tuple[list[dict], list[np.ndarray], dict]:
    torch.set_num_threads(1)
    m = SparseModel(_cfg())
    grads, probs = [], []
    for s, sizes in enumerate(SIZES):
        b = concat_batches([_batch(s, r, n) for r, n in enumerate(sizes) if n])
        probs.append(m.train_step(b)[1])
        grads.append(_grads(m.head))
    return grads, probs, {k: v.detach().numpy() for k, v in m.head.state_dict().items()}


def test_encoder_gradients_equal_one_process_and_bytes_per_example(rank_pool):
    res = rank_pool.run(_worker, timeout_s=60)
    ref_grads, ref_probs, ref_head = _reference()
    for mode in ("row", "owners", "raw"):
        for s in range(len(SIZES)):
            got = np.concatenate([r[mode]["probs"][s] for r in res])
            np.testing.assert_allclose(got, ref_probs[s], rtol=1e-5, atol=1e-7)
            for r in res:  # the summed gradients every replica stepped with
                for k, v in ref_grads[s].items():
                    np.testing.assert_allclose(r[mode]["grads"][s][k], v, rtol=1e-4, atol=1e-7,
                                               err_msg=f"{mode} step {s} {k}")
        for r in res:
            for k, v in ref_head.items():
                np.testing.assert_allclose(r[mode]["head"][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{mode} {k}")
    per = {mode: sum(r[mode]["bytes"] for r in res) / sum(r[mode]["examples"] for r in res) for mode in res[0]}
    engine = {mode: sum(r[mode]["engine"] for r in res) for mode in res[0]}
    print(f"content all-to-all bytes per example: row {per['row']:.1f}, owners {per['owners']:.1f}, "
          f"raw {per['raw']:.1f}")
    assert per["owners"] > 0 and per["raw"] > 0
    # in the rows: nothing of its own, and the engine's rows and gradients are what they are without it
    assert per["row"] == 0 and engine["row"] == engine["owners"] == engine["raw"]


def _failing(rank: int, world: int, mode: str) -> list[str]:
    from trainer.dist.model import RankStepError

    dm = DistributedModel(_cfg(), content=ContentStore(_content()), content_mode=mode)
    out = []
    for s in range(3):
        b = _batch(s, rank, 8)
        if s == 1 and rank == 1:  # an example without its item: this rank fails before the exchange
            b = b.select(np.arange(8))
            b.offsets["item_id"] = np.r_[0, np.arange(0, 7)].astype(np.int64)
            b.ids["item_id"] = b.ids["item_id"][:7]
        try:
            dm.train_step(b)
            out.append("ok")
        except RankStepError as err:
            out.append(f"failed {err.failed}")
    dm.close()
    return out


@pytest.mark.parametrize("mode", ["row", "owners"])
def test_a_rank_failing_before_the_exchange_fails_the_step_on_every_rank_without_hanging(mode, rank_pool):
    res = rank_pool.run(_failing, mode, timeout_s=30)
    assert res == [["ok", "failed [1]", "ok"]] * 2


def _encoder_fails_on_owner_1(rank: int, world: int) -> list[str]:
    from trainer.dist.model import RankStepError

    dm = DistributedModel(_cfg(), content=ContentStore(_content()))
    if rank == 1:  # the owner's encoder raises on its second lookup
        calls, add = [0], dm._content.add_to_rows

        def failing(*a, **k):
            calls[0] += 1
            if calls[0] == 2:
                raise MemoryError("the encoder on rank 1")
            return add(*a, **k)

        dm._content.add_to_rows = failing
    out = []
    for s in range(3):
        try:
            dm.train_step(_batch(s, rank, 8))
            out.append("ok")
        except RankStepError as err:
            out.append(f"failed {err.failed}")
    dm.close()
    return out


def test_an_owner_whose_encoder_raises_names_the_requesters_and_nothing_hangs(rank_pool):
    res = rank_pool.run(_encoder_fails_on_owner_1, timeout_s=30)
    # both ranks asked rank 1 for items in step 1: both are named, and the next step goes on
    assert res == [["ok", "failed [0, 1]", "ok"]] * 2


def _refused(rank: int, world: int) -> list[str]:
    shared = _cfg().model_copy(update={"slots": {**_cfg().slots, "other_item": _cfg().slots["item_id"]}})
    return refusals(lambda cfg=cfg, mode=mode: DistributedModel(cfg, mode=mode, content=ContentStore(_content()))
                    for cfg, mode in ((_cfg(), "hybrid"), (shared, "sync")))


def test_row_content_is_refused_in_hybrid_and_for_a_shared_item_table(rank_pool):
    res = rank_pool.run(_refused, timeout_s=30)
    assert "trains in sync" in res[0][0] and "is read by" in res[0][1]
