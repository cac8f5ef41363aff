"""The configuration floor (issue 33): a setting's bounds and enumerations live on its field in
services/settings.py and are checked once, where the settings are read; the project file's keys
map onto settings through one declared table (:data:`driftline.project.FILE_KEYS`) and take the
settings' types, so both edges refuse the same values with pydantic's message naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from driftline.project import (
    FILE_KEYS,
    Project,
    ProjectError,
    ProjectFile,
    load_project,
)
from driftline.project_template import TEMPLATE
from joiner.config import JoinConfig
from services.settings import JoinerSettings, Settings

SEVENTEEN_LABELS = {f"a{i}": f"l{i}" for i in range(17)}


@pytest.mark.parametrize(("var", "value", "where", "message"), [
    ("DRIFTLINE_JOINER__NEGATIVE_SAMPLE_RATE", "0", "joiner.negative_sample_rate", "greater than 0"),
    ("DRIFTLINE_JOINER__NEGATIVE_SAMPLE_RATE", "1.5", "joiner.negative_sample_rate", "less than or equal to 1"),
    ("DRIFTLINE_JOINER__SLICE_SAMPLE_RATES", '{"shop": 2}', "joiner.slice_sample_rates.shop", "less than or equal to 1"),
    ("DRIFTLINE_JOINER__LATE_POLICY", "never", "joiner.late_policy", "'drop' or 'correction'"),
    ("DRIFTLINE_JOINER__POSITIVE_EMIT", "later", "joiner.positive_emit", "'immediate' or 'window_close'"),
    ("DRIFTLINE_JOINER__WINDOW_SECONDS", "0", "joiner.window_seconds", "greater than 0"),
    ("DRIFTLINE_JOINER__ALLOWED_LATENESS_SECONDS", "-1", "joiner.allowed_lateness_seconds", "greater than or equal to 0"),
    ("DRIFTLINE_JOINER__WATERMARK_OUTLIERS", "-1", "joiner.watermark_outliers", "greater than or equal to 0"),
    ("DRIFTLINE_JOINER__LABEL_MAP", json.dumps(SEVENTEEN_LABELS), "joiner.label_map", "at most 16 distinct labels"),
    ("DRIFTLINE_JOINER__STORE_URL", "/var/joiner", "joiner.store_url", "should match pattern '^rocksdb://.+'"),
    ("DRIFTLINE_TRAINER__SYNC_INTERVAL_S", "0", "trainer.sync_interval_s", "greater than 0"),
    ("DRIFTLINE_TRAINER__BATCH_SIZE", "0", "trainer.batch_size", "greater than or equal to 1"),
    ("DRIFTLINE_SERVING__UNKNOWN_FEATURES", "warn", "serving.unknown_features", "'reject' or 'ignore'"),
    ("DRIFTLINE_SERVING__PORT", "70000", "serving.port", "less than or equal to 65535"),
    ("DRIFTLINE_LOG_LEVEL", "LOUD", "log_level", "Input should be 'DEBUG'"),
])
def test_a_bad_setting_fails_at_settings_naming_it(monkeypatch, var: str, value: str, where: str, message: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError) as err:
        Settings()
    assert err.value.error_count() == 1
    text = str(err.value)
    assert f"\n{where}\n" in text and message in text, text


def test_updated_values_meet_the_same_bounds() -> None:
    """``Settings.updated`` (tests, benchmarks, command-line flags) validates what it sets."""
    s = Settings().updated(joiner={"negative_sample_rate": 0.5, "late_policy": "correction"})
    assert (s.joiner.negative_sample_rate, s.joiner.late_policy) == (0.5, "correction")
    with pytest.raises(ValidationError, match=r"negative_sample_rate\n  Input should be less than or equal to 1"):
        Settings().updated(joiner={"negative_sample_rate": 1.5})
    with pytest.raises(ValidationError, match=r"nproc\n  Input should be greater than or equal to 1"):
        Settings().updated(trainer={"nproc": 0})


def test_join_config_overrides_meet_the_settings_bounds() -> None:
    """Tests and benchmarks override JoinConfig's values directly: those named like a setting are
    validated as it (the join itself checks nothing)."""
    assert JoinConfig.from_settings(JoinerSettings(), negative_sample_rate=1.0).negative_sample_rate == 1.0
    with pytest.raises(ValidationError, match="negative_sample_rate"):
        JoinConfig.from_settings(JoinerSettings(), negative_sample_rate=0.0)
    with pytest.raises(ValidationError, match=r"slice_sample_rates\.m"):
        JoinConfig.from_settings(JoinerSettings(), slice_sample_rates={"m": 1.5})
    assert JoinConfig.from_settings(JoinerSettings(window_seconds=60), lateness_ms=0).window_ms == 60_000


def _spec_field(keys: tuple[str, ...]) -> FieldInfo:
    model: type[BaseModel] = ProjectFile
    for key in keys[:-1]:
        kind = model.model_fields[key].annotation
        assert isinstance(kind, type) and issubclass(kind, BaseModel), keys
        model = kind
    return model.model_fields[keys[-1]]


def _setting_field(section: str, field: str) -> FieldInfo:
    kind = Settings.model_fields[section].annotation
    assert isinstance(kind, type) and issubclass(kind, BaseModel), section
    return kind.model_fields[field]


def _accepts(info: FieldInfo) -> TypeAdapter[Any]:
    return TypeAdapter(Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation)


PROBES: list[Any] = [-1, 0, 0.25, 1, 1.5, 1e9, "0.5", "reject", "ignore", "warn", {"a": "b"}, SEVENTEEN_LABELS,
                     {"m": 0.5}, {"m": 0}, {"m": 2}, [1]]


@pytest.mark.parametrize("keys", list(FILE_KEYS), ids=".".join)
def test_every_file_key_sets_a_setting_of_its_type(keys: tuple[str, ...]) -> None:
    section, field = FILE_KEYS[keys]
    spec, setting = _spec_field(keys), _setting_field(section, field)
    assert spec.default is None  # absent from the file: the setting keeps its value
    file_type, setting_type = _accepts(spec), _accepts(setting)
    for value in PROBES:
        try:
            setting_type.validate_python(value)
            setting_ok = True
        except ValidationError:
            setting_ok = False
        try:
            file_type.validate_python(value)
            file_ok = True
        except ValidationError:
            file_ok = False
        assert file_ok == setting_ok, f"{'.'.join(keys)} and {section}.{field} disagree on {value!r}"


def test_the_table_holds_every_key_of_the_mapped_sections(tmp_path: Path) -> None:
    """A key added to [sampling], [windows] or [sync] without its row would set nothing."""
    for section in {keys[0] for keys in FILE_KEYS if len(keys) == 2}:
        model = ProjectFile.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        assert {(section, k) for k in model.model_fields} <= set(FILE_KEYS), section
    project = load_project_from(TEMPLATE, tmp_path)
    assert set(project.settings_overrides()) == {"joiner", "trainer", "serving"}


def load_project_from(text: str, tmp: Path) -> Project:
    path = tmp / "driftline.toml"
    path.write_text(text)
    return load_project(path)


def test_every_file_key_sets_its_setting() -> None:
    data: dict[str, Any] = {"name": "x", "features": [{"name": "item_id", "source": "candidate"}],
                            "model": {"kind": "lr"}}
    values = {"sampling": {"negative_rate": 0.5, "per_model": {"x": 0.75}}, "labels": {"click": "click"},
              "windows": {"window_seconds": 60, "allowed_lateness_seconds": 1, "orphan_grace_seconds": 2,
                          "idle_advance_seconds": 3, "idle_advance_margin_seconds": 4},
              "sync": {"sparse_interval_s": 5, "dense_interval_s": 6}, "unknown_features": "ignore"}
    project = Project.model_validate({**data, **values})
    overrides = project.settings_overrides()
    for keys, (section, field) in FILE_KEYS.items():
        value: Any = values
        for key in keys:
            value = value[key]
        assert overrides[section][field] == value, keys
    resolved = project.resolved_settings()
    assert resolved.joiner.negative_sample_rate == 0.5 and resolved.trainer.dense_sync_interval_s == 6


def test_the_project_file_refuses_what_the_settings_refuse(tmp_path: Path) -> None:
    with pytest.raises(ProjectError, match=r"sampling.negative_rate: Input should be less than or equal to 1"):
        load_project_from(TEMPLATE.replace("negative_rate = 0.25", "negative_rate = 1.5"), tmp_path)
    with pytest.raises(ProjectError, match=r"labels: Value error, at most 16 distinct labels|labels: at most 16"):
        load_project_from(TEMPLATE.replace('[labels]\nclick = "click"', "[labels]\n" + "\n".join(
            f'{k} = "{v}"' for k, v in {**SEVENTEEN_LABELS, "click": "click"}.items())), tmp_path)
    bound = r"settings: \[settings.joiner\] negative_sample_rate: Input should be less than or equal to 1"
    with pytest.raises(ProjectError, match=bound):
        load_project_from(TEMPLATE + "\n[settings.joiner]\nnegative_sample_rate = 2\n", tmp_path)


def test_the_docs_name_every_file_key_and_its_setting(repo_root: Path) -> None:
    """docs/own-data.md's table of sections: each key of FILE_KEYS in its section's row, with the
    setting's variable (in full, as ``__FIELD`` after one in full, or as ``DRIFTLINE_<SECTION>__*``)."""
    doc = (repo_root / "docs" / "own-data.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `\[?([a-z_]+)\]?` \|.*$", doc, re.MULTILINE)}
    for keys, (section, field) in FILE_KEYS.items():
        row = rows[keys[0]]
        assert f"`{keys[-1]}`" in row or len(keys) == 1, keys
        env = f"DRIFTLINE_{section.upper()}__{field.upper()}"
        named = env in row or (f"`__{field.upper()}`" in row and f"DRIFTLINE_{section.upper()}__" in row)
        assert named or f"DRIFTLINE_{section.upper()}__*" in row, (keys, row)
        assert f"[{keys[0]}]" in TEMPLATE or f"\n{keys[0]} = " in TEMPLATE, keys  # `driftline init` shows it
