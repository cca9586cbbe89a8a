"""bench/release_memory.py runs end to end on a small buffer.

Not a timed test: it checks the benchmark's shape and that each way of reading took in
every row, never the memory figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "release_memory.py"


def test_the_release_memory_benchmark_reads_every_row_both_ways() -> None:
    args = ["--pending", "3000", "--payload", "256"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["parameters"] == {"pending": 3000, "payload_bytes": 256}
    release, arrow = report["release_job"], report["arrow_table"]
    assert release["rows"] == arrow["rows"] == 3000
    if arrow["bytes_per_message"] > 0:
        ratio = round(release["bytes_per_message"] / arrow["bytes_per_message"], 3)
        assert report["release_vs_arrow"] == ratio
