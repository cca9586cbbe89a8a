"""bench/id_encoding.py runs end to end on a short run.

Not a timed test: it checks the benchmark's shape, that both ways wrote and read back
every row, and that its ratios are of its own figures, never the CPU itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "id_encoding.py"


def test_the_id_encoding_benchmark_measures_dejaq_against_delta_rs_defaults() -> None:
    args = ["--rows", "2000", "--appends", "2", "--rounds", "2"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["parameters"] == {"rows": 2000, "appends": 2, "rounds": 2}
    assert set(report["shapes"]) == {"sequential", "uuid4"}
    for shape in report["shapes"].values():
        ways = {"delta_rs_default", "dejaq"}
        assert set(shape["append_cpu_us_per_row"]) == ways
        assert all(len(runs) == 2 for runs in shape["append_cpu_us_per_row_runs"].values())
        assert all(size > 0 for size in shape["bytes"].values())
        ratio = shape["bytes"]["dejaq"] / shape["bytes"]["delta_rs_default"]
        assert shape["ratio_bytes"] == round(ratio, 2)
