"""The project file: one place where a user declares their features, tables, model, labels,
sampling, windows and sync intervals (``driftline.toml``, or the same keys in YAML), validated by
pydantic. ``driftline init`` writes a commented one (:mod:`driftline.project_template`).

(Over 500 lines: the file's schema, its one mapping onto the settings (:data:`FILE_KEYS`) and onto
the model config, and their checks are one contract with the user's file.)

A project maps onto two things the rest of driftline already reads:

* :meth:`Project.model_config`: the trainer's :class:`trainer.config.ModelConfig` (slots, tables,
  dense features). ``trainer.model`` may name the project file itself: every service that loads
  the model (trainer, serving) then reads it from the file (:func:`named_config`).
* :meth:`Project.settings_overrides`: the :class:`services.settings.Settings` fields the file sets,
  as nested sections: :data:`FILE_KEYS` maps each of the file's own keys to its setting (the one
  table of renames), ``[settings.<section>]`` names any other by its own name. Absent keys mean
  "keep the setting": defaults live only in ``services/settings.py``. Environment variables win
  over the file (:meth:`Project.resolved_settings`, :func:`apply_to_environ`), so every setting
  stays overridable as before.

>>> from services.settings import Settings
>>> p = Project.model_validate({"name": "shop", "features": [
...     {"name": "item_category", "source": "item", "ids": "string"},
...     {"name": "position", "source": "position"},
...     {"name": "price", "source": "candidate", "kind": "dense"}],
...     "model": {"dim": 4, "mlp": [8]}, "tables": {"default": {"ttl_seconds": 3600}}})
>>> cfg = p.model_config()
>>> cfg.model_id, sorted(cfg.slots), cfg.dense_features, cfg.table("item_category").ttl_seconds
('shop', ['item_category'], ['price'], 3600.0)
>>> cfg.linear["position"], cfg.table("position_w").dim, cfg.position_slot  # a first-order term only
('position_w', 1, 'position')
>>> p.model_copy(update={"windows": WindowSpec(idle_advance_seconds=30)}).settings_overrides()["joiner"]
{'idle_advance_seconds': 30.0, 'immediate_label': 'click'}
>>> p.labels == Settings().joiner.label_map  # no [labels]: the setting's
True
>>> FeatureSpec(name="device", source="context", kind="sparse", ids="string").hashed
True
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from ps import AdmissionConfig, InitializerConfig, TableConfig
from ps.config import OptimizerConfig
from services.settings import (
    PROJECT_VAR,
    LabelMap,
    PositiveSeconds,
    SampleRate,
    Seconds,
    Settings,
    UnknownFeatures,
    first_error,
)

if TYPE_CHECKING:
    # at run time inside the functions that need it: importing trainer sets OMP_WAIT_POLICY for
    # a process that has no torch yet (trainer/__init__.py), and the client's users import this module
    from trainer.config import ModelConfig

__all__ = [
    "FILE_KEYS",
    "PROJECT_VAR",
    "FeatureSpec",
    "Project",
    "ProjectError",
    "ProjectFile",
    "apply_to_environ",
    "load_project",
    "named_config",
]

#: The project file's own keys -> the setting each one sets, ``(section, field)`` of
#: :class:`services.settings.Settings`: the one place a file key is renamed (a key of the file's
#: sections reads better in the file's words: ``[sampling] negative_rate``, not
#: ``negative_sample_rate``). A key's type is the setting's (the same bound, declared once in
#: services/settings.py); tests/test_config_floor.py holds both, and docs/own-data.md's table, to it.
#: Any other setting is ``[settings.<section>] <field>``, by its own name.
FILE_KEYS: dict[tuple[str, ...], tuple[str, str]] = {
    ("sampling", "negative_rate"): ("joiner", "negative_sample_rate"),
    ("sampling", "per_model"): ("joiner", "slice_sample_rates"),
    ("windows", "window_seconds"): ("joiner", "window_seconds"),
    ("windows", "allowed_lateness_seconds"): ("joiner", "allowed_lateness_seconds"),
    ("windows", "orphan_grace_seconds"): ("joiner", "orphan_grace_seconds"),
    ("windows", "idle_advance_seconds"): ("joiner", "idle_advance_seconds"),
    ("windows", "idle_advance_margin_seconds"): ("joiner", "idle_advance_margin_seconds"),
    ("labels",): ("joiner", "label_map"),
    ("sync", "sparse_interval_s"): ("trainer", "sync_interval_s"),
    ("sync", "dense_interval_s"): ("trainer", "dense_sync_interval_s"),
    ("unknown_features",): ("serving", "unknown_features"),
}

_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class ProjectError(ValueError):
    """A project file that cannot be read or is invalid (one line for the CLI)."""


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FeatureSpec(_Spec):
    """One feature the model reads."""

    name: str = Field(pattern=_NAME)
    #: context: the request (``/rank`` ``context``); candidate: per candidate in the request;
    #: user / item: the online feature store (Redis), filled by ``driftline features load`` (ids
    #: and dense values alike; a request's own value of the feature overrides the store's);
    #: position: the place a candidate is shown at (0 = first), one sparse feature at most:
    #: serving scores every candidate at 0 and logs the place it answered each at, unless the
    #: candidate gives its own (a replayed log's, a client that places items itself)
    source: Literal["context", "candidate", "user", "item", "position"]
    kind: Literal["sparse", "dense"] = "sparse"
    #: sparse only: "string" values are hashed to int64 ids with services.hashing.string_id
    ids: Literal["int", "string"] = "int"
    #: sparse only: the embedding table (default: one of its own, named like the feature); features
    #: naming the same table share it (their ids are salted apart unless ``salt`` is false)
    table: str | None = Field(None, pattern=_NAME)
    #: sparse only: how a bag of several ids pools (absent: ``[model] pooling``, else sum)
    pooling: Literal["sum", "mean"] | None = None
    #: sparse only, shared tables: false reads the shared table with raw ids (absent: salted)
    salt: bool | None = None

    @property
    def hashed(self) -> bool:
        return self.kind == "sparse" and self.ids == "string"


class TableSpec(_Spec):
    """The tables behind the features; an absent key keeps ``[tables.default]``'s, then the served
    model's (an optimizer: Adagrad at :data:`trainer.config.SPARSE_LR`, initial accumulator
    :data:`trainer.config.SPARSE_ACC` where the embeddings learn example by example; first-order
    tables at :data:`trainer.config.LINEAR_LR`, initial accumulator
    :data:`trainer.config.LINEAR_ACC`), then ps's
    own default (:class:`ps.TableConfig`)."""

    dim: int | None = Field(None, ge=1)
    optimizer: OptimizerConfig | None = None
    initializer: InitializerConfig | None = None
    #: ``{min_count = 3, probability = 0.5}``: an unseen id gets a row on its 3rd occurrence, if a
    #: coin says so; rare ids never take memory
    admission: AdmissionConfig | None = None
    #: rows untouched this long (event time) are dropped
    ttl_seconds: float | None = Field(None, gt=0)
    shards: int | None = Field(None, ge=1)


class ModelSpec(_Spec):
    kind: Literal["deepfm", "lr"] = "deepfm"
    #: the embedding dim of every field table (deepfm needs one dim); a table's own dim wins for lr
    dim: int = Field(8, ge=1)
    mlp: list[int] | None = None
    #: embedding fields (deepfm); absent: every sparse feature but a position (a first-order term only)
    fields: list[str] | None = None
    #: first-order terms; absent: every sparse feature
    linear: list[str] | None = None
    #: dense inputs in order; absent: every dense feature
    dense: list[str] | None = None
    #: how a bag of several ids pools for a feature that names no ``pooling`` of its own; absent:
    #: sum (a file written before this key keeps the model its snapshots hold). The template says
    #: mean: on bags of 1-300 tags, AUC 0.606 against sum's 0.562 where clicks follow the tags' mean
    #: effect, 0.589 against 0.596 where they follow their sum
    pooling: Literal["sum", "mean"] | None = None
    dense_optimizer: Literal["adam", "adagrad", "sgd"] | None = None
    dense_lr: float | None = Field(None, gt=0)
    #: a deepfm learns a factor on each first-order field (trainer.head.DenseHead.linear_scale: a
    #: feature that says nothing is shrunk toward 0), at trainer.config.LINEAR_SCALE_LR; false: every
    #: first-order field counts 1. Ignored by an lr (its first-order terms are the whole model:
    #: there the factors cost AUC on MovieLens)
    linear_scale: bool = True
    #: how the dense inputs are put on one scale (trainer/dense_scaling.py): ``log`` (signed log1p,
    #: then standardized by the stream's running statistics: any unit, heavy tails), ``standard``
    #: (standardized only), ``none`` (as they come)
    dense_scaling: Literal["log", "standard", "none"] = "log"
    #: the label the model learns (one of the ``[labels]`` values)
    label: str = "click"
    seed: int = 0
    #: the first-order weights learn example by example inside each mini-batch (trainer/sequential.py:
    #: the later examples of a burst are scored with what the earlier ones taught); false: once per
    #: batch, like the embeddings. Ignored by a model without first-order terms.
    sequential: bool = True
    #: with ``sequential``, a deepfm's embedding rows learn example by example too (FM from fresh
    #: rows, the MLP's slope from the batch's start; ps/sequential_fm.py). Its tables then need
    #: sgd or adagrad. Ignored by an lr and by a model without first-order terms.
    sequential_embeddings: bool = True
    #: the first-order ("<table>_w") tables' optimizer; absent: [tables.default]'s, else Adagrad at
    #: trainer.config.LINEAR_LR (initial accumulator LINEAR_ACC). A table's own [tables.<name>_w] optimizer wins.
    linear_optimizer: OptimizerConfig | None = None
    #: meta-learned starting points for new ids of one task slot, e.g. ``{task_slot = "user"}``
    #: (the fields of trainer.config.MetaConfig, which checks them; trainer/meta.py); absent: off
    meta: dict[str, Any] | None = None
    #: a content encoder over an item's content tokens, e.g. ``{slot = "item_content", item_slot = "item"}``
    #: (the fields of trainer.config.ContentConfig, which checks them; trainer/content.py); absent: off
    content: dict[str, Any] | None = None


# The sections of the keys in FILE_KEYS: each key typed as its setting (services/settings.py).

class SamplingSpec(_Spec):
    #: share of negative examples the joiner keeps (the trainer corrects for it)
    negative_rate: SampleRate | None = None
    #: per served model id (slice)
    per_model: dict[str, SampleRate] | None = None


class WindowSpec(_Spec):
    window_seconds: PositiveSeconds | None = None
    allowed_lateness_seconds: Seconds | None = None
    orphan_grace_seconds: Seconds | None = None
    #: live traffic with sparse actions: advance an idle actions partition's watermark after this
    #: many wall seconds so windows close (absent: off, a replay's result depends only on the data)
    idle_advance_seconds: PositiveSeconds | None = None
    idle_advance_margin_seconds: Seconds | None = None


class SyncSpec(_Spec):
    sparse_interval_s: PositiveSeconds | None = None
    dense_interval_s: PositiveSeconds | None = None


class StoreSpec(_Spec):
    """``driftline features load --config``: the key columns of the users/items files, and the
    files ``up`` keeps loaded."""

    user_key: str | None = None
    item_key: str | None = None
    separator: str | None = None
    #: ``up`` loads the MovieLens demo's features into Redis (the demo's file only)
    movielens: bool = False
    #: the users / items files (Parquet or CSV) ``up`` loads into Redis at its start and again
    #: whenever Redis loses them (``features load --watch``), and ``features load --config``
    #: loads when given no file; a relative path is the project file's folder's
    users_file: Path | None = None
    items_file: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> StoreSpec:
        if self.movielens and (self.users_file or self.items_file):
            raise ValueError("store: movielens = true loads the demo's features; leave out users_file and items_file")
        return self


class WarmStartSpec(_Spec):
    #: none: the model starts from its initial weights; examples: ``trainer batch`` on Parquet
    #: examples (the dumper's layout, ``<var_dir>/examples``) before the online trainer starts
    kind: Literal["none", "examples"] = "none"
    examples_dir: Path | None = None

    @model_validator(mode="after")
    def _check(self) -> WarmStartSpec:
        if (self.kind == "examples") != (self.examples_dir is not None):
            raise ValueError("warm_start: kind = 'examples' needs examples_dir (and only it does)")
        return self


class ProjectFile(_Spec):
    """The file's contents, validated (:class:`Project` adds what is derived from them)."""

    #: the model id: snapshots, metrics and serving's slice are named after it
    name: str = Field(pattern=_NAME)
    features: list[FeatureSpec]
    tables: dict[str, TableSpec] = Field(default_factory=dict)
    model: ModelSpec = ModelSpec()
    #: action type -> the label it sets (the joiner's ``label_map``)
    labels: LabelMap | None = None
    sampling: SamplingSpec = SamplingSpec()
    windows: WindowSpec = WindowSpec()
    sync: SyncSpec = SyncSpec()
    store: StoreSpec = StoreSpec()
    warm_start: WarmStartSpec = WarmStartSpec()
    #: "movielens": ``up`` runs the MovieLens demo around this model (download, warm start on the
    #: first 10% of ml-1m, its features in Redis, the replay through serving); absent: your own data
    demo: Literal["movielens"] | None = None
    #: a ``/rank`` naming a feature the model does not read: "reject" (422 naming it) or "ignore"
    #: (dropped and counted in ``driftline_serving_unknown_features_total``)
    unknown_features: UnknownFeatures | None = None
    #: any other setting, by section: ``[settings.event_time] max_past_s = 2592000``
    settings: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("settings")
    @classmethod
    def _known_settings(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """A misspelt section or key would be ignored silently (the environment ignores unknown
        variables): refuse it, and check the values' types now rather than in every service."""
        for section, fields in value.items():
            kind = getattr(Settings.model_fields.get(section), "annotation", None)
            if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
                raise ValueError(f"[settings.{section}]: no such settings section")
            unknown = sorted(set(fields) - set(kind.model_fields))
            if unknown:
                raise ValueError(f"[settings.{section}]: no such settings {unknown}")
            # (alone: checks between a section's settings wait for the environment's, e.g. a password)
            try:
                kind.model_validate(fields, context={"section_only": True})
            except ValidationError as err:  # its own location would lose the section's name
                raise ValueError(f"[settings.{section}] {first_error(err)}") from None
        return value

    @model_validator(mode="after")
    def _check(self) -> ProjectFile:
        names = [f.name for f in self.features]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"features declared twice: {dupes}")
        kinds = {f.name: f.kind for f in self.features}
        positions = [f for f in self.features if f.source == "position"]
        if len(positions) > 1:
            raise ValueError(f"features {[f.name for f in positions]}: one feature at most has source 'position'")
        if positions and (positions[0].kind != "sparse" or positions[0].ids != "int"):
            raise ValueError(f"feature {positions[0].name!r}: a position is a sparse feature of int ids (0 = first)")
        for role, listed, kind in (("fields", self.model.fields, "sparse"), ("linear", self.model.linear, "sparse"),
                                   ("dense", self.model.dense, "dense")):
            bad = [n for n in listed or () if kinds.get(n) != kind]
            if bad:
                raise ValueError(f"model.{role}: {bad} are not declared {kind} features")
        m = self.model
        content = {m.content["slot"]} if m.content and "slot" in m.content else set()
        sparse = [n for n, k in kinds.items() if k == "sparse" and n not in content]
        placed = {f.name for f in positions}
        read = content | set(m.fields if m.fields is not None else
                             ([n for n in sparse if n not in placed] if m.kind == "deepfm" else ())) | \
            set(m.linear if m.linear is not None else sparse) | \
            set(m.dense if m.dense is not None else [n for n, k in kinds.items() if k == "dense"])
        unread = [n for n in kinds if n not in read]
        if unread:  # serving would refuse them in /rank: the model does not read them
            raise ValueError(f"features {unread} are declared but the model reads them in no role "
                             f"(model.fields / linear / dense)")
        if self.demo is not None and self.warm_start.kind != "none":
            raise ValueError("demo = 'movielens' warm-starts on MovieLens itself: leave [warm_start] kind = 'none'")
        if self.labels is not None and self.model.label not in self.labels.values():
            raise ValueError(f"model.label {self.model.label!r} is no [labels] value ({sorted(set(self.labels.values()))})")
        return self


class Project:
    """A validated project file (its sections are attributes: ``project.features``, ``.labels``...)
    and what follows from it: the model, the settings. (Not a pydantic model itself: pydantic
    reserves the name ``model_config``, which this class's callers use for the trainer's model.)"""

    def __init__(self, file: ProjectFile, path: Path | None = None) -> None:
        self.file = file
        #: the file this project was read from (absolute), if any
        self.path = path

    @classmethod
    def model_validate(cls, data: Any, path: Path | None = None) -> Project:
        return cls(ProjectFile.model_validate(data), path)

    def __getattr__(self, name: str) -> Any:
        if name == "file":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.file, name)

    def __repr__(self) -> str:
        return f"Project({self.file.name!r}, path={str(self.path) if self.path else None!r})"

    @property
    def labels(self) -> dict[str, str]:
        """Action type -> label: the file's ``[labels]``, else the joiner's ``label_map`` setting."""
        if self.file.labels is not None:
            return dict(self.file.labels)
        # (the process's settings, read when asked for)
        from services.settings import get_settings

        return dict(get_settings().joiner.label_map)

    def model_copy(self, update: dict[str, Any]) -> Project:
        return Project(self.file.model_copy(update=update), self.path)

    def resolve(self, path: Path) -> Path:
        """A path the file names, as the file means it: a relative one is the file's folder's."""
        return path if path.is_absolute() or self.path is None else self.path.parent / path

    @property
    def feature_files(self) -> tuple[Path | None, Path | None]:
        """``[store]``'s users and items files, each resolved (:meth:`resolve`); (None, None) when it names none."""
        store = self.file.store
        return (None if store.users_file is None else self.resolve(store.users_file),
                None if store.items_file is None else self.resolve(store.items_file))

    def feature(self, name: str) -> FeatureSpec:
        return next(f for f in self.file.features if f.name == name)

    def _roles(self) -> tuple[list[str], list[str], list[str]]:
        m = self.file.model
        content = {m.content["slot"]} if m.content and "slot" in m.content else set()
        # the content encoder's input is no field of its own (trainer.content)
        sparse = [f.name for f in self.file.features if f.kind == "sparse" and f.name not in content]
        # a position is a first-order term unless named a field: crossed with the items, scoring every
        # candidate at the first place moves them apart (bench/bench_position.py: CTR +0.0355 as a
        # term alone against +0.0203 as a field too, over a model without it)
        placed = {f.name for f in self.file.features if f.source == "position"}
        fields = m.fields if m.fields is not None else ([n for n in sparse if n not in placed] if m.kind == "deepfm" else [])
        linear = m.linear if m.linear is not None else sparse
        dense = m.dense if m.dense is not None else [f.name for f in self.file.features if f.kind == "dense"]
        return list(fields), list(linear), list(dense)

    def _table(self, name: str, dim: int, index: int, first_order: bool = False,
               example_steps: bool = False) -> TableConfig:
        """``example_steps``: the embeddings learn example by example (``sequential_embeddings``;
        :func:`trainer.config.floored`)."""
        from trainer.config import LINEAR_ACC, LINEAR_LR, SPARSE_LR, floored

        default, own = self.file.tables.get("default", TableSpec()), self.file.tables.get(name, TableSpec())
        linear = ({"optimizer": self.file.model.linear_optimizer.model_dump()}
                  if first_order and self.file.model.linear_optimizer is not None else {})
        merged = {**default.model_dump(exclude_unset=True), **linear, **own.model_dump(exclude_unset=True)}
        merged = {k: v for k, v in merged.items() if v is not None}
        merged.setdefault("optimizer", {"kind": "adagrad", "lr": LINEAR_LR, "initial_accumulator_value": LINEAR_ACC}
                          if first_order else {"kind": "adagrad", "lr": SPARSE_LR})
        if not first_order:
            merged["optimizer"] = floored(merged["optimizer"], example_steps)
        merged.setdefault("initializer", {"kind": "normal", "scale": 0.01, "seed": 1 + 1000 * self.file.model.seed + index}
                          if dim > 1 else {"kind": "zeros"})
        merged["dim"] = dim if dim == 1 else merged.get("dim", dim)
        return TableConfig(name=name, **merged)

    def model_config(self) -> ModelConfig:
        """The trainer's model for this project: each sparse feature's embedding table (its own
        unless ``table`` names a shared one) and first-order table ``<table>_w`` (dim 1)."""
        from trainer.config import LINEAR_SCALE_LR, ModelConfig

        fields, linear, dense = self._roles()
        emb = {n: self.feature(n).table or n for n in fields}
        lin = {n: f"{self.feature(n).table or n}_w" for n in linear}
        names = list(dict.fromkeys([*emb.values(), *lin.values()]))
        first_order = {t for t in lin.values() if t not in emb.values()}
        m = self.file.model
        example_steps = m.sequential_embeddings and m.sequential and bool(lin) and m.kind == "deepfm"
        tables = [self._table(t, 1 if t in first_order else m.dim, i, t in first_order, example_steps)
                  for i, t in enumerate(names)]
        used = {*fields, *linear}
        extra = {k: v for k, v in (("mlp", m.mlp), ("dense_optimizer", m.dense_optimizer), ("dense_lr", m.dense_lr))
                 if v is not None}
        if m.kind == "lr" and m.mlp is None:
            extra["mlp"] = []
        if m.linear_scale and m.kind == "deepfm":
            extra["linear_scale_lr"] = LINEAR_SCALE_LR
        return ModelConfig(
            model_id=self.file.name, kind=m.kind, slots=emb, linear=lin, tables=tables, dense_features=dense,
            pooling=self._pooling(used),
            salt={f.name: f.salt for f in self.file.features if f.salt is not None and f.name in used},
            label=m.label, seed=m.seed, sequential=m.sequential and bool(lin), dense_scaling=m.dense_scaling,
            sequential_embeddings=example_steps,
            meta=m.meta, content=m.content, **extra,
            position_slot=next((f.name for f in self.file.features if f.source == "position"), None))

    def _pooling(self, used: set[str]) -> dict[str, Literal["sum", "mean"]]:
        """Each read sparse feature's pooling: its own, else ``[model] pooling`` (none: the model's sum)."""
        out: dict[str, Literal["sum", "mean"]] = {}
        for f in self.file.features:
            mode = f.pooling or self.file.model.pooling
            if mode is not None and f.kind == "sparse" and f.name in used:
                out[f.name] = mode
        return out

    def settings_overrides(self) -> dict[str, dict[str, Any]]:
        """The settings this file sets, as ``{section: {field: value}}`` (for
        :meth:`services.settings.Settings.updated`); keys the file leaves out are absent:
        ``[settings.<section>]``, then each key of :data:`FILE_KEYS` the file sets, then
        ``joiner.immediate_label``, the label ``[model]`` learns (the joiner emits an impression when
        that label joins it), and ``trainer.model``, the file itself when read from one (the model
        is declared in it)."""
        out: dict[str, dict[str, Any]] = {s: dict(v) for s, v in self.file.settings.items()}
        for keys, (section, field) in FILE_KEYS.items():
            value: Any = self.file
            for key in keys:
                value = getattr(value, key)
            if value is not None:
                out.setdefault(section, {})[field] = value
        out.setdefault("joiner", {}).setdefault("immediate_label", self.file.model.label)
        if self.path is not None:
            out.setdefault("trainer", {})["model"] = str(self.path)
        return {k: v for k, v in out.items() if v}

    def settings_env(self) -> dict[str, str]:
        """:meth:`settings_overrides` as ``DRIFTLINE_<SECTION>__<FIELD>`` variables (JSON for
        lists and maps, as pydantic-settings parses them), for the services ``up`` starts."""
        import json

        return {f"DRIFTLINE_{section.upper()}__{key.upper()}":
                (json.dumps(v) if isinstance(v, (dict, list, tuple, bool)) else str(v))
                for section, fields in self.settings_overrides().items() for key, v in fields.items()}

    def resolved_settings(self) -> Settings:
        """``Settings`` with this file applied under the environment: a variable set in
        ``os.environ`` keeps its value, every other key the file sets replaces the default."""
        overrides: dict[str, Any] = self.settings_overrides()
        return _FileUnderEnv(**overrides)


class _FileUnderEnv(Settings):
    """Settings whose constructor arguments (the file) rank below the environment."""

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings, dotenv_settings, file_secret_settings


def apply_to_environ(project: Project, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the file's settings as environment variables where none is set (the environment wins),
    so this process and every service it starts read them. Returns what it set."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in project.settings_env().items() if k not in environ}
    environ.update(added)
    if project.path is not None:
        environ.setdefault(PROJECT_VAR, str(project.path))
    return added


def load_project(path: str | Path) -> Project:
    """Read and validate a project file (``.toml``, or ``.yaml``/``.yml``); :class:`ProjectError`
    with one readable line when it is missing or invalid."""
    path = Path(path).resolve()
    try:
        text = path.read_text()
    except OSError as err:
        raise ProjectError(f"{path}: {err.strerror or err}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            import tomllib

            data = tomllib.loads(text)
        project = ProjectFile.model_validate(data)
    except ValidationError as err:
        raise ProjectError(f"{path}: {first_error(err)} ({err.error_count()} error(s))") from None
    except Exception as err:  # noqa: BLE001 - a TOML/YAML syntax error: its own message says where
        raise ProjectError(f"{path}: {err}") from None
    return Project(project, path)


def json_schema() -> dict[str, Any]:
    """The project file's JSON schema (editors: ``driftline init --schema``)."""
    return ProjectFile.model_json_schema()


PROJECT_SUFFIXES = (".toml", ".yaml", ".yml")


def named_config(name: str) -> ModelConfig:
    """A built-in model config by name ("deepfm", "lr"), a path to a JSON ModelConfig, or a path to
    a project file (``driftline.toml``/``.yaml``: its model, :meth:`Project.model_config`);
    :class:`ProjectError` with one line for a file that cannot be read or is invalid."""
    from trainer.config import ModelConfig, deepfm_config, lr_config

    if name == "deepfm":
        return deepfm_config()
    if name == "lr":
        return lr_config()
    if Path(name).suffix in PROJECT_SUFFIXES:
        return load_project(name).model_config()
    try:
        return ModelConfig.model_validate_json(Path(name).read_text())
    except OSError as err:
        raise ProjectError(f"model {name}: not a model name (deepfm, lr), a ModelConfig JSON nor a project file "
                           f"({', '.join(PROJECT_SUFFIXES)}): {err.strerror or err}") from None
    except ValidationError as err:
        raise ProjectError(f"model {name}: {first_error(err)} ({err.error_count()} error(s))") from None
