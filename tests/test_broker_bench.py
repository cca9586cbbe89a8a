"""bench/broker.py's interleaved comparison, as the README runs it, end to end on a small
load: every slice of every phase reported, with the resting cluster's share.

Not a timed test: it checks the benchmark's shape and its counts, never its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import median

BENCH = Path(__file__).resolve().parents[1] / "bench" / "broker.py"
PHASES = ["batch_1_workers_8", "batch_1_workers_64", "batch_100_workers_8"]


def test_the_interleaved_comparison_reports_every_slice_of_every_phase() -> None:
    done = subprocess.run(
        [
            *(sys.executable, str(BENCH), "--runs", "0", "--interleave", "2"),
            *("--messages", "4000", "--messages-batch1", "400"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["parameters"]["interleaved_slices"] == 2
    assert report["acking_by_receipt"] == [] and report["paired_vs_floor"] is None
    side = report["interleaved_receipts_vs_floor"]
    assert set(side["idle_cores"]) == {"receipts", "floor"}
    assert [p["phase"] for p in side["phases"]] == PHASES
    for phase in side["phases"]:
        assert phase["errors"] == 0, phase
        assert len(phase["slices"]) == len(phase["receipts_msgs_per_s"]) == 2
        assert all(rate > 0 for rate in phase["receipts_msgs_per_s"] + phase["floor_msgs_per_s"])
        assert phase["median"] == round(median(phase["slices"]), 3)
        resting = phase["resting_cpu_percent"]
        assert len(resting["floor_during_receipts"]) == len(resting["dejaq_during_floor"]) == 2
        assert {"leader", "follower_1", "follower_2", "clients", "all"} <= set(
            phase["receipts_cpu_us_per_msg"][0]
        )
    for name in PHASES:  # progress, a line per slice and system, as it goes
        for slice_ in (1, 2):
            for system in ("receipts", "floor"):
                assert f"interleaved {name} slice {slice_}/2 {system}:" in done.stderr
