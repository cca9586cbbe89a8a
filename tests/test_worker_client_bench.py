"""bench/worker_client.py runs end to end on a short run and reports what the README
quotes.

Not a timed test: it checks the benchmark's shape and that every Worker acked what it
was asked to, never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "worker_client.py"


def test_the_worker_client_benchmark_acks_every_message_both_ways() -> None:
    args = ["--batch1", "200", "--batch100", "2000", "--rounds", "2"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    wanted = {"batch_1": 200, "batch_100": 2000}
    for phase, n in wanted.items():
        for name in ("client", "stdlib"):
            runs = report["runs"][phase][name]
            assert len(runs) == 2
            assert all(r["acked"] >= n for r in runs), runs
        cpu = report["cpu_us_per_msg"][phase]
        assert cpu["client"] > 0 and cpu["stdlib"] > 0
        ratio = round(cpu["client"] / cpu["stdlib"], 3)
        assert report["client_vs_stdlib_cpu"][phase] == ratio
