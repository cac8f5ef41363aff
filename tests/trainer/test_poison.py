"""Examples that decode and still must not be learned, or make the training step (or decoding) fail:
dead-lettered with the reason, counted, and training goes on past them (no crash loop)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from proto import DeadLetter, Example
from services import example_batch
from trainer import snapshots
from trainer.batch import SparseBatch
from trainer.config import ModelConfig, deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.isolate import train_isolating
from trainer.model import NonFiniteStepError, SparseModel
from trainer.online import OnlineTrainer

from .test_online import read_topic

N = 3_000
HUGE = 3e38  # a finite float32: the decoder accepts it


def dense_cfg() -> ModelConfig:
    """Raw dense inputs (``dense_scaling = "none"``): a scaled ``x`` could not overflow the logit."""
    return ModelConfig.model_validate({**deepfm_config(dim=8, mlp=[32]).model_dump(), "dense_features": ["x"],
                                       "dense_scaling": "none"})


def _overflowing(model: SparseModel) -> None:
    """A dense weight above 1: ``x = HUGE`` then overflows the logit to inf (a state training could
    reach; the other examples' ``x = 0`` never move the weight)."""
    with torch.no_grad():
        model.head.dense_linear.weight.fill_(2.0)


def test_a_failing_step_changes_nothing_and_its_record_is_isolated():
    cfg = dense_cfg()
    model = SparseModel(cfg)
    _overflowing(model)
    n = 16
    rows = [{s: [i + 1] for s in cfg.all_slots} for i in range(n)]
    dense = np.zeros((n, 1), np.float32)
    dense[5, 0] = HUGE
    batch = SparseBatch.from_slot_dicts(rows, dense, slots=cfg.all_slots, labels=[1.0] + [0.0] * (n - 1),
                                         event_time_ms=[1] * n)
    model.train_step(batch.select(np.arange(4)))  # some rows exist before (and the bias started)
    head = {k: v.clone() for k, v in model.head.state_dict().items()}
    tables = {name: t.items()[:2] for name, t in model.tables.items()}
    with pytest.raises(NonFiniteStepError):
        model.train_step(batch)
    assert all(torch.equal(v, model.head.state_dict()[k]) for k, v in head.items())
    for name, (keys, values) in tables.items():  # rows the failed step read are unchanged
        k, v, _, _ = model.tables[name].items()
        got = dict(zip(k.tolist(), map(tuple, v.tolist())))
        assert all(got[key] == tuple(val) for key, val in zip(keys.tolist(), values.tolist())), name
    res = train_isolating(model.train_step, batch)
    assert [row for row, _ in res.failed] == [5] and isinstance(res.failed[0][1], NonFiniteStepError)
    assert res.applied.tolist() == [r for r in range(n) if r != 5] and res.probs.size == n - 1
    assert not torch.equal(model.head.bias, head["bias"])  # the others were learned


async def test_poison_records_are_dead_lettered_and_training_goes_on(settings):
    cfg = dense_cfg()
    examples = MovieLensData(limit=N).examples()
    for e in examples:
        e.features.dense["x"] = 0.0
    now = int(time.time() * 1000)

    def poison(i: int) -> Example:
        e = Example.FromString(examples[i].SerializeToString())
        e.example_id = f"poison/{i}"
        e.labels["click"] = 0.0
        return e

    overflow, future, label, undecodable = poison(100), poison(200), poison(300), poison(400)
    overflow.features.dense["x"] = HUGE  # the step's loss overflows: it fails in training
    future.event_time_ms = 2**63 - 1  # would move the trainer's event-time clock for good
    label.labels["click"] = 5.0  # not a log-loss target
    records = await produce_examples(settings, examples[:1000] + [overflow, future] + examples[1000:2000] + [label]
                                     + examples[2000:2500])
    # a record of its own that decoding fails on (not BadExampleBatch: a bug): dead-lettered whole
    records += await produce_examples(settings, [undecodable])
    records += await produce_examples(settings, examples[2500:])
    undecodable_raw = example_batch.encode(example_batch.from_examples([undecodable]))
    tr = OnlineTrainer(settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=3600, batch_size=256)), cfg)
    _overflowing(tr.model)
    decode = tr.ingest.decode

    def failing_decode(raw):  # stands in for a decoder bug that one record's bytes reach
        if b"poison/400" in bytes(raw):
            raise IndexError("a decoder bug")
        return decode(raw)

    tr.ingest.decode = failing_decode
    res = await asyncio.wait_for(tr.run(stop_when_idle_s=2.0), 120)

    assert res["examples_applied"] == N and res["bad"] == 4 and tr.ingest.bad == 4, res
    letters: dict[str, list[DeadLetter]] = {}
    for v in await read_topic(settings, settings.topics.dead_letters, timeout_s=1.0):
        letter = DeadLetter.FromString(v)
        letters.setdefault(letter.reason.split(":")[0], []).append(letter)
    assert sorted(letters) == ["bad_label", "event_time", "failed"], letters

    def ids(letter: DeadLetter) -> list[str]:  # a refused example's letter: a batch of that example
        return [e.example_id for e in example_batch.to_examples(example_batch.decode(letter.value))]

    failed = {letter.value: letter.reason for letter in letters["failed"]}
    assert failed[undecodable_raw] == "failed: IndexError: a decoder bug"  # in decoding: the whole record
    [in_step] = [letter for letter in letters["failed"] if letter.value != undecodable_raw]
    assert ids(in_step) == ["poison/100"] and "NonFiniteStepError" in in_step.reason  # in the training step
    assert [ids(letter) for letter in letters["event_time"]] == [["poison/200"]]
    assert [ids(letter) for letter in letters["bad_label"]] == [["poison/300"]]
    assert tr.max_event_time < now  # the event-time clock did not jump
    man = snapshots.read_manifest(tr.snapshot_root)
    assert man["examples_applied"] == N and sum(man["offsets"].values()) == records  # moved past them
    assert man["next_snapshot_at"] < now  # periodic snapshots still come due


async def test_the_publisher_refuses_non_finite_parameters(tmp_path) -> None:
    """A NaN in the head (a bug: the step refuses non-finite gradients) is never published: nothing
    is sent, the version does not move, the refusal is counted; serving keeps its model. (The PS
    refuses non-finite rows itself; ``encode_sparse`` refuses them too: its doctest.)"""
    from services.settings import Settings
    from trainer import metrics as M
    from trainer.publisher import Publisher

    publisher = Publisher(Settings(var_dir=tmp_path), "m", lambda _stage, _s: None)  # no producer: nothing can be sent
    before = M.NON_FINITE_DELTAS.labels("m", "dense")._value.get()
    head = torch.nn.Linear(2, 1)
    with torch.no_grad():
        head.bias.fill_(float("nan"))
    await publisher.sync_dense(head, 0, {"global": 1.0, "slices": {}})
    assert publisher.dense_version == 0
    assert M.NON_FINITE_DELTAS.labels("m", "dense")._value.get() == before + 1


async def test_a_trainer_out_of_memory_in_decoding_stops_and_its_restart_learns_everything(settings):
    """Every record of a poll running out of memory while decoding is the process starved, not
    the records: the trainer stops (nothing dead-lettered, nothing committed) and its restart
    learns them all. (One record alone out of memory, among others that decode, is dead-lettered:
    the step's rule, trainer.isolate.)"""
    cfg = dense_cfg()
    examples = MovieLensData(limit=600).examples()
    for e in examples:
        e.features.dense["x"] = 0.0
    await produce_examples(settings, examples)
    s = settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=3600, batch_size=256))
    starved = OnlineTrainer(s, cfg)

    def no_memory(raw):
        raise MemoryError("starved")

    starved.ingest.decode = no_memory
    with pytest.raises(MemoryError):
        await asyncio.wait_for(starved.run(stop_when_idle_s=2.0), 120)
    assert starved.ingest.bad == 0
    res = await asyncio.wait_for(OnlineTrainer(s, cfg).run(stop_when_idle_s=2.0), 120)
    assert res["examples_applied"] == 600 and res["bad"] == 0, res
    assert await read_topic(settings, settings.topics.dead_letters, timeout_s=1.0) == []
