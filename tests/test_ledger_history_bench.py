"""bench/ledger_history.py runs end to end on a small grid and reports what the README
quotes.

Not a timed test: it checks the benchmark's shape and what its seals left, never its
speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ledger_history.py"


def test_the_ledger_history_benchmark_seals_the_history_into_few_files() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [c["files"] for c in report["cells"]] == [100, 400]
    for cell in report["cells"]:
        assert cell["files_written"] == cell["files"] + 10
        assert cell["seals"] == 1
        # The sealed file, the 10 recent files and the 20 checkpoints' appends.
        assert cell["files_after_seal"] == 31
        for state in ("unsealed", "sealed", "sealed_expired"):
            assert set(cell[state]) == {"open_s", "checkpoint_s", "tail_s"}
    assert report["ratios"]["files"] == 4.0
    assert len(report["ratios"]) == 1 + 9 + 6
