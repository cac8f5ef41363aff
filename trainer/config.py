"""Models declared as typed data, not code.

A model reads sparse *slots* (named bags of int64 ids, see :mod:`movielens.features`).
Each slot maps to a PS table that holds its embeddings; several slots may share one table (their
ids are then salted per slot so equal ids of different slots do not collide, unless ``salt`` says
otherwise for a slot: unsalted slots of one table read the same row for the same id, e.g. the
real-time ``recent_items`` slot and ``item_id``). ``slots`` are the
embedding fields (FM / MLP input, all of one ``dim`` for DeepFM); ``linear`` are first-order
fields read from ``dim == 1`` tables. ``kind`` picks the dense head:

* ``deepfm``: bias + sum(linear) + FM(second order over the fields) + MLP(concat(fields)).
* ``lr``: bias + sum(linear) (+ dense features): logistic regression / "wide".

``sequential`` makes ``train_step`` learn the first-order (linear) weights of a mini-batch example
by example (:mod:`ps.sequential`): each example is scored, then its first-order weights are
stepped before the next example is scored, as River's ``learn_one`` does; bias and dense weights
still take one step per batch (:mod:`trainer.sequential`). For an LR that is batch 1's result at
batch speed. ``sequential_embeddings`` does the same for a DeepFM's embedding rows
(:mod:`ps.sequential_fm`): its sparse part is then as fresh as batch 1's, only the dense head
steps once per batch.

>>> cfg = deepfm_config(); cfg.kind, len(cfg.slots), cfg.mlp, cfg.sequential, cfg.sequential_embeddings
('deepfm', 9, [32, 16], True, True)
>>> cfg.slots["recent_items"], cfg.pooling["recent_items"], cfg.salts()[("item_id", "recent_items")]
('item_id', 'mean', 0)
>>> ModelConfig.model_validate_json(cfg.model_dump_json()) == cfg
True
>>> len(deepfm_config(recent_items=False).slots)  # the issue's 8-slot model
8
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ps import AdagradConfig, InitializerConfig, TableConfig

#: the served model's sparse Adagrad rates (``driftline eval tune`` chose them on ml-1m's tuning
#: stream; docs/results.md section 4): embeddings, and first-order weights (a larger step: each is
#: one number, and ``sequential`` steps it example by example). A project's tables default to them.
SPARSE_LR, LINEAR_LR = 0.05, 0.3
#: Adagrad's initial accumulator of the served model's embeddings. At 0 Adagrad is blind to a
#: gradient's size until a row has a history: a new row's first steps move every coordinate by the
#: whole rate, so where clicks are rare the non-clicks (gradients ~1/300 of a click's) shake the
#: new rows as hard as clicks do. This floor is a gradient's scale here (an example's ``(p - y) *
#: v``, ``v`` the other fields' ~0.01-0.1 embeddings). ``make bench-worlds``' 0.4% clicks, second
#: half of 400,000 impressions (with the head's bias started before the first batch is scored):
#: 0.7279 at 0, 0.7346 at 1e-5, 0.7438 at 1e-4, 0.7448 at 1e-3; ml-1m's tuning stream 0.7880 /
#: 0.7882 at 0 and 0.7880 / 0.7880 at 1e-3 (seeds 0 and 1): nothing lost where clicks are common.
#: Only for embeddings that learn example by example (``sequential_embeddings``): a mini-batch
#: step's gradient is the batch's mean, ~1/batch of an example's, and this floor would stall it
#: (``make bench-gba``'s plain DeepFM: holdout AUC 0.54 against 0.69).
SPARSE_ACC = 1e-3
#: Adagrad's initial accumulator of the served model's first-order weights. At 0 a new id's first
#: step moves its weight by the whole rate whatever its gradient (Adagrad normalises it): a new
#: user's next scores swing. Chosen on ml-1m's tuning stream by its AUC (0, 0.3, 1, 3; seeds 0
#: and 1: 0.7875/0.7871 at 0, 0.7878/0.7875 at 0.3), where it also lifts new users' first 10
#: examples from 0.7279/0.7278 to 0.7356/0.7332 (driftline eval coldstart: docs/results.md section 5)
LINEAR_ACC = 0.3
#: the served model's rate for the learned factor on each first-order field
#: (:attr:`ModelConfig.linear_scale_lr`). Chosen on ``make bench-worlds`` (3 seeds, 8 worlds; 0.003,
#: 0.01, 0.03): 0.003 recovers only two thirds of what a feature that says nothing costs, 0.01 and
#: 0.03 all of it, neither below the model without factors in any world. The price is after a
#: change of every item's appeal at once (``make bench-drift``: the first 60,000 impressions after
#: it 0.6028 / 0.5967 / 0.5855 at 0.003 / 0.01 / 0.03 against 0.6059 without): a higher rate
#: lowers the item field's factor faster there. Not for the LR (:func:`lr_config`): there the
#: first-order terms are the whole model, and the factors cost it 0.0005 on ml-1m and 0.0012 on
#: ml-100k (the eval's sequential LR, seed 0).
LINEAR_SCALE_LR = 0.01
#: the served model's size: the best validation AUC among the sequential DeepFMs 1.1x as fast as the
#: plain DeepFM at batch 1024 (docs/results.md, "How settings were chosen"); dim 16 with MLP 128-64
#: learns a little better (+0.002 AUC) at two thirds of that speed
SERVED_DIM, SERVED_MLP = 8, (32, 16)

MOVIELENS_SLOTS = ("user_id", "gender", "age", "occupation", "zip", "item_id", "genres", "year")
#: the real-time slot serving adds to its FeatureLogs after a user's first click: the user's last
#: clicked item ids (Redis), absent from historical data (an empty bag pools to a zero vector)
RECENT_ITEMS = "recent_items"


class MetaConfig(BaseModel):
    """Meta-learned starting points for new ids of one *task* slot (``ModelConfig.meta``,
    :mod:`trainer.meta`): a task is one id of ``task_slot`` (a user, a campaign), its first
    ``support`` examples the inner loop's, its next ``query`` ones the outer loop's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_slot: str
    support: int = Field(5, ge=1)
    query: int = Field(5, ge=1)
    #: tasks waiting to fill, at most (the oldest is dropped, unfilled, past it): the buffer's bound
    max_open_tasks: int = Field(100_000, ge=1)
    #: filled tasks per outer step. An outer step costs two forward/backward passes whatever its
    #: size: on ml-1m's coldstart stream 16 tasks a step (Adam 0.05) ran at 0.55x the served
    #: model's examples/s, 64 (Adam 0.2) at 0.70x, new users' first 10 examples +0.0026 and +0.0031
    tasks_per_step: int = Field(64, ge=1)
    #: Adam's rate for the starting point (the log of each Adagrad table's starting accumulator)
    outer_lr: float = Field(0.2, gt=0)


class ContentConfig(BaseModel):
    """A content encoder (``ModelConfig.content``, :mod:`trainer.content`): each example's item
    carries its content in ``slot`` (a bag of token ids: title words, genres, ...); a small shared
    encoder (token embeddings, mean-pooled, then an MLP) turns it into one more embedding field.
    ``item_slot`` names the slot whose id the content describes (the N-rank engine routes by it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slot: str
    item_slot: str
    #: token ids are taken modulo this many rows of the encoder's token table (dense parameters:
    #: every snapshot and dense delta carries buckets x token_dim floats)
    buckets: int = Field(1 << 14, ge=1)
    token_dim: int = Field(16, ge=1)
    #: the encoder MLP's hidden widths (its output is the model's embedding dim); none: one linear
    #: map of the mean token embedding (measured at least as good on ml-1m's cold items as [32]:
    #: trainer/content.py)
    hidden: list[int] = Field(default_factory=list)
    #: the encoder's rate in the dense optimizer (None: ``ModelConfig.dense_lr``, the head's)
    lr: float | None = Field(None, gt=0)
    #: how the output joins the model: ``item``, added to ``item_slot``'s field (the item's row
    #: plus its content's vector); ``field``, one more embedding field (measured: trainer/content.py)
    join: Literal["field", "item"] = "item"


class ModelConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    kind: Literal["deepfm", "lr"] = "deepfm"
    #: embedding fields: slot -> table name
    slots: dict[str, str] = Field(default_factory=dict)
    #: first-order fields: slot -> table name (tables of dim 1)
    linear: dict[str, str] = Field(default_factory=dict)
    tables: list[TableConfig]
    #: per-slot pooling of multi-valued slots (embedding-bag semantics); default "sum"
    pooling: dict[str, Literal["sum", "mean"]] = Field(default_factory=dict)
    #: per slot: salt its ids when its table is shared with other slots (default True). Slots with
    #: False read a shared table with their raw ids, so equal ids of such slots share a row.
    salt: dict[str, bool] = Field(default_factory=dict)
    #: names of dense (float) features, in input order; an example missing one is rejected
    dense_features: list[str] = Field(default_factory=list)
    #: how dense features are put on one scale before the head (:mod:`trainer.dense_scaling`):
    #: ``log``: signed log1p, then standardized by running statistics; ``standard``: standardized
    #: only; ``none``: as they come
    dense_scaling: Literal["log", "standard", "none"] = "log"
    mlp: list[int] = Field(default_factory=lambda: list(SERVED_MLP))
    dense_optimizer: Literal["adam", "adagrad", "sgd"] = "adam"
    dense_lr: float = Field(1e-3, gt=0)
    #: each first-order field's pooled sum times a learned factor (starting at 1), at this rate in
    #: the dense optimizer (:attr:`trainer.head.DenseHead.linear_scale`); None: no factors (the
    #: served model's: :data:`LINEAR_SCALE_LR`)
    linear_scale_lr: float | None = Field(None, gt=0)
    label: str = "click"
    seed: int = 0
    #: per-example updates of the first-order (linear) weights inside each mini-batch; embedding
    #: fields and the dense head still take one step per batch (:mod:`trainer.sequential`)
    sequential: bool = False
    #: with ``sequential``, a DeepFM's embedding rows learn example by example too: the FM term
    #: from fresh rows, the MLP's slope taken at the batch's start (:mod:`ps.sequential_fm`); only
    #: the dense head steps once per batch. Every sparse table then needs SGD or Adagrad.
    sequential_embeddings: bool = False
    #: meta-learned starting points for new ids of a task slot (:mod:`trainer.meta`); None: off
    meta: MetaConfig | None = None
    #: a content encoder whose output joins the embedding fields (:mod:`trainer.content`); None: off
    content: ContentConfig | None = None
    #: the slot that holds each example's display position (0 = first): serving scores every
    #: candidate at position 0 and logs the place it answered each at, unless the request gives
    #: one (:mod:`serving.positions`); None: the model reads no position
    position_slot: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        names = {t.name for t in self.tables}
        if len(names) != len(self.tables):
            raise ValueError("duplicate table names")
        for field, mapping in (("slots", self.slots), ("linear", self.linear)):
            for slot, table in mapping.items():
                if table not in names:
                    raise ValueError(f"{field}[{slot!r}] -> unknown table {table!r}")
        dims = {self.table(t).dim for t in self.slots.values()}
        if self.kind == "deepfm" and len(dims) > 1:
            raise ValueError(f"deepfm fields need one embedding dim, got {sorted(dims)}")
        for slot, table in self.linear.items():
            if self.table(table).dim != 1:
                raise ValueError(f"linear[{slot!r}] -> table {table!r} must have dim 1")
        unknown = set(self.salt) - set(self.slots) - set(self.linear)
        if unknown:
            raise ValueError(f"salt: unknown slots {sorted(unknown)}")
        if self.kind == "deepfm" and not self.slots:
            raise ValueError("deepfm needs at least one embedding slot")
        if not self.slots and not self.linear and not self.dense_features:
            raise ValueError("model reads no input")
        if self.sequential and not self.linear:
            raise ValueError("sequential needs first-order (linear) fields: they are what it learns example by example")
        if self.sequential_embeddings:
            if not self.sequential or self.kind != "deepfm":
                raise ValueError("sequential_embeddings needs a sequential deepfm")
            for t in {*self.slots.values(), *self.linear.values()}:
                optimizer = self.table(t).optimizer  # (None: a serving replica's table, which learns nothing)
                kind = None if optimizer is None else optimizer.kind
                if kind not in ("sgd", "adagrad"):
                    raise ValueError(f"sequential_embeddings: table {t!r} must use sgd or adagrad, not "
                                     f"{kind} (or set sequential_embeddings = false)")
        if self.meta is not None:
            self._check_meta(self.meta)
        if self.content is not None:
            self._check_content(self.content)
        if self.position_slot is not None and self.position_slot not in (*self.slots, *self.linear):
            raise ValueError(f"position_slot {self.position_slot!r} is not a slot of the model")
        return self

    def _check_content(self, content: ContentConfig) -> None:
        if self.kind != "deepfm":
            raise ValueError("content: the encoder's output is an embedding field: it needs a deepfm")
        if content.slot in self.slots or content.slot in self.linear:
            raise ValueError(f"content.slot {content.slot!r} is the encoder's input, not a field of its own")
        if content.item_slot not in self.slots:
            raise ValueError(f"content.item_slot {content.item_slot!r} is not an embedding slot of the model")

    def _check_meta(self, meta: MetaConfig) -> None:
        tables = self.task_tables(meta.task_slot)
        if not tables:
            raise ValueError(f"meta.task_slot {meta.task_slot!r} is not a slot of the model")
        for t in tables:
            optimizer = self.table(t).optimizer
            if optimizer is not None and optimizer.kind not in ("sgd", "adagrad"):
                raise ValueError(f"meta: table {t!r} of the task slot must use sgd or adagrad, not {optimizer.kind}")

    def task_tables(self, slot: str) -> list[str]:
        """The tables ``slot`` reads: its embedding table, then its first-order table (each if any)."""
        return [m[slot] for m in (self.slots, self.linear) if slot in m]

    def table(self, name: str) -> TableConfig:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def all_slots(self) -> list[str]:
        """Every slot the model reads, sorted (the batch layout): the content slot too."""
        return sorted(set(self.slots) | set(self.linear) | ({self.content.slot} if self.content else set()))

    @property
    def embed_dim(self) -> int:
        return self.table(next(iter(self.slots.values()))).dim if self.slots else 0

    def table_slots(self) -> dict[str, list[tuple[str, str]]]:
        """table -> [(role, slot)] where role is "emb" or "lin"; order is stable."""
        out: dict[str, list[tuple[str, str]]] = {t.name: [] for t in self.tables}
        for s, t in self.slots.items():
            out[t].append(("emb", s))
        for s, t in self.linear.items():
            out[t].append(("lin", s))
        return {k: v for k, v in out.items() if v}

    def salts(self) -> dict[tuple[str, str], int]:
        """(table, slot) -> xor salt for ids (0 unless the table is shared by several slots and
        ``salt`` does not turn it off for the slot)."""
        out = {}
        for table, uses in self.table_slots().items():
            distinct = {s for _, s in uses}
            for _, s in uses:
                out[(table, s)] = _salt(s) if len(distinct) > 1 and self.salt.get(s, True) else 0
        return out


def _salt(slot: str) -> int:
    return int.from_bytes(hashlib.blake2b(slot.encode(), digest_size=8).digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def floored(optimizer: dict[str, Any], example_steps: bool) -> dict[str, Any]:
    """An embedding table's optimizer as a project file names it, with :data:`SPARSE_ACC` as its
    Adagrad's initial accumulator where the embeddings learn example by example and it names none.

    >>> floored({"kind": "adagrad", "lr": 0.05}, True)["initial_accumulator_value"]
    0.001
    >>> floored({"kind": "adagrad", "lr": 0.05}, False)
    {'kind': 'adagrad', 'lr': 0.05}
    """
    if example_steps and optimizer.get("kind", "adagrad") == "adagrad":
        return {"initial_accumulator_value": SPARSE_ACC, **optimizer}
    return optimizer


def deepfm_config(model_id: str = "deepfm", dim: int = SERVED_DIM, mlp: list[int] | None = None, lr: float = SPARSE_LR,
                  slots: tuple[str, ...] = MOVIELENS_SLOTS, ttl_seconds: float | None = None,
                  min_count: int = 1, shards: int = 1, recent_items: bool = True,
                  seed: int | None = None, sequential: bool = True, linear_lr: float = LINEAR_LR,
                  sequential_embeddings: bool = True, linear_acc: float = LINEAR_ACC,
                  linear_scale_lr: float | None = LINEAR_SCALE_LR, acc: float | None = None) -> ModelConfig:
    """DeepFM over the MovieLens slots: one embedding + one first-order table per slot.

    The defaults are the served model (``driftline eval baselines``, ``docs/results.md`` section 4,
    chose them): dim :data:`SERVED_DIM`, MLP :data:`SERVED_MLP`, ``sequential`` first-order weights and ``sequential_embeddings``
    (per-example steps inside a batch) at Adagrad ``linear_lr`` (initial accumulator ``linear_acc``), the
    embeddings at ``lr`` (initial accumulator ``acc``; None: :data:`SPARSE_ACC` where they learn
    example by example, else 0: a batch's mean gradient is ~1/batch of an example's), a learned
    factor on each first-order field at ``linear_scale_lr``.
    ``sequential=False`` steps everything once per batch (``linear_lr`` then still applies to the
    first-order tables).

    ``recent_items`` (when ``item_id`` is a slot) adds the real-time :data:`RECENT_ITEMS` slot as
    one more embedding field: mean-pooled over the ``item_id`` table, unsalted on both sides, so a
    clicked item's embedding is the item's own row (no table and no first-order term of its own).
    ``seed`` (None: the historical defaults, head seed 0 and table initializer seed 1 everywhere)
    seeds the dense head with ``seed`` and table ``i`` (in ``tables`` order) with ``1 + 1000*seed + i``.
    """
    def init(i: int) -> InitializerConfig:
        return InitializerConfig(kind="normal", scale=0.01, seed=1 if seed is None else 1 + 1000 * seed + i)

    def zeros(i: int) -> InitializerConfig:
        return InitializerConfig(kind="zeros", **({} if seed is None else {"seed": 1 + 1000 * seed + i}))

    adm = {"min_count": min_count}
    if acc is None:
        acc = SPARSE_ACC if sequential and sequential_embeddings else 0.0
    tables = [TableConfig(name=f"{s}", dim=dim, optimizer=AdagradConfig(lr=lr, initial_accumulator_value=acc), initializer=init(i),
                          admission=adm, ttl_seconds=ttl_seconds, shards=shards) for i, s in enumerate(slots)]
    tables += [TableConfig(name=f"{s}_w", dim=1, optimizer=AdagradConfig(lr=linear_lr, initial_accumulator_value=linear_acc),
                           initializer=zeros(len(slots) + i), admission=adm,
                           ttl_seconds=ttl_seconds, shards=shards) for i, s in enumerate(slots)]
    fields = {s: s for s in slots}
    pooling: dict[str, Literal["sum", "mean"]] = {"genres": "mean"}
    salt: dict[str, bool] = {}
    if recent_items and "item_id" in slots and RECENT_ITEMS not in slots:
        fields[RECENT_ITEMS] = "item_id"
        pooling[RECENT_ITEMS] = "mean"
        salt = {"item_id": False, RECENT_ITEMS: False}
    return ModelConfig(model_id=model_id, kind="deepfm", slots=fields,
                       linear={s: f"{s}_w" for s in slots}, tables=tables, pooling=pooling, salt=salt,
                       seed=0 if seed is None else seed, sequential=sequential,
                       sequential_embeddings=sequential and sequential_embeddings, linear_scale_lr=linear_scale_lr,
                       **({} if mlp is None else {"mlp": list(mlp)}))


def lr_config(model_id: str = "lr", lr: float = 0.05, slots: tuple[str, ...] = MOVIELENS_SLOTS,
              recent_items: bool = True, sequential: bool = False) -> ModelConfig:
    """Logistic regression: all slots share one dim-1 table (ids salted per slot).

    ``recent_items`` adds the real-time :data:`RECENT_ITEMS` slot as a mean-pooled first-order
    field with its own (salted) weights: a linear model has no item interaction to share rows
    for, but it must accept the Examples serving logs after a user's first click."""
    t = TableConfig(name="weights", dim=1, optimizer=AdagradConfig(lr=lr), initializer=InitializerConfig(kind="zeros"))
    linear = {s: "weights" for s in slots}
    pooling: dict[str, Literal["sum", "mean"]] = {}
    if recent_items and RECENT_ITEMS not in slots:
        linear[RECENT_ITEMS] = "weights"
        pooling[RECENT_ITEMS] = "mean"
    return ModelConfig(model_id=model_id, kind="lr", linear=linear, tables=[t], pooling=pooling, mlp=[],
                       sequential=sequential)
