"""bench/retention.py runs end to end on a small grid and reports what the README quotes.

Not a timed test: it checks the benchmark's shape and what each run removed and read,
never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "retention.py"


def test_the_retention_benchmark_removes_each_span_and_reads_only_it() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [c["window"] for c in report["cells"]] == [2000, 8000]
    for cell in report["cells"]:
        assert cell["removed"] == [200, 200] and cell["messages_read"] == [200, 200]
        assert cell["buffer_rows_left"] == cell["window"], "the window's messages all stay"
        ratio = cell["read_s"] / cell["whole_tail_s"]
        assert cell["read_vs_whole_tail"] == round(ratio, 3)
    assert set(report["ratios"]) == {"window", "run_s", "read_s", "whole_tail_s"}
    assert report["ratios"]["window"] == 4.0
