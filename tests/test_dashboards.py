"""Every metric a Grafana dashboard queries is one our services export.

A real stack (``driftline up``, shared with tests/test_loop.py) is scraped on every service's
``/metrics``; every PromQL expression in ``deploy/grafana/dashboards/*.json`` (panel targets and
template queries) is reduced to the metric names it reads, and each must be exported. A metric
counts as exported when its family is declared (``# TYPE``) even without samples yet, because a
labelled counter shows no sample until its first event (a late action, a dead letter).
``name_bucket`` / ``name_sum`` / ``name_count`` are read as the histogram or summary ``name``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.loopstack import LoopStack
from tests.test_loop import loop_stack  # noqa: F401 - the shared stack fixture

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan", "atan2"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABELS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads.

    >>> sorted(metric_names('histogram_quantile(0.99, sum by (le, endpoint) '
    ...                     '(rate(http_seconds_bucket{endpoint=~"/rank|/x"}[$__rate_interval])))'))
    ['http_seconds_bucket']
    >>> sorted(metric_names('sum(rate(a_total[1m])) / ignoring(kind) group_left b{kind="x"} > bool 0'))
    ['a_total', 'b']
    >>> sorted(metric_names('min by (stream) (wm_ms) offset 5m'))
    ['wm_ms']
    >>> sorted(metric_names('label_values(driftline_service_up, service)'))
    ['driftline_service_up']
    """
    e = _STRING.sub('""', expr)
    e = _LABELS.sub("", e)
    e = _RANGE.sub("", e)
    e = _GROUPING.sub("", e)
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)[^)]*\)\s*", e)
    if m:  # Grafana's template function: its first argument is a metric, the second a label
        return {m.group(1)}
    e = re.sub(r"(?<![\w:])\d+(\.\d+)?(e[+-]?\d+)?[smhdwy]?\b", " ", e)  # numbers, durations
    return {n for n in _IDENT.findall(e) if n.lower() not in _KEYWORDS}


def dashboard_expressions(root: Path) -> dict[str, list[str]]:
    """Dashboard file -> every PromQL expression in it (panels, nested rows, template queries)."""
    out: dict[str, list[str]] = {}

    def walk(node: object, found: list[str]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str) and value.strip():
                    found.append(value)
                elif key == "query" and isinstance(value, (str, dict)):
                    q = value if isinstance(value, str) else value.get("query", "")
                    if q:
                        found.append(q)
                else:
                    walk(value, found)
        elif isinstance(node, list):
            for item in node:
                walk(item, found)

    for path in sorted((root / "deploy" / "grafana" / "dashboards").glob("*.json")):
        found: list[str] = []
        walk(json.loads(path.read_text()), found)
        out[path.name] = found
    return out


def exported(bodies: dict[str, str]) -> tuple[set[str], set[str]]:
    """(every family or sample name, the histogram/summary family names) over all scrapes."""
    names, distributions = set(), set()
    for body in bodies.values():
        for line in body.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                names.add(name)
                if kind.strip() in ("histogram", "summary", "gaugehistogram"):
                    distributions.add(name)
            elif line and not line.startswith("#"):
                names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names, distributions


def is_exported(name: str, names: set[str], distributions: set[str]) -> bool:
    if name in names:
        return True
    m = re.fullmatch(r"(.+)_(bucket|sum|count)", name)
    return bool(m) and m.group(1) in distributions


def test_metric_names_of_promql() -> None:
    import doctest

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(metric_names, "metric_names", globs={"metric_names": metric_names}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert metric_names('sum by (topic) (rate(x_total{a="b(c)"}[5m]))') == {"x_total"}
    assert metric_names("topk(5, sum without (instance) (foo2)) * on (job) group_left (le) bar:rate5m") == {
        "foo2", "bar:rate5m"}
    assert metric_names("histogram_quantile(0.5, rate(h_bucket[$__rate_interval])) > 1e-3") == {"h_bucket"}


def test_dashboards_are_valid_and_provisioned(repo_root: Path) -> None:
    exprs = dashboard_expressions(repo_root)
    assert exprs, "no dashboard JSON under deploy/grafana/dashboards/"
    uids = set()
    for name in exprs:
        dash = json.loads((repo_root / "deploy/grafana/dashboards" / name).read_text())
        assert dash["uid"] not in uids
        uids.add(dash["uid"])
        for panel in dash["panels"]:
            if panel["type"] != "row":
                assert panel["targets"], panel["title"]
                assert panel["datasource"]["uid"] == "prometheus", panel["title"]
    ds = yaml.safe_load((repo_root / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert [d["uid"] for d in ds["datasources"]] == ["prometheus"]
    prov = yaml.safe_load((repo_root / "deploy/grafana/provisioning/dashboards/driftline.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    grafana = yaml.safe_load((repo_root / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts[path] == "./deploy/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"


def test_the_panels_cover_the_loop(repo_root: Path) -> None:
    """The issue's panel list: each of these is queried by some dashboard."""
    wanted = {
        "driftline_serving_requests_total", "driftline_serving_request_seconds_bucket",  # traffic, latency
        "driftline_joiner_joined_actions_total", "driftline_joiner_negatives_total",
        "driftline_joiner_late_actions_total", "driftline_joiner_spilled_total",  # joiner rates
        "driftline_trainer_examples_per_second", "driftline_trainer_auc", "driftline_trainer_loss",
        "driftline_trainer_sync_bytes_sum", "driftline_trainer_sync_delay_seconds_bucket",  # trainer
        "driftline_serving_model_version", "driftline_serving_model_staleness_seconds",  # serving model
        "driftline_trainer_table_rows", "driftline_ps_admitted_total", "driftline_ps_evicted_total",  # PS
        "driftline_consumer_lag_messages",  # lag per topic
    }
    used = {n for exprs in dashboard_expressions(repo_root).values() for e in exprs for n in metric_names(e)}
    assert wanted <= used, wanted - used


@pytest.fixture(scope="module")
def scraped(loop_stack: LoopStack) -> dict[str, str]:  # noqa: F811 - the imported fixture
    """Every service's /metrics, once traffic has gone all the way round (examples trained on)."""
    s = loop_stack
    s.wait_for("examples trained on", lambda: (s.metric("trainer", "driftline_trainer_examples_total") or 0) > 0, 180)
    s.wait_for("a parameter sync", lambda: s.metric("trainer", "driftline_trainer_sync_bytes_count") or 0, 120)
    bodies = {}
    for service, url in s.metrics_urls().items():
        status, body = s.get(url)
        assert status == 200, f"{service} {url}: HTTP {status}"
        bodies[service] = body
    return bodies


@pytest.mark.timeout(420)
def test_every_dashboard_metric_is_exported(repo_root: Path, scraped: dict[str, str]) -> None:
    names, distributions = exported(scraped)
    missing = {}
    for dashboard, exprs in dashboard_expressions(repo_root).items():
        for expr in exprs:
            for name in metric_names(expr):
                if not is_exported(name, names, distributions):
                    missing.setdefault(name, []).append(f"{dashboard}: {expr}")
    assert not missing, "queried but exported by no service:\n" + json.dumps(missing, indent=1)
