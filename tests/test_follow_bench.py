"""bench/follow.py runs end to end on a short run and reads each row once.

Not a timed test: it checks the benchmark's shape and the rows each read, never speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "follow.py"


def test_the_follow_benchmark_walks_each_appended_row_once() -> None:
    args = ["--history", "6", "--behind", "8", "--rows", "4", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["rows_walked"] == [7 * 4], "the 7 appends behind, not the compaction's"
    assert report["rows_full_read"] == [13 * 4]
    assert report["files_walked"] == [7 * 4], "a file a bucket an append"
    assert 0 < report["files_full_read"][0] < 13 * 4, "the compaction merged some"
    ratio = report["walk_ms_per_file"] / report["full_read_ms_per_file"]  # of rounded figures
    assert report["walk_vs_full_read_per_file"] == pytest.approx(ratio, abs=0.005)
