"""scripts/benchmark_tables.py prints docs/benchmarks.md's tables from benchmarks/: every trace in data/ has its
rows, and the tables in the docs are what it prints (so no figure there was typed by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted(
    p.name.removesuffix(".gz").removesuffix(".jsonl")
    for p in (ROOT / "data").iterdir()
    if p.name.endswith((".jsonl", ".jsonl.gz"))
)


def _table(name: str) -> str:
    script = ROOT / "scripts" / "benchmark_tables.py"
    return subprocess.run(
        [sys.executable, str(script), name], check=True, capture_output=True, text=True
    ).stdout


@pytest.mark.parametrize("name", ["replay", "slots", "remembered"])
def test_every_trace_has_its_rows_and_the_docs_print_them(name: str) -> None:
    table = _table(name)
    for trace in TRACES:
        assert f"| {trace} |" in table, f"{trace} missing from the {name} table"
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    for row in rows:
        assert row in docs, f"docs/benchmarks.md does not hold the {name} table's row: {row[:80]}"
