"""bench/ledger_commits.py runs end to end on a short run and reports what the README
quotes.

Not a timed test: it checks the benchmark's shape and its ledgers' rows, never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ledger_commits.py"


def test_the_ledger_commits_benchmark_writes_every_event_once_to_both_tables() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--commits", "20", "--events", "200", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ledger_rows_per_round"] == {"contract": [4000], "delta_rs_default": [4000]}
    for name in ("contract", "delta_rs_default"):
        assert len(report["cpu_ms_per_commit_by_tenth"][name]) == 10
        assert report["cpu_ms_per_commit"][name] > 0
    mean = report["cpu_ms_per_commit"]
    ratio = mean["contract"] / mean["delta_rs_default"]
    assert report["contract_vs_delta_rs_default"] == round(ratio, 3)
