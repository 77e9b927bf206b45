"""Shared by the tests that run `das` as a user does: in a child process, offline, with `--json`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_das(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`das ARGS --json` in a child process from the repository root (no Hugging Face downloads)."""
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args, "--json"],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def das_json(*args: str, timeout: float = 600) -> dict:
    """The JSON object the last line of `das ARGS --json` prints; fails the test, with its stderr, if it fails."""
    result = run_das(*args, timeout=timeout)
    assert result.returncode == 0, f"das {' '.join(args)} failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])
