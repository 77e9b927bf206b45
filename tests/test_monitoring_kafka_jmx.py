"""A real Prometheus scrapes the JMX exporter agent of the local three-broker cluster (`scripts/kafka.sh` loads it
with `monitoring/prometheus/kafka-jmx.yml`, the compose brokers' rules) while records flow, and every dashboard
and alert query over broker series runs against what it scraped."""

from __future__ import annotations

import json
import os
import re
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import drop_topics, make_topics
from kafka import KafkaConsumer, KafkaProducer
from monitoring_support import ALERT_RULES, DASHBOARDS, PrometheusApi, running_prometheus, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.kafka

JMX_ENV = "DAS_KAFKA_JMX_TARGETS"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "kafka_jmx_metrics.txt"
KAFKA_SERIES = re.compile(r"\bkafka_[a-z0-9_]+\b")
RECORDS = 300


def broker_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard panel query and alert rule that reads broker series."""
    queries = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            queries += [(f"{panel['title']} {t['refId']}", t["expr"]) for t in panel.get("targets", [])]
    for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]:
        queries += [(f"alert {rule['alert']}", rule["expr"]) for rule in group["rules"]]
    return [(where, expr) for where, expr in queries if KAFKA_SERIES.search(expr)]


@pytest.fixture(scope="module")
def jmx_ports() -> list[int]:
    targets = os.environ.get(JMX_ENV)
    if not targets:
        pytest.fail(
            f"{JMX_ENV} is not set: the local brokers were started without the JMX exporter. Restart them with "
            "`bash scripts/kafka.sh down && bash scripts/kafka.sh up && source .kafka/env.sh` (make test does this)."
        )
    # The cluster's three brokers (the first target is the single broker).
    ports = [int(target.rsplit(":", 1)[1]) for target in targets.split(",")[1:]]
    for port in ports:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).close()
        except OSError as exc:
            pytest.fail(
                f"no JMX exporter on 127.0.0.1:{port} ({exc}): the brokers run without the agent (started before "
                "scripts/kafka.sh loaded it). Restart them: `bash scripts/kafka.sh down && bash scripts/kafka.sh up`."
            )
    return ports


@pytest.fixture(scope="module")
def prometheus(jmx_ports: list[int], kafka_cluster_servers: list[str]) -> Iterator[PrometheusApi]:
    topic, dlq = make_topics(kafka_cluster_servers, "jmx", partitions=3)
    try:
        producer = KafkaProducer(bootstrap_servers=kafka_cluster_servers, acks="all")
        for i in range(RECORDS):
            producer.send(topic, key=b"%d" % i, value=b"x" * 2000)
        producer.flush(timeout=60)
        producer.close()
        consumer = KafkaConsumer(
            topic,
            bootstrap_servers=kafka_cluster_servers,
            auto_offset_reset="earliest",
            consumer_timeout_ms=10_000,
        )
        assert sum(1 for _ in consumer) == RECORDS
        consumer.close()
        targets = {f"kafka-{i + 1}": port for i, port in enumerate(jmx_ports)}
        with (
            tempfile.TemporaryDirectory(prefix="das-jmx-") as tmp,
            running_prometheus(Path(tmp), targets) as api,
        ):
            wait_for(
                "every broker's bytes-in counter for the test topic",
                lambda: (
                    len(
                        api.query(
                            f'kafka_server_brokertopicmetrics_bytesinpersec_total{{topic="{topic}"}} > 0'
                        )
                    )
                    >= 2
                ),
            )
            # Brokers restarted by an earlier test (the outage test stops all three) answer scrapes a little
            # later than they answer clients: wait until each is scraped and the controller is among them.
            wait_for(
                "a successful scrape of every broker and one active controller",
                lambda: (
                    len(api.query('up{job=~"kafka-.*"} == 1')) == 3
                    and api.query("sum(kafka_controller_kafkacontroller_activecontrollercount) == 1")
                ),
            )
            yield api
    finally:
        drop_topics(kafka_cluster_servers, topic, dlq)


def test_the_recorded_broker_series_are_what_the_live_agents_export(prometheus: PrometheusApi) -> None:
    recorded = {
        sample.name
        for family in text_string_to_metric_families(FIXTURE.read_text())
        for sample in family.samples
    }
    live = set(prometheus.get("/api/v1/label/__name__/values"))
    assert recorded <= live, f"recorded but not exported now: {sorted(recorded - live)}"
    # Scraped successfully (a scrape of a loaded machine may miss the test's 1 s timeout now and then).
    assert all(prometheus.query(f'max_over_time(up{{job="kafka-{i}"}}[5m]) == 1') for i in (1, 2, 3))


@pytest.mark.parametrize(("where", "expr"), broker_queries(), ids=[where for where, _ in broker_queries()])
def test_broker_queries_return_data_from_the_live_cluster(
    prometheus: PrometheusApi, where: str, expr: str
) -> None:
    # Dashboard variables resolve as Grafana would; an alert's threshold is dropped so a healthy cluster still
    # shows each series the rule reads.
    query = expr.replace("$__rate_interval", "1m")
    query = re.sub(r"\s*[<>]=?\s*[\d.]+\s*$", "", query.strip())
    for name in set(KAFKA_SERIES.findall(query)):
        assert prometheus.query(f"count({name})"), f"{where}: no live series {name}"
    assert prometheus.query(query) is not None, where


def test_a_healthy_cluster_has_no_under_replicated_partitions(prometheus: PrometheusApi) -> None:
    (value,) = prometheus.query("max(kafka_server_replicamanager_underreplicatedpartitions)")
    assert float(value["value"][1]) == 0
    (controllers,) = prometheus.query("sum(kafka_controller_kafkacontroller_activecontrollercount)")
    assert float(controllers["value"][1]) == 1
