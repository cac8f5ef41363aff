"""The content encoder (trainer.content): configuration, learning in the plain and the sequential
DeepFM, and its parameters in the head's state."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch

from movielens.features import ITEM_CONTENT
from trainer.batch import SparseBatch
from trainer.config import SPARSE_ACC, ContentConfig, ModelConfig, deepfm_config
from trainer.data import MovieLensData
from trainer.model import SparseModel

CONTENT = ContentConfig(slot=ITEM_CONTENT, item_slot="item_id", buckets=256, token_dim=4, hidden=[8])


@pytest.fixture(scope="module")
def ml() -> MovieLensData:
    return MovieLensData(limit=5_000, content=True)


def _cfg(sequential: bool, join: str = "field") -> ModelConfig:
    # one embedding accumulator for both engines (deepfm_config's default differs: SPARSE_ACC)
    cfg = deepfm_config(dim=4, mlp=[8], sequential=sequential, recent_items=False, acc=SPARSE_ACC)
    return ModelConfig.model_validate({**cfg.model_dump(), "content": {**CONTENT.model_dump(), "join": join}})


def test_content_config_is_checked():
    base = deepfm_config(dim=4, mlp=[8], recent_items=False).model_dump()
    with pytest.raises(pydantic.ValidationError, match="not a field of its own"):
        ModelConfig.model_validate({**base, "content": {"slot": "genres", "item_slot": "item_id"}})
    with pytest.raises(pydantic.ValidationError, match="not an embedding slot"):
        ModelConfig.model_validate({**base, "content": {"slot": "c", "item_slot": "nope"}})
    cfg = _cfg(False)
    assert ITEM_CONTENT in cfg.all_slots and ITEM_CONTENT not in cfg.slots
    assert ModelConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_items_carry_their_title_and_genre_tokens(ml):
    b = ml.batch(np.arange(3))
    for e in range(3):
        toks = b.ids[ITEM_CONTENT][b.offsets[ITEM_CONTENT][e]:b.offsets[ITEM_CONTENT][e + 1]]
        genres = b.ids["genres"][b.offsets["genres"][e]:b.offsets["genres"][e + 1]]
        assert set(genres) <= set(toks) and len(toks) > len(genres)  # the genres, and title words


def test_plain_deepfm_learns_the_encoder_and_keeps_it_in_the_head(ml):
    m = SparseModel(_cfg(False))
    before = {k: v.clone() for k, v in m.head.state_dict().items() if k.startswith("content.")}
    assert before and m.head.mlp[0].in_features == (len(m.cfg.slots) + 1) * 4
    for b in ml.batches(256, np.arange(1024)):
        loss, _ = m.train_step(b)
        assert np.isfinite(loss)
    after = m.head.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert not any(k.startswith("content.") for k in SparseModel(deepfm_config(dim=4, mlp=[8])).head.state_dict())


def test_the_encoders_own_rate_set_or_unset_since_a_snapshot_restores_every_moment(ml):
    """``content.lr`` puts the encoder in a group of its own: a restart after it was set (or unset)
    in the project file brings back every parameter's Adam state at the new grouping and rates
    (torch's ``load_state_dict`` refused the other number of groups: a restore that failed at
    every restart)."""
    own = _cfg(False).model_copy(update={"content": _cfg(False).content.model_copy(update={"lr": 0.003})})
    for before, after in ((_cfg(False), own), (own, _cfg(False))):
        m = SparseModel(before)
        for b in ml.batches(256, np.arange(512)):
            m.train_step(b)
        r = SparseModel(after)
        r.load_dense_state(m.dense_state())
        assert len(r.optimizer.param_groups) == 2 + (after.content.lr is not None)  # (the factors: the last)
        assert r.optimizer.param_groups[0]["lr"] == after.dense_lr
        saved = {n: m.optimizer.state[p] for n, p in m.head.named_parameters()}
        for n, p in r.head.named_parameters():
            for k, v in saved[n].items():
                assert torch.equal(r.optimizer.state[p][k], v), (n, k)
        r.train_step(ml.batch(np.arange(512, 768)))


@pytest.mark.parametrize("join", ["field", "item"])
def test_sequential_deepfm_at_batch_one_equals_plain_deepfm_with_content(ml, join):
    """At batch 1 the content's batch-start FM terms and slopes are exact: the sequential DeepFM
    equals the plain one, encoder included, up to float summation order."""
    rows = np.arange(150)
    plain, seq = SparseModel(_cfg(False, join)), SparseModel(_cfg(True, join))
    p_plain = np.concatenate([plain.train_step(b)[1] for b in ml.batches(1, rows)])
    p_seq = np.concatenate([seq.train_step(b)[1] for b in ml.batches(1, rows)])
    np.testing.assert_allclose(p_seq, p_plain, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(seq.head.named_parameters(), plain.head.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-3, atol=1e-5, err_msg=name)
    for name, table in plain.tables.items():
        for a, b in zip(seq.tables[name].items(), table.items()):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5, err_msg=name)


def test_missing_content_scores_as_an_empty_bag(ml):
    m = SparseModel(_cfg(True))
    m.train_step(ml.batch(np.arange(64)))
    rows = [{"user_id": [1], "item_id": [5]}, {"user_id": [1], "item_id": [5], ITEM_CONTENT: []}]
    p = m.predict(SparseBatch.from_slot_dicts(rows[:1], slots=["user_id", "item_id"]))
    q = m.predict(SparseBatch.from_slot_dicts(rows[1:], slots=m.cfg.all_slots))
    assert p[0] == pytest.approx(q[0])


def test_content_store_reads_items_bags_in_the_asked_order():
    from trainer.dist.content import ContentStore

    store = ContentStore({7: [1, 2], 3: [5], 9: []})
    tokens, offsets = store.bags(np.array([9, 7, 4, 3, 7]))
    assert tokens.tolist() == [1, 2, 5, 1, 2] and offsets.tolist() == [0, 0, 2, 2, 3, 5]
    tokens, offsets = ContentStore({}).bags(np.array([1]))
    assert tokens.size == 0 and offsets.tolist() == [0, 0]


def test_a_dense_delta_carries_the_encoder_and_serving_scores_as_the_trainer(ml):
    """The encoder is dense state: a dense delta brings it to a serving model, which scores a
    request's candidates from their content (merged rows) as the trainer does."""
    from serving.model import TrainerModel
    from trainer.sync import decode_dense, encode_dense

    cfg = _cfg(True, "item")
    m = SparseModel(cfg)
    for b in ml.batches(256, np.arange(512)):
        m.train_step(b)
    state = decode_dense(encode_dense(cfg.model_id, 1, m.head))
    assert any(k.startswith("content.") for k in state)
    served = TrainerModel(config=cfg)
    served.scorer.tables.update(m.tables)
    served.scorer.load_dense(state)
    user = {"user_id": [int(ml.user_id[0])]}
    items = [{"item_id": [int(i)], ITEM_CONTENT: ml.features.item_content(int(i))} for i in ml.item_id[:5]]
    want = m.predict(SparseBatch.from_slot_dicts([{**user, **it} for it in items], slots=cfg.all_slots))
    np.testing.assert_allclose(served.score(user, items), want, rtol=1e-5, atol=1e-7)


def test_the_demo_loads_the_items_content_into_redis_and_batch_training_reads_it(tmp_path, redis_url, repo_root):
    """The MovieLens demo with an encoder (the items' content declared and read by ``[model]
    content``): ``features load --movielens`` puts each item's content into Redis (what serving
    scores and logs it from) and ``trainer batch --movielens`` (the warm start) trains the encoder
    on it: the tokens of the items it saw moved from their initial values."""
    import asyncio
    import os
    import subprocess
    import sys

    from driftline.project import named_config
    from movielens.data import load
    from movielens.features import MovieLensFeatures
    from serving.feature_files import main as features
    from serving.feature_store import FeatureStore
    from trainer import snapshots

    text = (repo_root / "examples" / "movielens" / "driftline.toml").read_text()
    text = text.replace("[tables.default]", f'[[features]]\nname = "{ITEM_CONTENT}"\nsource = "item"\n\n[tables.default]')
    text = text.replace("[model]\n", f'[model]\ncontent = {{ slot = "{ITEM_CONTENT}", item_slot = "item_id" }}\n')
    project = tmp_path / "driftline.toml"
    project.write_text(text)
    data = repo_root / "var" / "data"
    assert features(["load", "--movielens", "--config", str(project), "--dataset", "ml-100k", "--data-dir", str(data),
                     "--redis-url", redis_url, "--prefix", "content"]) == 0
    ml = load("ml-100k", data)
    feats = MovieLensFeatures(ml.users, ml.items)

    async def fetch():
        store = FeatureStore(redis_url, "content")
        try:
            return await store.fetch(1, [1, 50])
        finally:
            await store.close()

    got = asyncio.run(fetch())
    assert [i[ITEM_CONTENT] for i in got.items] == [feats.item_content(1), feats.item_content(50)]
    assert all(len(i[ITEM_CONTENT]) > 1 for i in got.items)

    env = dict(os.environ, DRIFTLINE_VAR_DIR=str(tmp_path / "var"), DRIFTLINE_METRICS_PORT="0")
    out = subprocess.run([sys.executable, "-m", "trainer", "batch", "--movielens", "--model", str(project),
                          "--dataset", "ml-100k", "--data-dir", str(data), "--limit", "3000", "--snapshot", "--quiet"],
                         env=env, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = named_config(str(project))
    _, dense, _ = snapshots.load(tmp_path / "var" / "snapshots" / cfg.model_id, cfg, serving=False)
    learned = dense["head"]["content.tokens.weight"].numpy()
    initial = SparseModel(cfg).head.state_dict()["content.tokens.weight"].numpy()
    seen = np.unique(np.concatenate([feats.item_content(int(i)) for i in np.unique(ml.ratings["item_id"].to_numpy()[:3000])]))
    rows = np.unique(seen % cfg.content.buckets)
    assert not np.allclose(learned[rows], initial[rows])
