"""The two sides of a shared serving PS: :class:`PSModel` (the one writer) and :class:`SharedModel`
(what each uvicorn worker scores with), over :mod:`serving.shared_tables`.

``PSModel`` is the trainer's model (:class:`serving.model.TrainerModel`) whose tables' index and
rows live in shared memory: its :class:`serving.deltas.DeltaFeed` applies deltas exactly as a
single-process replica does (same code, so replicas still converge bit-identically), inside the
table's seqlock, and after every chunk it publishes the served versions, sample rates and dense
generation as the control file's JSON state. The versions ``/readyz`` reports are the PS's.

``SharedModel`` is a :class:`serving.model.TrainerModel` whose tables are read-only
:class:`serving.shared_tables.SharedShard` s. Before each request it compares one integer (the
state's sequence number) and only when it moved re-reads the state: versions, rates, a new dense
head (loaded whole, swapped by reference), or a new table layout after the PS bootstrapped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from proto import ParameterDelta
from serving.correction import SampleRates
from serving.deltas import publish_model_metrics
from serving.model import TrainerModel
from serving.request_features import Declared
from serving.shared_tables import Control, NotPublished, TablePublisher, attach_tables
from serving.versions import Bootstrap, DeltaRejected, VersionState

log = logging.getLogger(__name__)


def _dense_file(root: Path, gen: int) -> Path:
    return root / f"dense-{gen}.pt"


class PSModel(TrainerModel):
    """The serving PS's model: a :class:`TrainerModel` publishing its tables and state."""

    def __init__(self, model_name: str, root: Path, max_shards: int, state_bytes: int,
                 config: object | None = None) -> None:
        super().__init__(model_name, config)
        self.root = root
        self.publisher = TablePublisher(root, max_shards, state_bytes)
        self.layout_gen = 0
        self.dense_gen = 0
        #: whether the feed counts the model as loaded (set by the PS loop; workers' /readyz)
        self.loaded: Callable[[], bool] = lambda: False
        #: seconds the feed has been behind the delta topic (set by the PS loop; workers' /readyz)
        self.behind_s: Callable[[], float] = lambda: 0.0
        self._adopt()

    def _adopt(self) -> None:
        self.publisher.adopt(self.tables)
        self.layout_gen += 1
        self._publish_dense()

    def _publish_dense(self) -> None:
        self.dense_gen += 1
        path = _dense_file(self.root, self.dense_gen)
        tmp = path.with_suffix(".tmp")
        torch.save(self.scorer.head.state_dict(), tmp)
        tmp.rename(path)
        for old in self.root.glob("dense-*.pt"):  # keep the previous one for workers loading it
            if int(old.stem.split("-")[1]) < self.dense_gen - 1:
                old.unlink(missing_ok=True)

    def apply_delta(self, msg: ParameterDelta) -> str:
        if msg.WhichOneof("payload") == "sparse":
            with self.publisher.writing(msg.sparse.table):
                kind = super().apply_delta(msg)
        else:
            kind = super().apply_delta(msg)
            self._publish_dense()
        self.publish_state()
        return kind

    def bootstrap(self, root: Path | None) -> Bootstrap | None:
        boot = super().bootstrap(root)
        if boot is not None:
            self._adopt()
            self.publish_state()
        return boot

    def state(self) -> dict[str, Any]:
        n, states = self.sparse.layout()
        return {
            "model_id": self.model_id, "config": self.config.model_dump(mode="json"),  # type: ignore[attr-defined]
            "layout_gen": self.layout_gen, "tables": self.publisher.layout(),
            "shard_count": n, "sparse": [[s.version, s.published_ms] for s in states],
            "dense": [self.dense.version, self.dense.published_ms], "dense_gen": self.dense_gen,
            "sample_rates": self.sample_rates.as_dict(), "loaded": bool(self.loaded()),
            "behind_s": self.behind_s(), "published_at_ms": int(time.time() * 1000),
        }

    def publish_state(self) -> None:
        self.publisher.control.write_state(self.state())


class SharedModel(TrainerModel):
    """A worker's model: scores with the rows the serving PS publishes (read-only, no copy)."""

    def __init__(self, model_name: str, root: Path, max_shards: int, state_bytes: int,
                 config: object | None = None, ps_pid: int | None = None) -> None:
        super().__init__(model_name, config)
        #: the serving PS's pid (the parent that started this worker): gone means stop
        self.ps_pid = os.getppid() if ps_pid is None else ps_pid
        self.root, self.max_shards, self.state_bytes = root, max_shards, state_bytes
        self.control: Control | None = None
        self.loaded = False
        #: the PS's last state: its feed's lag, and when it was published (its heartbeat)
        self.ps_behind_s = 0.0
        self.state_at_ms: int | None = None
        self._seq = -1
        self._layout_gen = -1
        self._dense_gen = -1

    def refresh(self) -> None:
        """Follow the PS's state if it moved (one integer compare when it did not)."""
        if self.control is None:
            try:
                self.control = Control(self.root, self.max_shards, self.state_bytes, write=False)
            except NotPublished:
                return
        if self.control.state_seq == self._seq:
            return
        try:
            seq, state = self.control.read_state()
        except NotPublished:
            return
        if state["layout_gen"] != self._layout_gen:
            self._follow_layout(state)
        if state["dense_gen"] != self._dense_gen:
            try:
                dense = torch.load(_dense_file(self.root, state["dense_gen"]), weights_only=True)
            except FileNotFoundError:
                return  # replaced meanwhile: the next refresh sees the newer one
            self.scorer.load_dense(dense)
            self._dense_gen = state["dense_gen"]
        self.sparse.restore(state["shard_count"], {i: v for i, (v, _p) in enumerate(state["sparse"])})
        for i, (_v, published) in enumerate(state["sparse"]):
            self.sparse.shards[i].published_ms = published
        self.dense = VersionState(*state["dense"])
        self.sample_rates = SampleRates.from_mapping(state["sample_rates"]) if state["sample_rates"] else SampleRates()
        self.loaded = bool(state["loaded"])
        self.ps_behind_s = float(state["behind_s"])
        self.state_at_ms = int(state["published_at_ms"])
        self._seq = seq

    def _follow_layout(self, state: dict[str, Any]) -> None:
        from trainer.config import ModelConfig
        from trainer.inference import Scorer

        assert self.control is not None
        config = ModelConfig.model_validate(state["config"])
        configs = {t.name: t.serving() for t in config.tables}
        tables = attach_tables(self.root, self.control, state, configs)
        self.config, self.model_id = config, config.model_id
        self.scorer = Scorer(config, tables)
        self._layout_gen = state["layout_gen"]
        self._dense_gen = -1

    @property
    def declared(self) -> Declared:
        self.refresh()  # the PS's config, not the one this worker was started with
        return super().declared

    def score(self, user_slots, item_slots_list, dense=None):  # type: ignore[no-untyped-def]
        self.refresh()
        return super().score(user_slots, item_slots_list, dense)

    def apply_delta(self, msg: ParameterDelta) -> str:
        raise DeltaRejected("read_only", "a shared serving worker takes no deltas: the serving PS does")

    def bootstrap(self, root: Path | None) -> Bootstrap | None:
        self.refresh()
        return None

    def snapshot_epoch(self, root: Path | None) -> str | None:
        return None


class SharedFeed:
    """What a worker's app has in place of a :class:`serving.deltas.DeltaFeed`: the PS's state.

    It also watches the PS: a worker whose PS is gone (its parent changed) would serve frozen
    parameters forever, so it stops itself (SIGTERM: a clean stop that ships its spool) and the
    replica's supervisor restarts the whole replica."""

    def __init__(self, model: SharedModel, parent_poll_s: float = 1.0) -> None:
        self.model = model
        self.parent_poll_s = parent_poll_s
        self._parent = model.ps_pid
        self._task: asyncio.Task[None] | None = None
        self._shard_series: set[str] = set()

    @property
    def loaded(self) -> bool:
        self.model.refresh()
        return self.model.loaded

    def load_snapshot(self) -> None:
        self.model.refresh()

    def behind_s(self) -> float:
        """The PS's lag behind the delta topic, or the silence since its last state (a hung PS
        publishes none; it publishes every ``serving.ps_state_interval_s`` when idle)."""
        self.model.refresh()
        if self.model.state_at_ms is None:
            return 0.0
        silence = max(0.0, time.time() - self.model.state_at_ms / 1000)
        return max(self.model.ps_behind_s, silence)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch_parent(), name="serving-ps-watch")

    async def _watch_parent(self) -> None:
        while os.getppid() == self._parent:
            await asyncio.sleep(self.parent_poll_s)
        log.error("the serving PS (pid %d) is gone: stopping this worker", self._parent)
        os.kill(os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def publish_metrics(self) -> None:
        self.model.refresh()
        self._shard_series = publish_model_metrics(self.model, self._shard_series)
