"""The /metrics server: loopback by default, and one merged view of all processes in multi-process mode."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import urllib.request

import pytest
from monitoring_support import METRICS_SOURCE, free_port
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitoring import metrics
from monitoring.multiproc import prepare_multiprocess_dir
from monitoring.server import metrics_registry, start_from_args, start_metrics_server
from workers.cli.types import add_metrics_arguments


def _samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def test_server_binds_to_loopback_and_serves_the_catalog() -> None:
    server, _thread = start_metrics_server(free_port())
    try:
        assert server.server_address[0] == "127.0.0.1"
        metrics.RECORDS_INGESTED.inc(7)
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics").read().decode()
    finally:
        server.shutdown()
        server.server_close()
    families = {family.name: family.type for family in text_string_to_metric_families(body)}
    for metric in metrics.CATALOG:
        assert families.get(metric._name) == metric._type, metric._name


def test_metrics_arguments_default_to_no_server_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DAS_METRICS_HOST", raising=False)
    monkeypatch.delenv("DAS_METRICS_PORT", raising=False)
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser)
    args = parser.parse_args([])
    assert (args.metrics_host, args.metrics_port) == ("127.0.0.1", -1)
    assert start_from_args(args) is None


def test_metrics_arguments_take_their_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAS_METRICS_HOST", "0.0.0.0")
    monkeypatch.setenv("DAS_METRICS_PORT", "9400")
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser)
    args = parser.parse_args([])
    assert (args.metrics_host, args.metrics_port) == ("0.0.0.0", 9400)


def test_missing_multiprocess_folder_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent/das-metrics")
    with pytest.raises(FileNotFoundError, match="PROMETHEUS_MULTIPROC_DIR"):
        metrics_registry()


def _run_dump(multiproc_dir: str) -> tuple[dict, dict]:
    output = subprocess.run(
        [sys.executable, str(METRICS_SOURCE), "dump", multiproc_dir],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    merged, after_death = (_samples(part) for part in output.split("---\n"))
    return merged, after_death


def test_child_processes_merge_into_one_exposition() -> None:
    with tempfile.TemporaryDirectory() as multiproc_dir:
        merged, after_death = _run_dump(multiproc_dir)
    # Counters and histograms add up over the children: two generators x 10 steps x 4 drafts.
    assert merged[("das_drafts_total", ())] == 2 * 10 * 4
    assert merged[("das_freshness_seconds_count", ())] == merged[("das_records_ingested_total", ())] > 0
    accepted_by_position = sum(
        value for (name, _labels), value in merged.items() if name == "das_accepted_position_tokens_total"
    )
    assert accepted_by_position == merged[("das_accepted_tokens_total", ())]
    # Live gauges: the largest live child wins, and a child marked dead no longer counts.
    assert merged[("das_store_tokens", ())] == 4000
    assert after_death[("das_store_tokens", ())] == 3000
    assert after_death[("das_drafts_total", ())] == merged[("das_drafts_total", ())]


def test_a_new_run_in_the_same_folder_starts_from_zero() -> None:
    with tempfile.TemporaryDirectory() as multiproc_dir:
        first, _ = _run_dump(multiproc_dir)
        second, _ = _run_dump(multiproc_dir)
    assert second[("das_drafts_total", ())] == first[("das_drafts_total", ())] == 2 * 10 * 4


def test_preparing_the_folder_after_the_client_is_imported_is_refused() -> None:
    # This pytest process has imported prometheus_client (through monitoring.metrics) in single-process mode.
    with pytest.raises(RuntimeError, match="before importing monitoring.metrics"):
        prepare_multiprocess_dir(tempfile.gettempdir())


_LAST_STEPS_THEN_EXIT = """
from workers.generator.step_book import DRAFT_TOKEN_TOTAL, DRAFTED, MetricsFlush, StepBook
book = StepBook(8)
metrics = MetricsFlush(book)
metrics.step_done(1e-5, None, now=0.0)  # the first step flushes (nothing yet); the next flush is due at 1.0
book.totals[DRAFTED] += 5
book.totals[DRAFT_TOKEN_TOTAL] += 12
metrics.step_done(1e-5, 0.02, now=0.5)  # not due: these counts wait for the exit
"""


def test_counts_of_the_last_second_reach_prometheus_when_the_process_exits(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metrics are flushed once a second; an engine that exits sooner after its last steps must not lose
    them."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _LAST_STEPS_THEN_EXIT], check=True, env=env, timeout=120)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    samples = _samples(generate_latest(metrics_registry()).decode())
    assert samples[("das_drafts_total", ())] == 5
    assert samples[("das_draft_tokens_total", ())] == 12
    assert samples[("das_draft_duration_seconds_count", ())] == 2
