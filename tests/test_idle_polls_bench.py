"""bench/idle_polls.py runs end to end on a short run against a real 3-node cluster.

Not a timed test: it checks the benchmark's shape and that its polls waited on empty
topics, never the leader's CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "idle_polls.py"


def test_the_idle_polls_benchmark_measures_each_topic_against_an_idle_leader() -> None:
    args = ["--polls", "20", "--seconds", "1", "--warm", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    phases = report["phases"]
    assert [(p["topic"], p["polls"]) for p in phases] == [
        (None, 0),
        ("jobs", 20),
        ("timers", 20),
        ("delayed", 20),
    ]
    assert all(p["core_share"] >= 0 for p in phases)
    beyond = report["leader_core_share_beyond_idle"]
    assert set(beyond) == {"priority", "timeline", "delayed"}
    for kind in ("timeline", "delayed"):
        if beyond["priority"]:
            assert report["vs_priority"][kind] == round(beyond[kind] / beyond["priority"], 3)
    assert report["parameters"] == {"polls": 20, "seconds": 1.0, "wait_ms": 20_000}
