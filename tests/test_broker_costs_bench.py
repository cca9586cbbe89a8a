"""bench/broker_costs.py runs end to end at batch 1 with checkpoints and trims mid-run.

Not a timed test: it checks the benchmark's shape and its counts, never its speed. A
checkpoint every few hundred events, in its own thread, trims while other workers lease
and ack; buckets drain unevenly, so none may run dry before the run has leased its count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "broker_costs.py"


def test_the_costs_benchmark_acks_every_message_it_counts_through_mid_run_trims() -> None:
    messages, slices = 2048, 2
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--batch=1",
            f"--messages={messages}",
            "--workers=4",
            f"--slices={slices}",
            "--checkpoint-events=200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["messages"] == report["acked"] == messages
    assert report["checkpoints"] > slices, "checkpoints ran mid-slice, not only at its end"
    steps = report["steps_us_per_msg"]
    leader, followers = steps["leader"], steps["followers"]
    core = "apply leases and acks by receipt (core)"
    for step in ("pick", core, "apply trim", "checkpoint (its own thread)"):
        assert leader[step] > 0, step
    for step in (core, "apply trim", "forget settled rows"):
        assert followers[step] > 0, step
    assert report["baseline_raft_floor_cpu_us_per_msg"] > 0
    assert report["raft_carrying_the_commands_cpu_us_per_msg"] > 0
    assert report["parameters"]["checkpoint_events"] == 200
    # Each request commits one command: at most two entries a message (a lease, an ack).
    assert set(report["raft_entries_per_message"]) == {"dejaq", "floor", "carrying"}
    assert all(0 < v <= 2.1 for v in report["raft_entries_per_message"].values())
