"""`dejaq demo` (what `make demo` runs) passes its own checks and stops what it started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_passes_its_checks() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "demo summary" in result.stdout
    assert "FAIL" not in result.stdout
    assert result.stdout.count("ok  ") == 7
    assert "stopped Spark queries, 3 broker nodes and Kafka" in result.stdout
