"""bench/growth.py runs end to end on a small grid and reports what the README quotes.

Not a timed test: it checks the benchmark's shape and its counts, never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "growth.py"


def test_the_growth_benchmark_measures_each_cell_with_and_without_retention(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--tmp", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    cells = report["cells"]
    assert {(c["settled"], c["retention"]) for c in cells} == {
        (s, r) for s in (2000, 8000) for r in (False, True)
    }
    for c in cells:
        assert c["leased"] == c["pending"] == c["release_pending"], c
        assert (c["retention_s"] is not None) == c["retention"]
        assert c["ready_s"] > 0 and c["rss_mb"] > 0 and c["lease_p99_ms"] > 0
    assert set(report["ratios"]) == {
        "without_retention/pending_500",
        "with_retention/pending_500",
    }
    assert not list(tmp_path.iterdir()), "each cell's warehouse is removed"
