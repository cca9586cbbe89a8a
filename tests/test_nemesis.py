"""bench/nemesis.py on a short schedule: 3 real broker processes under kill -9 of the
leader and of a follower, SIGSTOP of a node (the leader first), and a full kill -9 and
restart, while workers lease, ack, nack, reject and drop messages. Nothing acked comes
back, nothing is leased twice at once, nothing is lost, and the tables catch up.

The bench's own fault schedule has timed pauses (the workload); this test only runs it
and reads its report. Lease topics need no Kafka: the nodes get a dummy bootstrap.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "nemesis.py"
_spec = importlib.util.spec_from_file_location("bench_nemesis", BENCH)
assert _spec is not None and _spec.loader is not None
nemesis = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nemesis  # dataclasses look their module up there
_spec.loader.exec_module(nemesis)
# Two rounds of the three faults, then kill -9 of all three at 84 s: about 2 minutes in
# all with the drain and the checks (3.5 when the ledger or buffer never catch up).
ARGS = ["--seconds", "84", "--messages", "3000", "--fault-every", "12"]
# The bench's safety counts, written out here rather than read from it: a count the bench
# stopped judging fails these tests instead of passing unnoticed.
SAFETY = (
    "lost",
    "acked_2xx_not_acked",
    "leased_after_ack",
    "leased_after_reject",
    "deliveries_over_max",
    "double_leased",
)


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
    kept = f"the run's folder, with the nodes' logs: {report['folder']}"
    assert report["errors"] == [], report["errors"]
    kinds = [fault["kind"] for fault in report["faults"]]
    assert kinds == [*["kill_leader", "sigstop", "kill_follower"] * 2, "kill_all"], kinds
    assert report["safety"] == dict.fromkeys(SAFETY, 0), (
        f["examples"],
        f.get("lost_examples"),
        f.get("acked_2xx_not_acked_examples"),
    )
    assert proc.returncode == 0
    assert f["final_status"].get("acked", 0) > 0 and f["final_status"].get("dead", 0) > 0
    assert f["ledger"]["caught_up"], (summary, kept)
    assert f["ledger"]["duplicate_ids"] == 0, summary
    assert f["dead_letter"]["equals_ledger_dead"], summary
    assert f["buffer"]["drained"], (summary, kept)
    assert f["nodes_agree"], f["node_views"]
    assert f["ledger_lag"]["samples"] > 0
    assert f["ledger_lag"]["faults_not_under_10s_within_30s"] == 0, (f["ledger_lag"], kept)
    assert report["failed_checks"] == [], kept
    assert not list(tmp_path.iterdir()), "the run's folder is removed"


def test_the_checker_names_each_failed_check_and_waits_for_a_lag_under_10s() -> None:
    figures = {
        **dict.fromkeys(SAFETY, 0),
        "deliveries_not_increasing": 1,  # a leave's release hands a message on uncounted
        "ledger": {"caught_up": True},
        "buffer": {"drained": True},
        "nodes_agree": True,
        "ledger_lag": {"faults_not_under_10s_within_30s": 0},
    }
    assert nemesis.failed_checks({"figures": figures, "errors": []}) == []
    stalled = {**figures, "lost": 1, "ledger_lag": {"faults_not_under_10s_within_30s": 1}}
    assert nemesis.failed_checks({"figures": stalled, "errors": ["kill_all: refused"]}) == [
        "errors",
        "safety",
        "ledger_lag_under_10s_within_30s_of_each_fault",
    ]
    for count in SAFETY:
        unsafe = {**figures, count: 1}
        assert nemesis.failed_checks({"figures": unsafe, "errors": []}) == ["safety"], count
    # A restart's first samples are over 10 s; only a later one under it is a recovery.
    progress = [{"t_s": 80, "ledger_lag_s": 2.0}, {"t_s": 90, "ledger_lag_s": 14.0}]
    assert not nemesis.lag_recovered(progress, 84)
    assert not nemesis.lag_recovered([*progress, {"t_s": 95}], 84)
    assert nemesis.lag_recovered([*progress, {"t_s": 95, "ledger_lag_s": 3.0}], 84)


def test_the_checker_counts_a_rejected_message_leased_again_and_a_delivery_over_max() -> None:
    j = nemesis.Journal()
    j.leases = [
        nemesis.Lease("m1", "c1", 1, 1_000, 4_000, 1.0, end_ms=1_500),
        nemesis.Lease("m1", "c2", 2, 5_000, 8_000, 5.0),  # after its rejection's answer
        nemesis.Lease("m2", "c1", 3, 1_000, 4_000, 1.0),
        nemesis.Lease("m2", "c2", 4, 5_000, 8_000, 5.0),  # beyond max_deliveries 3
    ]
    j.rejected["m1"] = 2_000
    out = nemesis.check_leases(j, max_deliveries=3)
    assert (out["leased_after_reject"], out["deliveries_over_max"]) == (1, 1), out["examples"]
    assert (out["leased_after_ack"], out["double_leased"], out["deliveries_not_increasing"]) == (
        0,
        0,
        0,
    )
