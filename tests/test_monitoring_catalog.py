"""The metric catalog follows Prometheus conventions, and dashboards and alert rules use only what it exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from monitoring_support import ALERT_RULES, DASHBOARDS, GRAFANA
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from monitoring import metrics

# Label names whose values come from a small fixed set; an id-like label would grow without bound.
ALLOWED_LABELS = {"position", "length_class", "coefficient", "reason"}
METRIC_NAME = re.compile(r"\b(das_[a-z0-9_]+)\b")
# Every series name a dashboard or rule may use: ours, and those of the systems Prometheus scrapes beside them.
SERIES_NAME = re.compile(
    r"(?<![\w:])((?:das|kafka|ray)_[a-z0-9_]+|vllm:[a-z0-9_]+|up|process_start_time_seconds)\b"
)
# `rate(x[...])` / `increase(x[...])` over a series; the function needs a counter or histogram series.
RATE_CALL = re.compile(r"\b(?:rate|increase|irate)\(\s*((?:das|kafka|ray)_[a-z0-9_]+|vllm:[a-z0-9_]+)")
QUANTILE_CALL = re.compile(r"histogram_quantile\([^,]+,(?P<body>.*)", re.DOTALL)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Recorded from the real systems (see each file's header), never written by hand.
RECORDED = {"kafka_": "kafka_jmx_metrics.txt", "vllm:": "vllm_metrics.txt", "ray_": "ray_metrics.txt"}
# Series every scraped target has: Prometheus' own `up`, and the process collector of DAS's Python servers.
STANDARD_SERIES = {"up": "gauge", "process_start_time_seconds": "gauge"}


def recorded_series(path: Path) -> dict[str, str]:
    """Sample name -> metric type, from a recorded /metrics page (Prometheus text format)."""
    series = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            series[sample.name] = family.type
    return series


def known_series() -> dict[str, str]:
    """Every series a query may name, with its type: the DAS catalog, the recordings and the standard ones."""
    series = {**metrics.catalog_series(), **STANDARD_SERIES}
    for name in RECORDED.values():
        series.update(recorded_series(FIXTURES / name))
    return series


def dashboard_expressions() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of every dashboard panel."""
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                yield f"{path.name}: {panel['title']} {target['refId']}", target["expr"]


def alert_expressions() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every alert rule."""
    for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"alerts.yml: {rule['alert']}", rule["expr"]


EXPRESSIONS = list(dashboard_expressions()) + list(alert_expressions())


def test_catalog_names_follow_prometheus_conventions() -> None:
    names = [metric._name for metric in metrics.CATALOG]
    assert len(names) == len(set(names)), "a metric is defined twice"
    for metric in metrics.CATALOG:
        name, kind = metric._name, metric._type
        assert name.startswith("das_"), name
        assert metric._documentation, f"{name} has no help text"
        assert not name.endswith("_total"), f"{name}: the client adds _total to counters"
        if kind == "histogram":
            assert name.endswith(("_seconds", "_tokens", "_bytes")), f"{name}: histogram without a base unit"
        assert set(metric._labelnames) <= ALLOWED_LABELS, f"{name}: labels {metric._labelnames}"


def test_every_catalog_metric_is_a_module_level_name() -> None:
    module_objects = {id(value) for value in vars(metrics).values()}
    assert all(id(metric) in module_objects for metric in metrics.CATALOG)
    defined = [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]
    assert {id(metric) for metric in defined} == {id(metric) for metric in metrics.CATALOG}, (
        "a metric is defined in monitoring/metrics.py but missing from CATALOG"
    )


def test_position_label_is_bounded() -> None:
    assert [metrics.position_label(i) for i in (0, 15, 16, 1000)] == ["0", "15", "16+", "16+"]
    with pytest.raises(ValueError, match="position"):
        metrics.position_label(-1)


def test_exported_series_follow_the_metric_type() -> None:
    assert metrics.exported_series(metrics.DRAFTS) == {"das_drafts_total": "counter"}
    assert set(metrics.exported_series(metrics.FRESHNESS)) == {
        "das_freshness_seconds_bucket",
        "das_freshness_seconds_sum",
        "das_freshness_seconds_count",
    }
    assert metrics.exported_series(metrics.CONSUMER_LAG) == {"das_consumer_lag_records": "gauge"}


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[where for where, _ in EXPRESSIONS])
def test_expression_uses_only_real_series_of_the_right_type(where: str, expr: str) -> None:
    series = known_series()
    used = SERIES_NAME.findall(expr)
    assert used, f"{where}: no known series in {expr!r}"
    for name in used:
        source = next(
            (f for prefix, f in RECORDED.items() if name.startswith(prefix)), "monitoring/metrics.py"
        )
        assert name in series, f"{where}: {name} is not exported (see {source})"
    for name in RATE_CALL.findall(expr):
        assert series[name] in ("counter", "histogram"), f"{where}: rate/increase over gauge {name}"
        assert not name.endswith("_bucket") or "histogram_quantile" in expr, f"{where}: raw bucket rate"
    for name in used:
        if series[name] == "counter":
            assert re.search(rf"(?:rate|increase|irate)\(\s*{re.escape(name)}(?![\w:])", expr), (
                f"{where}: counter {name} used raw"
            )
    quantile = QUANTILE_CALL.search(expr)
    if quantile:
        assert re.search(r"[a-z0-9_:]+_bucket\b", quantile["body"]), f"{where}: quantile needs _bucket"
        assert re.search(r"\bby\s*\([^)]*\ble\b", quantile["body"]), f"{where}: quantile must keep `le`"


@pytest.mark.parametrize("fixture", sorted(RECORDED.values()))
def test_recorded_series_are_real_recordings(fixture: str) -> None:
    text = (FIXTURES / fixture).read_text()
    assert text.startswith("# Recorded "), f"{fixture}: says where and how it was recorded"
    prefix = next(p for p, f in RECORDED.items() if f == fixture)
    assert any(name.startswith(prefix) for name in recorded_series(FIXTURES / fixture))


def test_dashboards_cover_every_catalog_metric() -> None:
    used = {name for _where, expr in dashboard_expressions() for name in METRIC_NAME.findall(expr)}
    missing = [metric._name for metric in metrics.CATALOG if not set(metrics.exported_series(metric)) & used]
    assert not missing, f"metrics no dashboard panel shows: {missing}"


def test_dashboards_have_pinned_uids_and_use_the_provisioned_data_source() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    datasource_uids = {source["uid"] for source in datasources["datasources"]}
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "das.yml").read_text())["providers"][
        0
    ]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert DASHBOARDS, "no dashboard JSON in monitoring/grafana/dashboards"
    uids = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert re.fullmatch(r"[a-z0-9-]{1,40}", dashboard.get("uid", "")), f"{path.name}: uid must be pinned"
        uids.append(dashboard["uid"])
        panel_ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(panel_ids) == len(set(panel_ids)), f"{path.name}: duplicate panel ids"
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] in datasource_uids, f"{path.name}: {panel['title']}"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] in datasource_uids, f"{path.name}: {panel['title']}"
    assert len(uids) == len(set(uids))


def test_dashboard_panels_do_not_overlap() -> None:
    for path in DASHBOARDS:
        cells: dict[tuple[int, int], str] = {}
        for panel in json.loads(path.read_text())["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, f"{path.name}: {panel['title']} is wider than the grid"
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    assert (x, y) not in cells, f"{path.name}: {panel['title']} overlaps {cells[(x, y)]}"
                    cells[(x, y)] = panel["title"]


def test_dead_letter_reasons_match_the_pipeline_codes() -> None:
    from pipeline.wire import REASONS

    assert set(metrics.DEAD_LETTER_REASONS) == set(REASONS)


def test_labelled_counters_start_at_zero_for_every_known_reason() -> None:
    exported = {
        (sample.name, sample.labels.get("reason"))
        for metric in (metrics.DEAD_LETTERED, metrics.QUARANTINED)
        for family in metric.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    expected = {("das_dead_lettered_records_total", r) for r in metrics.DEAD_LETTER_REASONS} | {
        ("das_quarantined_records_total", r) for r in metrics.QUARANTINE_REASONS
    }
    assert expected <= exported
