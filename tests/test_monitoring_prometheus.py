"""A real Prometheus (Debian's package, see scripts/install_system_deps.sh) scrapes a multi-process DAS metrics
workload, and the shipped dashboard queries and alert rules run against what it scraped."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from monitoring_support import (
    ALERT_RULES,
    DASHBOARDS,
    METRICS_SOURCE,
    PROMETHEUS_CONFIG,
    RATE_INTERVAL,
    PrometheusApi,
    free_port,
    require_binary,
    running_prometheus,
    wait_for,
)

from monitoring import metrics


@pytest.fixture(scope="module")
def prometheus() -> Iterator[PrometheusApi]:
    with tempfile.TemporaryDirectory(prefix="das-prometheus-") as tmp:
        workdir = Path(tmp)
        (workdir / "multiproc").mkdir()
        source_port = free_port()
        source = subprocess.Popen(
            [sys.executable, str(METRICS_SOURCE), "serve", str(source_port), str(workdir / "multiproc")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            ready_line = source.stdout.readline()
            assert ready_line.startswith("ready"), f"metrics source did not start: {ready_line!r}"
            with running_prometheus(workdir, {"das-test": source_port}, rule_files=(ALERT_RULES,)) as api:
                # Rates need a few scrapes inside the window; alert rules need a few evaluations.
                wait_for(
                    "das_ samples to accumulate",
                    lambda: api.query(f"rate(das_drafts_total[{RATE_INTERVAL}]) > 0"),
                )
                yield api
        finally:
            source.stdin.close()
            source.wait(timeout=60)


def test_promtool_accepts_the_shipped_config_and_rules() -> None:
    promtool = require_binary("promtool")
    for command in (["check", "config", str(PROMETHEUS_CONFIG)], ["check", "rules", str(ALERT_RULES)]):
        result = subprocess.run([promtool, *command], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_every_catalog_metric_with_its_type(prometheus: PrometheusApi) -> None:
    scraped = {sample["metric"]["__name__"] for sample in prometheus.query('{__name__=~"das_.+"}')}
    missing = sorted(set(metrics.catalog_series()) - scraped)
    assert not missing, f"catalog series Prometheus did not scrape: {missing}"
    metadata = prometheus.get("/api/v1/metadata")
    for metric in metrics.CATALOG:
        # The family is named with or without `_total`, depending on the exposition format negotiated.
        entries = metadata.get(metric._name) or metadata.get(f"{metric._name}_total")
        assert entries, f"no metadata for {metric._name}"
        assert entries[0]["type"] == metric._type, metric._name


def test_every_alert_fires_on_its_failure_in_promtool_unit_tests() -> None:
    promtool = require_binary("promtool")
    tests_file = ALERT_RULES.parent / "alerts_test.yml"
    shipped = {
        rule["alert"]
        for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    proven = {
        case["alertname"]
        for test in yaml.safe_load(tests_file.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert shipped <= proven, f"alerts with no promtool test that makes them fire: {sorted(shipped - proven)}"
    result = subprocess.run(
        [promtool, "test", "rules", tests_file.name],
        cwd=tests_file.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Queries over DAS's own series; the broker, vLLM and availability panels are checked against their own sources
# (test_monitoring_kafka_jmx.py, test_monitoring_catalog.py's recordings).
DASHBOARD_QUERIES = [
    (f"{path.name}: {panel['title']} {target['refId']}", target["expr"])
    for path in DASHBOARDS
    for panel in json.loads(path.read_text())["panels"]
    for target in panel.get("targets", [])
    if "das_" in target["expr"]
]


@pytest.mark.parametrize(("where", "expr"), DASHBOARD_QUERIES, ids=[where for where, _ in DASHBOARD_QUERIES])
def test_dashboard_query_returns_data(prometheus: PrometheusApi, where: str, expr: str) -> None:
    result = prometheus.query(expr.replace("$__rate_interval", RATE_INTERVAL))
    assert result, f"{where}: {expr} returned no series"
    values = [float(series["value"][1]) for series in result]
    assert any(math.isfinite(value) for value in values), f"{where}: only NaN/Inf in {values}"


def test_alert_rules_load_and_evaluate_without_error(prometheus: PrometheusApi) -> None:
    shipped = {
        rule["alert"]
        for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    wait_for(
        "every alert rule to be evaluated",
        lambda: all(
            not rule["lastEvaluation"].startswith("0001")
            for group in prometheus.get("/api/v1/rules")["groups"]
            for rule in group["rules"]
        ),
    )
    rules = {
        rule["name"]: rule for group in prometheus.get("/api/v1/rules")["groups"] for rule in group["rules"]
    }
    assert set(rules) == shipped
    for name, rule in rules.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"


def test_alerts_fire_on_dead_letters_and_quarantined_records(prometheus: PrometheusApi) -> None:
    def firing() -> set[str]:
        alerts = prometheus.get("/api/v1/alerts")["alerts"]
        return {alert["labels"]["alertname"] for alert in alerts if alert["state"] == "firing"}

    # The workload dead-letters and quarantines records continuously, so these rules (for: 0m) must fire.
    expected = {"DASDeadLetterSpike", "DASRecordsQuarantined"}
    wait_for(f"alerts {sorted(expected)} to fire", lambda: expected <= firing())
    # Healthy signals in the workload: acceptance above 20%, freshness under 1 s, checkpoints just written.
    assert not firing() & {"DASAcceptanceCollapse", "DASFreshnessLag", "DASCheckpointStale", "DASConsumerLag"}
