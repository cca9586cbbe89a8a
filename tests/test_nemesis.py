"""bench/nemesis.py on a short schedule: 3 real broker processes under kill -9 of the
leader and of a follower, SIGSTOP of a node (the leader first), and a full kill -9 and
restart, while workers lease, ack, nack, reject and drop messages. Nothing acked comes
back, nothing is leased twice at once, nothing is lost, and the tables catch up.

The bench's own fault schedule has timed pauses (the workload); this test only runs it
and reads its report. Lease topics need no Kafka: the nodes get a dummy bootstrap.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "nemesis.py"
# Two rounds of the three faults, then kill -9 of all three at 84 s: about 2 minutes in
# all with the drain and the checks (3.5 when the ledger or buffer never catch up).
ARGS = ["--seconds", "84", "--messages", "3000", "--fault-every", "12"]


@pytest.mark.slow
def test_faults_lose_nothing_and_the_ledger_and_buffer_catch_up(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), *ARGS, "--tmp", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the bench stops the nodes it started on SIGTERM
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the nemesis run did not finish in 10 minutes: {err[-3000:]}")
    assert out, err[-3000:]
    report = json.loads(out)
    f = report["figures"]
    summary = json.dumps(
        {k: f.get(k) for k in ("ledger", "dead_letter", "buffer", "logs")}, indent=1
    )
    assert report["errors"] == [], report["errors"]
    kinds = [fault["kind"] for fault in report["faults"]]
    assert kinds == [*["kill_leader", "sigstop", "kill_follower"] * 2, "kill_all"], kinds
    assert report["safety"] == {"lost": 0, "leased_after_ack": 0, "double_leased": 0}, (
        f["examples"],
        f.get("lost_examples"),
    )
    assert proc.returncode == 0
    assert f["final_status"].get("acked", 0) > 0 and f["final_status"].get("dead", 0) > 0
    assert f["ledger"]["caught_up"], summary
    assert f["ledger"]["duplicate_ids"] == 0, summary
    assert f["dead_letter"]["equals_ledger_dead"], summary
    assert f["buffer"]["drained"], summary
    assert f["nodes_agree"], f["node_views"]
    assert f["ledger_lag"]["samples"] > 0
    assert f["ledger_lag"]["faults_not_under_10s_within_30s"] == 0, f["ledger_lag"]
    assert not list(tmp_path.iterdir()), "the run's folder is removed"
