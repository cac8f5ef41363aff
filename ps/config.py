"""Typed configuration of embedding tables (pydantic v2, frozen).

Event time everywhere in :mod:`ps` is **int64 milliseconds since the Unix epoch**
(the unit Kafka timestamps use); only ``ttl_seconds`` is given in seconds for
readability and converted with :attr:`TableConfig.ttl_ms`.

>>> cfg = TableConfig(name="item", dim=8, optimizer=AdagradConfig(lr=0.05),
...                   initializer=InitializerConfig(kind="uniform", scale=0.1, seed=7),
...                   admission=AdmissionConfig(min_count=3), ttl_seconds=3600)
>>> cfg.ttl_ms, cfg.optimizer.kind, cfg.slot_width
(3600000, 'adagrad', 8)
>>> TableConfig.model_validate_json(cfg.model_dump_json()) == cfg
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SGDConfig(_Frozen):
    """Plain SGD: ``w -= lr * g``. No per-row state."""

    kind: Literal["sgd"] = "sgd"
    lr: float = Field(0.01, gt=0)


class AdagradConfig(_Frozen):
    """Adagrad exactly as ``torch.optim.Adagrad`` (no lr decay): one accumulator per weight.

    ``max_accumulator`` caps each accumulator (its sum of squared gradients): a weight's step
    size then never falls below ``lr / sqrt(max_accumulator)``. Plain Adagrad's steps shrink with
    every gradient a row ever took, so a row seen a million times has all but stopped learning: an
    online model whose items' appeal changes (a season, a price, the news) would follow the change
    at the pace of its rarest rows' history, not its traffic. The cap keeps the step of a busy row
    where its first ``max_accumulator / g**2`` gradients left it; rows below it are plain Adagrad.
    ``None``: no cap.

    >>> AdagradConfig(max_accumulator=10.0).max_accumulator
    10.0
    >>> from pydantic import ValidationError
    >>> try:
    ...     AdagradConfig(initial_accumulator_value=1.0, max_accumulator=0.5)
    ... except ValidationError as e:
    ...     print(e.errors()[0]["msg"])
    Value error, max_accumulator 0.5 is below initial_accumulator_value 1: every row would start capped
    """

    kind: Literal["adagrad"] = "adagrad"
    lr: float = Field(0.01, gt=0)
    initial_accumulator_value: float = Field(0.0, ge=0)
    eps: float = Field(1e-10, gt=0)
    max_accumulator: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _cap_above_start(self) -> AdagradConfig:
        if self.max_accumulator is not None and self.max_accumulator < self.initial_accumulator_value:
            raise ValueError(f"max_accumulator {self.max_accumulator:g} is below initial_accumulator_value "
                             f"{self.initial_accumulator_value:g}: every row would start capped")
        return self


class AdamConfig(_Frozen):
    """Lazy (per-row step) Adam, matching ``torch.optim.Adam`` for a row updated every step.

    State per row: ``m`` and ``v`` per weight plus one step counter.
    """

    kind: Literal["adam"] = "adam"
    lr: float = Field(0.001, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)


class FtrlConfig(_Frozen):
    """FTRL-Proximal (McMahan et al. 2013) per coordinate; ``lr`` is alpha.

    State per row: ``z`` and ``n`` per weight. At insert ``z`` is chosen so that the
    weights equal the initializer's values, so initialization is not thrown away.
    """

    kind: Literal["ftrl"] = "ftrl"
    lr: float = Field(0.05, gt=0)
    beta: float = Field(1.0, ge=0)
    l1: float = Field(0.0, ge=0)
    l2: float = Field(0.0, ge=0)
    initial_accumulator_value: float = Field(0.1, ge=0)


OptimizerConfig = Annotated[
    SGDConfig | AdagradConfig | AdamConfig | FtrlConfig, Field(discriminator="kind")
]

#: float32 state columns each optimizer stores beside a row, as a function of dim.
_STATE_WIDTH: dict[str, Callable[[int], int]] = {"sgd": lambda d: 0, "adagrad": lambda d: d, "adam": lambda d: 2 * d + 1,
                "ftrl": lambda d: 2 * d}


class InitializerConfig(_Frozen):
    """How a new row's weights are drawn.

    Values are a pure function of ``(seed, id, column)`` so they do not depend on
    insertion order, shard layout or process: replays and resharding give the same rows.
    ``uniform`` draws from ``[-scale, scale)``; ``normal`` from ``N(0, scale**2)``.
    """

    kind: Literal["zeros", "uniform", "normal"] = "normal"
    scale: float = Field(0.01, ge=0)
    seed: int = Field(0, ge=0, lt=2**63)


class AdmissionConfig(_Frozen):
    """When an unseen id gets a row.

    An id is admitted on an occurrence when its occurrence count (from a count-min
    sketch with conservative update and 16-bit saturating counters) has reached
    ``min_count`` *and* a seeded Bernoulli(``probability``) draw succeeds. With the
    defaults every id is admitted at once and no sketch is allocated.
    """

    min_count: int = Field(1, ge=1, le=65535)
    probability: float = Field(1.0, gt=0, le=1)
    sketch_width: int = Field(1 << 18, ge=64, le=1 << 30)
    sketch_depth: int = Field(4, ge=1, le=16)
    seed: int = Field(0, ge=0, lt=2**63)


class TableConfig(_Frozen):
    """One embedding table (logically; it may be split into ``shards``).

    ``optimizer=None`` declares a serving replica: no optimizer state, no admission
    (rows only arrive through :meth:`ps.EmbeddingTable.apply_sync`).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    dim: int = Field(ge=1, le=65536)
    optimizer: OptimizerConfig | None = AdagradConfig()
    initializer: InitializerConfig = InitializerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    ttl_seconds: float | None = Field(None, gt=0)
    shards: int = Field(1, ge=1, le=4096)
    initial_capacity: int = Field(1024, ge=1, le=1 << 40)
    #: keep the exact touched-key stream (:meth:`ps.EmbeddingTable.pop_updates`). When on,
    #: a deleted/expired row is kept as a tombstone until the stream is drained.
    track_updates: bool = True
    #: run a bounded TTL sweep (2 rows per id, >= 1024) inside every ``apply_gradients``,
    #: so expiry keeps pace with training without a separate caller
    expire_on_update: bool = True

    @property
    def ttl_ms(self) -> int | None:
        """TTL in event-time milliseconds (``None``: rows never expire)."""
        return None if self.ttl_seconds is None else max(1, round(self.ttl_seconds * 1000))

    @property
    def slot_width(self) -> int:
        """float32 optimizer-state columns stored beside each row."""
        return 0 if self.optimizer is None else _STATE_WIDTH[self.optimizer.kind](self.dim)

    def serving(self) -> TableConfig:
        """The config of a serving replica of this table (no optimizer, no TTL, no tracking)."""
        return self.model_copy(update=dict(optimizer=None, ttl_seconds=None,
                                           admission=AdmissionConfig(), track_updates=False))
