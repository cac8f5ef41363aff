"""The project file (driftline/project.py): `driftline init` writes a valid one, it builds the
trainer's model and the settings, and the environment still wins over it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from driftline.cli import main
from driftline.project import PROJECT_VAR, Project, ProjectError, apply_to_environ, load_project, named_config
from driftline.project_template import TEMPLATE
from services.settings import Settings


def test_init_writes_a_file_that_loads(tmp_path: Path, capsys) -> None:
    path = tmp_path / "driftline.toml"
    assert main(["init", str(path)]) == 0
    project = load_project(path)
    cfg = project.model_config()
    assert cfg.model_id == project.name and cfg.dense_features == ["price"]
    assert {f.name for f in project.features} == set(cfg.all_slots) | {"price"}
    assert main(["init", str(path)]) == 2  # exists: no silent overwrite
    assert "exists" in capsys.readouterr().err
    assert main(["init", "--check", str(path)]) == 0
    assert named_config(str(path)) == cfg  # trainer.model may name the project file


def test_schema_is_printed_for_editors(capsys) -> None:
    assert main(["init", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"features", "model", "tables", "windows", "warm_start"} <= set(schema["properties"])


def test_yaml_reads_like_toml(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(tomllib.loads(TEMPLATE)))
    (tmp_path / "p.toml").write_text(TEMPLATE)
    assert load_project(tmp_path / "p.yaml").model_config() == load_project(tmp_path / "p.toml").model_config()


def test_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TEMPLATE.replace('kind = "deepfm"', 'kind = "xgboost"'))
    with pytest.raises(ProjectError, match=r"bad.toml: model.kind: Input should be"):
        load_project(bad)
    bad.write_text(TEMPLATE + '\n[[features]]\nname = "price"\nsource = "item"\n')
    with pytest.raises(ProjectError, match="features declared twice: \\['price'\\]"):
        load_project(bad)
    bad.write_text(TEMPLATE + '\n[settings.joinr]\nwindow_seconds = 5\n')
    with pytest.raises(ProjectError, match=r"\[settings.joinr\]: no such settings section"):
        load_project(bad)
    bad.write_text(TEMPLATE + '\n[settings.joiner]\nwindow_secs = 5\n')
    with pytest.raises(ProjectError, match=r"no such settings \['window_secs'\]"):
        load_project(bad)
    with pytest.raises(ProjectError, match="No such file"):
        load_project(tmp_path / "missing.toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_")}
    done = subprocess.run([sys.executable, "-m", "driftline.cli", "up", "--config", str(bad)], env=env,
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("driftline: ") and "no such settings ['window_secs']" in done.stderr


def test_the_environment_wins_over_the_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "driftline.toml"
    path.write_text(TEMPLATE)
    project = load_project(path)
    monkeypatch.setenv("DRIFTLINE_JOINER__WINDOW_SECONDS", "42")
    s = project.resolved_settings()
    assert s.joiner.window_seconds == 42  # the environment
    assert s.joiner.idle_advance_seconds == 30 and s.trainer.dense_sync_interval_s == 60  # the file
    assert s.trainer.model == str(path.resolve()) and s.joiner.label_map == {"click": "click"}
    assert s.joiner.orphan_grace_seconds == Settings().joiner.orphan_grace_seconds  # left out: the default

    environ = {"DRIFTLINE_JOINER__WINDOW_SECONDS": "42"}
    added = apply_to_environ(project, environ)
    assert "DRIFTLINE_JOINER__WINDOW_SECONDS" not in added and environ[PROJECT_VAR] == str(path.resolve())
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    s = Settings()  # what a service started with that environment reads
    assert (s.joiner.window_seconds, s.joiner.idle_advance_seconds, s.trainer.sync_interval_s) == (42, 30, 10)
    assert s.project == path.resolve()


def test_tables_sharing_admission_and_ttl() -> None:
    project = Project.model_validate({
        "name": "shared", "features": [
            {"name": "item_id", "source": "candidate"},
            {"name": "recent", "source": "context", "table": "item_id", "pooling": "mean", "salt": False},
            {"name": "seen", "source": "context", "ids": "string"}],
        "model": {"dim": 4, "linear": ["item_id", "seen"]},
        "tables": {"default": {"admission": {"min_count": 2}, "ttl_seconds": 60},
                   "item_id": {"admission": {"min_count": 3, "probability": 0.5}}}})
    cfg = project.model_config()
    assert cfg.slots == {"item_id": "item_id", "recent": "item_id", "seen": "seen"}
    assert cfg.linear == {"item_id": "item_id_w", "seen": "seen_w"}
    assert cfg.table("item_id").admission.min_count == 3 and cfg.table("item_id").admission.probability == 0.5
    assert cfg.table("seen").admission.min_count == 2 and cfg.table("seen_w").ttl_seconds == 60
    assert cfg.pooling == {"recent": "mean"} and cfg.salt == {"recent": False}
    ignoring = project.model_copy(update={"unknown_features": "ignore"})
    assert ignoring.resolved_settings().serving.unknown_features == "ignore"
    assert project.resolved_settings().serving.unknown_features == Settings().serving.unknown_features
    with pytest.raises(ValueError, match="features \\['pos'\\] are declared but the model reads them in no role"):
        Project.model_validate({"name": "x", "features": [{"name": "item_id", "source": "candidate"},
                                                          {"name": "pos", "source": "candidate"}],
                                "model": {"kind": "lr", "linear": ["item_id"]}})
    stored = Project.model_validate({"name": "x", "features": [{"name": "item_id", "source": "candidate"},
                                                               {"name": "ctr", "source": "user", "kind": "dense"}]})
    assert stored.model_config().dense_features == ["ctr"]  # from the store, served and trained like the others
    with pytest.raises(ValueError, match="model.dense: \\['item_id'\\] are not declared dense"):
        Project.model_validate({"name": "x", "features": [{"name": "item_id", "source": "candidate"}],
                                "model": {"dense": ["item_id"]}})


def test_the_movielens_demo_is_a_project_file_with_admission_and_ttl() -> None:
    """examples/movielens/driftline.toml: the demo's DeepFM layout, admission and TTL on."""
    from trainer.config import deepfm_config

    project = load_project(Path(__file__).parents[1] / "examples" / "movielens" / "driftline.toml")
    cfg, demo = project.model_config(), deepfm_config()
    assert (cfg.slots, cfg.linear, cfg.pooling, cfg.salt) == (demo.slots, demo.linear, demo.pooling, demo.salt)
    assert [t.name for t in cfg.tables] == [t.name for t in demo.tables]
    assert all(t.admission.min_count == 2 and t.ttl_seconds for t in cfg.tables)
    assert project.store.movielens and project.windows.idle_advance_seconds


def test_a_content_feature_feeds_the_encoder_not_a_field() -> None:
    project = Project.model_validate({
        "name": "content", "features": [
            {"name": "item_id", "source": "candidate"}, {"name": "user_id", "source": "context"},
            {"name": "title_words", "source": "item", "ids": "string"}],
        "model": {"dim": 4, "content": {"slot": "title_words", "item_slot": "item_id"}}})
    cfg = project.model_config()
    assert set(cfg.slots) == set(cfg.linear) == {"item_id", "user_id"}
    assert cfg.content is not None and cfg.content.slot == "title_words" and "title_words" in cfg.all_slots


def test_model_pooling_is_the_default_of_features_that_name_none_and_absent_it_is_sum() -> None:
    features = [{"name": "item_id", "source": "candidate"}, {"name": "tags", "source": "item"},
                {"name": "brand", "source": "item", "pooling": "sum"}, {"name": "price", "source": "candidate", "kind": "dense"}]
    cfg = Project.model_validate({"name": "bags", "features": features, "model": {"pooling": "mean"}}).model_config()
    assert cfg.pooling == {"item_id": "mean", "tags": "mean", "brand": "sum"}
    older = Project.model_validate({"name": "bags", "features": features}).model_config()  # a file without the key
    assert older.pooling == {"brand": "sum"}  # the rest: the model's own default, sum, as its snapshots have it
    assert Project.model_validate(tomllib.loads(TEMPLATE)).model_config().pooling["category"] == "mean"


def test_a_deepfm_learns_its_first_order_factors_unless_told_not_to_and_an_lr_does_not() -> None:
    from trainer.config import LINEAR_SCALE_LR

    features = [{"name": "item_id", "source": "candidate"}, {"name": "user_id", "source": "user"}]

    def cfg(**model):
        return Project.model_validate({"name": "f", "features": features, "model": model}).model_config()

    assert cfg().linear_scale_lr == LINEAR_SCALE_LR
    assert cfg(linear_scale=False).linear_scale_lr is None
    assert cfg(kind="lr").linear_scale_lr is None
    assert Project.model_validate(tomllib.loads(TEMPLATE)).model_config().linear_scale_lr == LINEAR_SCALE_LR


def test_a_position_is_one_sparse_int_feature_the_model_knows_as_its_position_slot() -> None:
    def project(*features: dict, model: dict | None = None) -> Project:
        return Project.model_validate({"name": "placed", "features": [{"name": "item_id", "source": "candidate"},
                                                                       *features], "model": model or {"dim": 4}})

    cfg = project({"name": "slot", "source": "position"}).model_config()
    assert cfg.position_slot == "slot" and "slot" in cfg.linear and "slot" not in cfg.slots  # a term, unless named a field
    cfg = project({"name": "slot", "source": "position"}, model={"dim": 4, "fields": ["item_id", "slot"]}).model_config()
    assert cfg.position_slot == "slot" and "slot" in cfg.linear and "slot" in cfg.slots
    with pytest.raises(ValidationError, match="one feature at most has source 'position'"):
        project({"name": "a", "source": "position"}, {"name": "b", "source": "position"})
    for bad in ({"kind": "dense"}, {"ids": "string"}):
        with pytest.raises(ValidationError, match="'slot': a position is a sparse feature of int ids"):
            project({"name": "slot", "source": "position", **bad})
    assert project({"name": "pos", "source": "candidate"}).model_config().position_slot is None


def test_the_store_files_are_the_project_files_folders_and_not_beside_movielens(tmp_path: Path) -> None:
    """``[store] users_file`` / ``items_file``: relative to the project file; with ``movielens = true``
    they are refused (the demo's features are the store's)."""
    config = tmp_path / "shop" / "driftline.toml"
    config.parent.mkdir()
    head = 'name = "shop"\n[[features]]\nname = "item_id"\nsource = "candidate"\n'
    config.write_text(head + '[store]\nitems_file = "items.csv"\nusers_file = "/srv/users.parquet"\n')
    assert load_project(config).feature_files == (Path("/srv/users.parquet"), config.parent / "items.csv")
    config.write_text(head)
    assert load_project(config).feature_files == (None, None)
    config.write_text(head + '[store]\nmovielens = true\nitems_file = "items.csv"\n')
    with pytest.raises(ProjectError, match="movielens = true loads the demo's features; leave out users_file"):
        load_project(config)


def test_embeddings_that_learn_example_by_example_start_their_adagrad_at_the_served_floor(tmp_path: Path) -> None:
    """The template's embedding tables (Adagrad, no initial accumulator named) start at
    ``trainer.config.SPARSE_ACC`` while they learn example by example, at 0 when they learn once per
    batch (a batch's mean gradient is far smaller); first-order tables and a named value keep theirs."""
    from trainer.config import LINEAR_ACC, SPARSE_ACC

    path = tmp_path / "p.toml"
    path.write_text(TEMPLATE)
    accs = {t.name: (t.dim, t.optimizer.initial_accumulator_value) for t in load_project(path).model_config().tables}
    assert {a for d, a in accs.values() if d > 1} == {SPARSE_ACC} and {a for d, a in accs.values() if d == 1} == {LINEAR_ACC}
    path.write_text(TEMPLATE.replace("sequential_embeddings = true", "sequential_embeddings = false"))
    assert {t.optimizer.initial_accumulator_value for t in load_project(path).model_config().tables if t.dim > 1} == {0.0}
    path.write_text(TEMPLATE.replace('optimizer = { kind = "adagrad", lr = 0.05 }',
                                     'optimizer = { kind = "adagrad", lr = 0.05, initial_accumulator_value = 0.1 }'))
    assert {t.optimizer.initial_accumulator_value for t in load_project(path).model_config().tables if t.dim > 1} == {0.1}


def test_an_adagrad_cap_reaches_every_table_that_names_it(tmp_path: Path) -> None:
    """``max_accumulator`` in ``[tables.default]`` and ``[model] linear_optimizer`` (the template's
    comments) caps the embedding and the first-order tables; below the initial accumulator it is a
    one-line error."""
    path = tmp_path / "capped.toml"
    path.write_text(TEMPLATE.replace('optimizer = { kind = "adagrad", lr = 0.05 }',
                                     'optimizer = { kind = "adagrad", lr = 0.05, max_accumulator = 30 }')
                    .replace("initial_accumulator_value = 0.3 }", "initial_accumulator_value = 0.3, max_accumulator = 30 }"))
    cfg = load_project(path).model_config()
    assert {t.optimizer.max_accumulator for t in cfg.tables} == {30.0}, cfg.tables
    path.write_text(TEMPLATE.replace("initial_accumulator_value = 0.3 }", "initial_accumulator_value = 0.3, max_accumulator = 0.1 }"))
    with pytest.raises(ProjectError, match="max_accumulator 0.1 is below initial_accumulator_value 0.3"):
        load_project(path)
