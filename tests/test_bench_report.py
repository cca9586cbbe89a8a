"""`make bench`'s report: rerunning one benchmark keeps the others' figures and dates."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_report", Path(__file__).resolve().parents[1] / "bench" / "report.py"
)
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # dataclasses look their module up there
_spec.loader.exec_module(report)

OLD = {
    "date": "2026-11-22",
    "machine": "old VM",
    "results": {
        "ingest": {"ingest": {"msgs_per_s": 100}},
        "broker": {"results": [{"phase": "b1", "msgs_per_s": 200}]},
        "release": {"release": {"msgs_per_s": 300}},
    },
}


def test_only_one_benchmark_replaces_its_figures_and_keeps_the_others_with_their_date() -> None:
    broker = {"results": [{"phase": "b1", "msgs_per_s": 250}]}
    merged = report.merge(OLD, {"broker": broker}, "2026-11-23", "new VM")
    assert merged["results"] == {**OLD["results"], "broker": broker}
    assert list(merged["results"]) == ["ingest", "broker", "release"]
    assert merged["measured"] == {
        "ingest": "2026-11-22",
        "broker": "2026-11-23",
        "release": "2026-11-22",
    }
    assert report.when_line(merged["measured"]) == (
        "ingest 2026-11-22, broker 2026-11-23, release 2026-11-22"
    )
    again = report.merge(merged, {"ingest": {"ingest": {"msgs_per_s": 1}}}, "2026-11-24", "x")
    assert again["measured"]["broker"] == "2026-11-23"
    assert again["measured"]["release"] == "2026-11-22"


def test_a_full_run_has_one_date_and_a_first_run_needs_no_saved_file() -> None:
    fresh = {name: {"x": {"msgs_per_s": 1}} for name in report.BENCHMARKS}
    merged = report.merge(None, fresh, "2026-11-23", "VM")
    assert merged["results"] == fresh
    assert report.when_line(merged["measured"]) == "2026-11-23"
    assert report.when_line(report.merge(OLD, fresh, "2026-11-23", "VM")["measured"]) == (
        "2026-11-23"
    )


def test_the_table_puts_each_headline_beside_its_same_run_baseline_and_skips_absent_ones() -> None:
    results = {
        "broker": {
            "results": [{"phase": "batch_100_workers_8", "msgs_per_s": 40_000}],
            "floor_http_and_raft": [{"phase": "batch_100_workers_8", "msgs_per_s": 80_000}],
        },
        "release": {
            "timeline": {
                "early": 0,
                "lateness_ms": {"p99": 2},
                "baseline_sleeping_producer": {"lateness_ms": {"p99": 0}},
            }
        },
    }
    rows = report.headline(results)
    assert [(h.path, value, base) for h, value, base in rows] == [
        ("results.batch_100_workers_8.msgs_per_s", 40_000, 80_000),
        ("timeline.lateness_ms.p99", 2, 0),
        ("timeline.early", 0, None),
    ]
    text = report.table(rows, "2026-11-24", "VM")
    assert "| 40,000 msgs/s | Raft floor (HTTP + one Raft command): 80,000 | 0.50x |" in text
    sleeping = "kafka-python producer sleeping until each is due"
    assert f"| timeline lateness p99 | 2 ms | {sleeping}: 0 |  |" in text, "0 shown, no ratio"
    assert "| timeline messages sent early | 0 messages |  |  |" in text
