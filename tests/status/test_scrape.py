"""The scraper and its series, against real HTTP servers serving canned Prometheus text."""

from __future__ import annotations

import httpx
import pytest

from driftline.stack import status_targets
from services.ports import free_port
from services.settings import Settings
from status.options import StatusSettings, Target, parse_target, resolve_targets
from status.scrape import Scraper
from tests.status.fakestack import MetricsServer

OPTS = StatusSettings(scrape_timeout_s=1.0, rate_window_s=10.0, history_points=5)


def serving_text(ok: int, errors: int, le: dict[str, int], version: int) -> str:
    """A serving /metrics page: /rank counts, a latency histogram, model versions."""
    total = le["+Inf"]
    lines = [
        "# TYPE driftline_serving_requests_total counter",
        f'driftline_serving_requests_total{{endpoint="/rank",status="200"}} {ok}',
        f'driftline_serving_requests_total{{endpoint="/rank",status="503"}} {errors}',
        'driftline_serving_requests_total{endpoint="/actions",status="200"} 1000',
        "# TYPE driftline_serving_request_seconds histogram",
        *(f'driftline_serving_request_seconds_bucket{{endpoint="/rank",le="{b}"}} {n}' for b, n in le.items()),
        f'driftline_serving_request_seconds_sum{{endpoint="/rank"}} {0.003 * total}',
        f'driftline_serving_request_seconds_count{{endpoint="/rank"}} {total}',
        'driftline_serving_request_seconds_bucket{endpoint="/actions",le="+Inf"} 1000',
        "# TYPE driftline_serving_model_version gauge",
        f'driftline_serving_model_version{{model_id="deepfm",kind="sparse"}} {version}',
        f'driftline_serving_model_version{{model_id="deepfm",kind="dense"}} {version // 5}',
        'driftline_serving_model_staleness_seconds{model_id="deepfm",kind="sparse"} 1.5',
        "process_cpu_seconds_total 12.0",
    ]
    return "\n".join(lines) + "\n"


def trainer_text(auc: float, examples: int, rows: int, event_ms: float | None = None) -> str:
    lines = [
        "# TYPE driftline_trainer_auc gauge",
        f'driftline_trainer_auc{{model="deepfm",mode="online"}} {auc}',
        'driftline_trainer_auc{model="deepfm",mode="batch"} 0.99',
        'driftline_trainer_loss{model="deepfm",mode="online"} 0.5',
        "# TYPE driftline_trainer_examples_total counter",
        f'driftline_trainer_examples_total{{model="deepfm",mode="online"}} {examples}',
        f'driftline_trainer_table_rows{{model="deepfm",table="user_id"}} {rows}',
        f'driftline_trainer_table_rows{{model="deepfm",table="movie_id"}} {rows // 2}',
        'driftline_consumer_lag_messages{service="trainer",topic="examples",partition="0"} 5',
        'driftline_consumer_lag_messages{service="trainer",topic="examples",partition="1"} 7',
    ]
    if event_ms is not None:
        lines.append(f'driftline_trainer_event_time_ms{{model="deepfm"}} {event_ms}')
    return "\n".join(lines) + "\n"


def joiner_text(wm_ms: float) -> str:
    return "\n".join([
        f'driftline_joiner_watermark_ms{{stream="actions",partition="0"}} {wm_ms}',
        f'driftline_joiner_watermark_ms{{stream="actions",partition="1"}} {wm_ms - 5000}',
        f'driftline_joiner_watermark_ms{{stream="features",partition="0"}} {wm_ms + 60000}',
        'driftline_joiner_watermark_lag_seconds{stream="actions",partition="0"} 100',
        'driftline_joiner_watermark_lag_seconds{stream="actions",partition="1"} 105',
    ]) + "\n"


LE0 = {"0.001": 0, "0.002": 0, "0.005": 0, "0.01": 0, "+Inf": 0}


@pytest.fixture
def servers():
    started: list[MetricsServer] = []

    def start(text: str = "") -> MetricsServer:
        s = MetricsServer(text)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


async def test_rates_quantiles_and_gauges_from_two_scrapes(servers) -> None:
    serving = servers(serving_text(100, 0, LE0 | {"0.001": 10, "0.002": 50, "0.005": 90, "0.01": 100, "+Inf": 100}, 3))
    trainer = servers(trainer_text(0.61, 1000, 4000))
    joiner = servers(joiner_text(978_300_000_000))
    targets = [Target("serving", serving.url), Target("trainer", trainer.url), Target("joiner", joiner.url)]
    async with Scraper(targets, OPTS) as scraper:
        first = await scraper.scrape_once(now=1000.0)
        # One scrape: gauges are there, rates are not (a rate needs two scrapes in the window).
        assert first["auc:deepfm"] == pytest.approx(0.61)
        assert first.get("rank_rps") is None
        assert first["rank_p99_ms"] is None
        assert first["model_version:sparse"] == 3 and first["model_version:dense"] == 0
        assert first["table_rows:user_id"] == 4000 and first["table_rows:movie_id"] == 2000
        assert first["consumer_lag:trainer/examples"] == 12
        assert first["watermark_lag_s:actions"] == 105
        # Without the trainer's own event time, the joiner's action watermark (max) is the x axis.
        assert first["event_time_s"] == pytest.approx(978_300_000.0)
        assert "joiner_watermark_ms" in scraper.meta["event_time_source"]

        # 2 s later: 400 more /rank requests (20 of them 503s), all in the (2 ms, 5 ms] bucket.
        serving.text = serving_text(480, 20, {"0.001": 10, "0.002": 50, "0.005": 490, "0.01": 500, "+Inf": 500}, 4)
        trainer.text = trainer_text(0.66, 3000, 4100, event_ms=978_300_600_000)
        second = await scraper.scrape_once(now=1002.0)

    assert second["rank_rps"] == pytest.approx(400 / 2)
    assert second["rank_error_rps"] == pytest.approx(20 / 2)
    # p50 of the 400 new ones: rank 200 of 400 in (2, 5] ms holding 400 -> 2 + 3 * 200/400 = 3.5 ms
    assert second["rank_p50_ms"] == pytest.approx(3.5)
    # p99: rank 396 of 400 -> 2 + 3 * 396/400 ms
    assert second["rank_p99_ms"] == pytest.approx(2 + 3 * 396 / 400)
    assert second["train_rate:deepfm"] == pytest.approx(1000)
    assert second["model_version:sparse"] == 4
    assert second["auc:deepfm"] == pytest.approx(0.66)
    # The trainer's own event time wins over the joiner's watermark once it is exported.
    assert second["event_time_s"] == pytest.approx(978_300_600.0)
    assert scraper.meta["event_time_source"] == "driftline_trainer_event_time_ms"

    snap = scraper.snapshot()
    assert snap["t"] == [1000.0, 1002.0]
    assert snap["series"]["auc:deepfm"] == [pytest.approx(0.61), pytest.approx(0.66)]
    assert snap["series"]["rank_rps"] == [None, pytest.approx(200)]
    assert [t["up"] for t in snap["targets"]] == [True, True, True]
    assert scraper.snapshot(since=1000.0)["t"] == [1002.0]


def rank_text(rank: int, examples: int, steps: int, comm_s: float) -> str:
    """One rank of a distributed trainer's own /metrics."""
    lab = f'model="deepfm",rank="{rank}"'
    return "\n".join([f"driftline_trainer_rank_examples_total{{{lab}}} {examples}",
                      f"driftline_trainer_rank_steps_total{{{lab}}} {steps}",
                      f"driftline_trainer_rank_comm_seconds_total{{{lab}}} {comm_s}"]) + "\n"


async def test_per_rank_rates_and_communication_per_step(servers) -> None:
    """Two ranks, each on its own /metrics: examples/s and ms in collectives per step, by rank."""
    r0, r1 = servers(rank_text(0, 1000, 10, 0.05)), servers(rank_text(1, 900, 10, 0.04))
    async with Scraper([Target("trainer", r0.url), Target("trainer-rank-1", r1.url)], OPTS) as scraper:
        first = await scraper.scrape_once(now=1000.0)
        assert first.get("rank_train_rate:0") is None  # a rate needs two scrapes
        r0.text, r1.text = rank_text(0, 3000, 30, 0.25), rank_text(1, 2000, 30, 0.14)
        second = await scraper.scrape_once(now=1002.0)
    assert second["rank_train_rate:0"] == pytest.approx(1000) and second["rank_train_rate:1"] == pytest.approx(550)
    assert second["rank_comm_ms:0"] == pytest.approx(10.0) and second["rank_comm_ms:1"] == pytest.approx(5.0)


def faults_text(disk_paused: int, elsewhere: int, emptied: int, refused: dict[str, int], unavailable: int,
                rebuilding: int = 0, claimed: int = 0, refused_commits: int = 0, unanswered: int = 0) -> str:
    """The fault flags of one service's /metrics (every target exports its own; one here)."""
    return "\n".join([
        f'driftline_disk_paused{{service="trainer"}} {disk_paused}',
        f"driftline_trainer_group_partitions_elsewhere {elsewhere}",
        f"driftline_trainer_claim_partitions_elsewhere {claimed}",
        f"driftline_trainer_offset_commits_refused {refused_commits}",
        f'driftline_offset_commits_unanswered{{service="joiner"}} {unanswered}',
        f"driftline_joiner_changelog_rebuild_remaining {rebuilding}",
        f"driftline_serving_feature_store_emptied {emptied}",
        "driftline_serving_feature_store_evicted 0",
        *(f'driftline_serving_deltas_skipped_total{{reason="{r}"}} {n}' for r, n in refused.items()),
        f"driftline_serving_feature_store_unavailable_total {unavailable}",
        f'driftline_dead_letters_total{{service="joiner",topic="features",kind="decode"}} {unavailable // 2}',
    ]) + "\n"


async def test_problems_are_the_flags_up_and_the_counters_that_grew_in_the_window(servers) -> None:
    """A gauge flag is a problem while it is up; a counter, while it grew within the rate window
    (stale and other-model deltas are routine: not problems). A target that is down has its badge."""
    quiet = {"stale": 5, "other_model": 1, "non_finite": 0, "bad_shape": 0}
    svc = servers(faults_text(0, 0, 0, quiet, 3))
    down = Target("dumper", f"http://127.0.0.1:{free_port()}/metrics")
    async with Scraper([Target("svc", svc.url), down], OPTS) as scraper:
        await scraper.scrape_once(now=1000.0)
        assert scraper.snapshot()["problems"] == []
        svc.text = faults_text(1, 3, 1, quiet | {"stale": 9, "non_finite": 2, "bad_shape": 1}, 5, rebuilding=41_000,
                               claimed=2, refused_commits=1, unanswered=1)
        await scraper.scrape_once(now=1002.0)
        problems = scraper.snapshot()["problems"]
        assert {p["target"] for p in problems} == {"svc"}
        text = "\n".join(p["problem"] for p in problems)
        assert len(problems) == 10, text
        assert "joiner's offset commits get no answer from the broker" in text
        assert "rebuilding the join state of partitions it took over from the changelog: 41000 records left" in text
        assert "the disk under trainer's data is nearly full" in text
        assert "another consumer in the trainer's group holds 3 partitions" in text
        assert "another trainer reads the same examples under the same trainer group" in text
        assert "claims 2 partitions" in text
        assert "the broker refuses the trainer's offset commits" in text
        assert "the feature store lost the loaded features" in text
        assert "parameter-delta chunks refused in the last 10 s: 3 (bad_shape, non_finite)" in text
        assert "/rank requests answered 503 in the last 10 s because the feature store did not answer in time: 2" in text
        assert "records dead-lettered in the last 10 s: 1 (features: decode)" in text
        # the flags cleared, the counters still: the increases leave the window
        svc.text = faults_text(0, 0, 0, quiet | {"stale": 9, "non_finite": 2, "bad_shape": 1}, 5)
        await scraper.scrape_once(now=1013.0)
        await scraper.scrape_once(now=1024.0)
        assert scraper.snapshot()["problems"] == []


async def test_a_service_down_leaves_a_gap_and_a_red_badge_never_an_exception(servers) -> None:
    serving = servers(serving_text(0, 0, LE0, 1))
    trainer = servers(trainer_text(0.6, 0, 10))
    closed = f"http://127.0.0.1:{free_port()}/metrics"
    broken = servers("this is { not prometheus text\n")
    failing = servers("")
    failing.status = 500
    targets = [Target("serving", serving.url), Target("trainer", trainer.url), Target("dumper", closed),
               Target("broken", broken.url), Target("failing", failing.url)]
    async with Scraper(targets, OPTS) as scraper:
        await scraper.scrape_once(now=10.0)
        trainer.stop()  # the trainer goes down
        serving.text = serving_text(20, 0, LE0 | {"0.001": 20, "+Inf": 20}, 2)
        await scraper.scrape_once(now=12.0)

    snap = scraper.snapshot()
    badges = {b["name"]: b for b in snap["targets"]}
    assert badges["serving"]["up"] is True
    assert badges["trainer"]["up"] is False and badges["trainer"]["last_ok"] == 10.0
    assert badges["dumper"]["up"] is False and "Connect" in badges["dumper"]["last_error"]
    assert badges["broken"]["up"] is False and badges["broken"]["last_error"]
    assert badges["failing"]["up"] is False and badges["failing"]["last_error"] == "HTTP 500"
    assert badges["dumper"]["errors"] == 2
    # The trainer's series have a gap where it was down; serving's go on.
    assert snap["series"]["auc:deepfm"] == [pytest.approx(0.6), None]
    assert snap["series"]["model_version:sparse"] == [1, 2]
    assert snap["series"]["rank_rps"][-1] == pytest.approx(10)
    # what is wrong now: the trainer, which answered before, stopped; the others never answered (their badges)
    assert [(p["target"], p["problem"].split(" (")[0]) for p in snap["problems"]] == [
        ("trainer", "stopped answering 2 s ago")]


async def test_restarted_service_counter_reset_counts_from_zero(servers) -> None:
    serving = servers(serving_text(1000, 0, LE0, 1))
    async with Scraper([Target("serving", serving.url)], OPTS) as scraper:
        await scraper.scrape_once(now=0.0)
        serving.text = serving_text(30, 0, LE0, 1)  # restarted: the counter began again
        point = await scraper.scrape_once(now=2.0)
    assert point["rank_rps"] == pytest.approx(15)


async def test_rates_use_the_window_and_history_is_bounded(servers) -> None:
    serving = servers()
    async with Scraper([Target("serving", serving.url)], OPTS) as scraper:
        for i in range(12):  # one scrape every 2 s, 100 requests each
            serving.text = serving_text(100 * i, 0, LE0, i)
            point = await scraper.scrape_once(now=2.0 * i)
        # The baseline is the oldest scrape within 10 s: t=12 for t=22 -> (1100-600)/10.
        assert point["rank_rps"] == pytest.approx(50)
        snap = scraper.snapshot()
        assert len(snap["t"]) == OPTS.history_points == 5
        assert snap["series"]["model_version:sparse"] == [7, 8, 9, 10, 11]
        # Raw samples are kept only as long as the slowest window needs.
        assert all(t >= 22 - scraper.keep_s for t, _ in scraper.states[0].history)


async def test_nan_auc_is_a_gap_not_invalid_json(servers) -> None:
    trainer = servers(trainer_text(float("nan"), 0, 0))
    async with Scraper([Target("trainer", trainer.url)], OPTS) as scraper:
        await scraper.scrape_once(now=1.0)
    snap = scraper.snapshot()
    assert snap["series"]["auc:deepfm"] == [None]
    httpx.Response(200, json=snap)  # serialisable (no NaN)


def test_targets_default_to_every_service_of_the_stack() -> None:
    settings = Settings(embedded={"metrics_port_base": 9300}, serving={"port": 8123})
    targets = {t.name: t.url for t in status_targets(settings)}
    assert targets["joiner"] == "http://127.0.0.1:9300/metrics"
    assert targets["dumper"] == "http://127.0.0.1:9301/metrics"
    assert targets["trainer"] == "http://127.0.0.1:9302/metrics"
    assert targets["serving"] == "http://127.0.0.1:8123/metrics"
    assert "features-load" not in targets and "feature-keeper" not in targets
    assert not any(name.startswith("trainer-rank") for name in targets)
    ranks = {t.name: t.url for t in status_targets(settings.updated(trainer={"nproc": 3}))}
    assert ranks["trainer-rank-1"] == "http://127.0.0.1:9402/metrics"  # the trainer's port + r * 100
    assert ranks["trainer-rank-2"] == "http://127.0.0.1:9502/metrics"
    configured = resolve_targets(StatusSettings(targets=["a=http://h:1/metrics", "http://h:2/metrics"]))
    assert configured == [Target("a", "http://h:1/metrics"), Target("h:2", "http://h:2/metrics")]
    assert parse_target(" x = http://h:3/metrics ") == Target("x", "http://h:3/metrics")


def test_every_problem_reads_a_metric_a_service_exports() -> None:
    """The problems' metric names are the services' own (a renamed metric would silence its flag)."""
    import importlib

    from prometheus_client import REGISTRY

    from status.problems import FLAGS, SURGES

    for module in ("services.disk", "services.metrics", "services.unanswered_commits", "trainer.metrics", "serving.metrics",
                   "joiner.metrics"):  # (each registers its metrics)
        importlib.import_module(module)
    families = list(REGISTRY.collect())
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert [rule.metric for rule in (*FLAGS, *SURGES) if rule.metric not in exported] == []
