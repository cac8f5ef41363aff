"""``driftline traffic --csv --map``: a 50-row impression log of string users and items, replayed
through a real serving on the session's broker: one /rank per request id, one action per clicked
row, on the topics keyed by the request ids serving returned."""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path

import pytest
from client_helpers import read_topic, served_model
from serving_helpers import running, wait_ready

from driftline.cli import main as cli_main
from driftline.client import InvalidInput, item_id_of
from producers.csv_log import MapFile, load_map, requests_of
from proto import Action, FeatureLog
from ps import AdagradConfig, InitializerConfig, TableConfig
from services.hashing import string_id
from services.settings import Settings
from serving.app import create_app
from serving.model import TrainerModel
from trainer.config import ModelConfig

MAP = """
[columns]
request = "impression"
item = "item"
item_ids = "string"
user = "user"
user_ids = "string"
event_time = "ts"
event_time_unit = "s"

[actions]
click = "clicked"

[features]
device = { column = "device", source = "context", ids = "string" }
pos = { column = "position", source = "candidate" }
price = { column = "price", source = "candidate", kind = "dense" }
"""


def write_log(path: Path, rows: int = 50) -> tuple[int, int]:
    """The log: requests of 1 to 6 candidates, years old, every 7th row clicked; (requests, clicks)."""
    sizes = [1 + n % 6 for n in range(rows)]
    out, n, request = [], 0, 0
    while n < rows:
        for pos in range(min(sizes[request], rows - n)):
            out.append({"impression": f"imp-{request}", "user": f"user-{request % 4}", "item": f"sku-{n % 9}",
                        "ts": 1_600_000_000 + 30 * request, "device": ["ios", "web"][request % 2],
                        "position": pos, "price": round(1.5 * pos, 2), "clicked": int(n % 7 == 0)})
            n += 1
        request += 1
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    return request, sum(r["clicked"] for r in out)


def test_a_csv_log_replays_through_serving(options: Settings, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log, map_file = tmp_path / "log.csv", tmp_path / "map.toml"
    n_requests, n_clicks = write_log(log)
    map_file.write_text(MAP)
    with running(create_app(options, served_model(["item_id", "device", "pos"], ["price"]))) as base:
        wait_ready(base)
        code = cli_main(["traffic", "--csv", str(log), "--map", str(map_file), "--url", base, "--speed", "0", "--no-join-report",
                         "--rebase", "--no-progress"])
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and stats["rank_errors"] == stats["action_errors"] == 0, stats
    assert (stats["requests"], stats["impressions"], stats["actions"]) == (n_requests, 50, n_clicks)

    logs = asyncio.run(read_topic(options, options.topics.features, FeatureLog, n_requests))
    actions = asyncio.run(read_topic(options, options.topics.actions, Action, n_clicks))
    assert len(logs) == n_requests and len(actions) == n_clicks
    by_id = {m.request_id: m for _, _, m in logs}
    assert all(k == m.request_id.encode() for k, _, m in logs + actions)
    for _, _, a in actions:  # each action names an impression serving logged, with its time and user
        impression = by_id[a.request_id]
        assert a.item_id in {c.item_id for c in impression.candidates} and a.user_id == impression.user_id
        assert a.event_time_ms == impression.event_time_ms and a.action_type == "click"
    first = min(by_id.values(), key=lambda m: m.event_time_ms)
    assert first.user_id == item_id_of("user-0") and list(first.context.sparse["device"].ids) == [string_id("ios")]
    assert [c.item_id for c in first.candidates] == [item_id_of("sku-0")]
    assert dict(first.candidates[0].features.dense) == {"price": 0.0}
    # rebased: the spacing of the log kept, its last request now
    times = sorted(m.event_time_ms for m in by_id.values())
    assert times[-1] - times[0] == 30_000 * (n_requests - 1)


def test_a_logs_positions_are_replayed_as_the_log_gives_them(options: Settings, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """A model with a position feature: the log's places (counted from 1 here) reach serving as given
    and are logged as such, not re-placed by serving's ranking of the replayed request."""
    log, map_file = tmp_path / "log.csv", tmp_path / "map.toml"
    # (rows not in the places' order: serving's own placing of equal scores would be the rows')
    log.write_text("impression,item,position,clicked\n" + "".join(
        f"imp-{r},{item},{place},{int(place == 1)}\n" for r in range(3) for place, item in ((3, 7), (1, 8), (2, 9))))
    map_file.write_text('[columns]\nrequest = "impression"\nitem = "item"\nposition_base = 1\n\n'
                        '[actions]\nclick = "clicked"\n\n[features]\npos = { column = "position", source = "position" }\n')
    table = TableConfig(name="w", dim=1, optimizer=AdagradConfig(lr=0.05), initializer=InitializerConfig(kind="zeros"))
    model = TrainerModel(config=ModelConfig(model_id="client", kind="lr", linear={"item_id": "w", "pos": "w"},
                                            tables=[table], mlp=[], position_slot="pos"))
    with running(create_app(options, model)) as base:
        wait_ready(base)
        code = cli_main(["traffic", "--csv", str(log), "--map", str(map_file), "--url", base, "--speed", "0",
                         "--no-join-report", "--no-progress"])
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and stats["rank_errors"] == stats["action_errors"] == 0 and stats["requests"] == 3, stats
    logs = [m for _, _, m in asyncio.run(read_topic(options, options.topics.features, FeatureLog, 100, timeout=5))]
    placed = [{c.item_id: list(c.features.sparse["pos"].ids) for c in m.candidates} for m in logs
              if {c.item_id for c in m.candidates} == {7, 8, 9}]
    assert placed and all(p == {7: [2], 8: [0], 9: [1]} for p in placed), placed


def test_a_map_that_does_not_fit_the_log_names_the_culprit(tmp_path: Path) -> None:
    spec = MapFile.model_validate({"columns": {"item": "item"}, "features": {"pos": {"column": "position", "source": "candidate"}}})
    with pytest.raises(InvalidInput, match=r"line 2: no column 'position'"):
        requests_of([{"item": "1"}], spec, spec.feature_specs(None))
    with pytest.raises(InvalidInput, match=r"line 3: item 'x' is not an int \(say item_ids = \"string\""):
        requests_of([{"item": "1", "position": "0"}, {"item": "x", "position": "0"}], spec, spec.feature_specs(None))
    bare = MapFile.model_validate({"columns": {"item": "item"}, "features": {"device": "device"}})
    with pytest.raises(InvalidInput, match="feature 'device' is not in the project's features .pass --config"):
        bare.feature_specs(None)
    (tmp_path / "bad.toml").write_text("[columns]\nitem = 'item'\nitme_ids = 'string'\n")
    with pytest.raises(InvalidInput, match="itme_ids"):
        load_map(tmp_path / "bad.toml")


def test_traffic_help_lists_both_modes_flags(capsys: pytest.CaptureFixture) -> None:
    """``driftline traffic --help`` shows the MovieLens replay's flags and those of a user's own log."""
    assert cli_main(["traffic", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--dataset", "--start-fraction", "--csv", "--parquet", "--map", "--config", "--rebase", "--speed"):
        assert flag in out, flag


def test_a_map_file_lists_features_read_from_columns_of_their_names(tmp_path: Path) -> None:
    """docs/own-data.md's map: ``features = [...]`` before the tables, specs from the project."""
    from driftline.project import FeatureSpec

    path = tmp_path / "map.toml"
    path.write_text('features = ["segment", "price"]\n\n[columns]\nitem = "sku"\n\n[actions]\nclick = "clicked"\n')
    project = [FeatureSpec(name="segment", source="context", ids="string"),
               FeatureSpec(name="price", source="candidate", kind="dense")]
    specs = load_map(path).feature_specs(project)
    assert [(spec.name, column) for spec, column in specs] == [("segment", "segment"), ("price", "price")]
    rows = [{"sku": "1", "segment": "pros", "price": "2.5", "clicked": "1"}]
    [req] = requests_of(rows, load_map(path), specs)
    assert req.context == {"segment": "pros"} and req.candidates[0]["features"] == {"price": 2.5}


def test_a_parquet_log_gives_the_requests_of_the_same_csv(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``traffic --parquet``: the log as a typed Parquet file (ints, floats, a timestamp column, a
    list of tags) reads to the requests of the CSV holding the same rows, with the same map."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from producers.csv_log import parquet_rows

    write_log(tmp_path / "log.csv")
    (tmp_path / "map.toml").write_text(MAP + 'tags = { column = "tags", source = "candidate" }\n')
    spec = load_map(tmp_path / "map.toml")
    with open(tmp_path / "log.csv", newline="") as f:
        rows = [dict(r, tags="3|4") for r in csv.DictReader(f)]
    spec = spec.model_copy(update={"csv": spec.csv.model_copy(update={"list_separator": "|"})})
    from_csv = requests_of(rows, spec, spec.feature_specs(None))
    table = pa.table({
        **{c: [r[c] for r in rows] for c in ("impression", "user", "item", "device")},
        "ts": pa.array([int(r["ts"]) * 1000 for r in rows], pa.timestamp("ms")),
        "position": [int(r["position"]) for r in rows], "price": [float(r["price"]) for r in rows],
        "clicked": [r["clicked"] == "1" for r in rows], "tags": [[3, 4] for _ in rows]})
    pq.write_table(table, tmp_path / "log.parquet")
    from_parquet = requests_of(parquet_rows(tmp_path / "log.parquet", spec), spec, spec.feature_specs(None))
    assert from_parquet == from_csv and len(from_csv) > 10
    assert from_csv[0].candidates[0]["features"]["tags"] == [3, 4]
    # the flag: not a Parquet file is one line and exit 2
    assert cli_main(["traffic", "--parquet", str(tmp_path / "log.csv"), "--map", str(tmp_path / "map.toml")]) == 2
    assert "not a readable Parquet file" in capsys.readouterr().err


def test_a_log_older_than_serving_accepts_is_refused_before_a_request_goes_out(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A log spanning more than ``event_time.max_past_s`` would come back 422 request after request:
    traffic says so once, naming the setting and the value that fits, and sends nothing (no
    serving is listening at the URL)."""
    write_log(tmp_path / "log.csv", rows=2000)  # 30 s apart, years ago: even rebased it spans hours
    (tmp_path / "map.toml").write_text(MAP)
    (tmp_path / "driftline.toml").write_text('name = "shop"\n\n[settings.event_time]\nmax_past_s = 3600\n\n'
                                             '[[features]]\nname = "device"\nsource = "context"\nids = "string"\n\n'
                                             '[[features]]\nname = "pos"\nsource = "candidate"\n\n'
                                             '[[features]]\nname = "price"\nsource = "candidate"\nkind = "dense"\n')
    args = ["traffic", "--csv", str(tmp_path / "log.csv"), "--map", str(tmp_path / "map.toml"),
            "--url", "http://127.0.0.1:9", "--no-join-report", "--ready-timeout", "1"]
    assert cli_main(args) == 2
    assert "serving refuses events older than 7.0 days (event_time.max_past_s = 604800)" in capsys.readouterr().err
    assert cli_main([*args, "--rebase", "--config", str(tmp_path / "driftline.toml")]) == 2
    err = capsys.readouterr().err
    assert "the log spans 0.2 days up to 0.0 days ago" in err and "(event_time.max_past_s = 3600); raise it above" in err
