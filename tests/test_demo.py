"""`dejaq demo` (what `make demo` runs) passes its own checks and stops what it started."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake
from rich.console import Console

from dejaq.jobs.demo import (
    BAD_MESSAGES,
    PRIORITY_MESSAGES,
    TIMELINE_MESSAGES,
    Counters,
    _held_late,
    _in_order,
    _summary,
)
from dejaq.pipelines.release import ReleaseStats

# An operator's shell pointing at real tables and Kafka: the demo must not touch them.
REAL_PLACES = {
    "DEJAQ_WAREHOUSE": "/nonexistent/dejaq-production-warehouse",
    "DEJAQ_KAFKA_BOOTSTRAP": "127.0.0.1:9",
}


@pytest.mark.slow
@pytest.mark.parametrize("where", [[], ["--s3"]], ids=["local", "s3"])
def test_demo_passes_its_checks(where: list[str]) -> None:
    """`--s3`: the same run with its warehouse on the S3 server it starts."""
    result = subprocess.run(
        [sys.executable, "-m", "dejaq.jobs.cli", "demo", *where],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "120", **REAL_PLACES},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "demo summary" in result.stdout
    assert "FAIL" not in result.stdout
    assert result.stdout.count("ok  ") == 7
    assert "stopped Spark queries, 3 broker nodes and Kafka" in result.stdout
    ignored = re.search(r"ignoring (.+) from the environment", result.stdout)
    assert ignored and set(REAL_PLACES) <= set(ignored.group(1).split(", ")), result.stdout[:2000]
    assert not Path(REAL_PLACES["DEJAQ_WAREHOUSE"]).exists()
    if where:
        assert "warehouse s3://dejaq/warehouse" in result.stdout
        assert "and the S3 server" in result.stdout
    # The terminal shows the table and the summary; Spark's and Kafka's logs go to a file.
    log = re.search(r"logs go to (\S+demo\.log)", result.stdout)
    assert log, result.stdout[:2000]
    assert "WARN" not in result.stdout + result.stderr
    assert "WARN" in Path(log.group(1)).read_text(), "Spark's log lines are in the file"


def test_order_check_excuses_only_reminders_the_release_job_held_after_they_fell_due(
    tmp_path,
) -> None:
    """A reminder buffered in time and released out of order fails the demo; one that
    reached the release job after it fell due (ingest lag) is left out of the check."""
    buffer = str(tmp_path / "buffer")
    write_deltalake(buffer, pa.table({"message_id": ["a", "b"]}))  # version 0
    write_deltalake(buffer, pa.table({"message_id": ["c"]}), mode="append")  # 1
    write_deltalake(buffer, pa.table({"message_id": ["d"]}), mode="append")  # 2: never read
    stats = [
        ReleaseStats(1, 0, 0, 0, millis=50, started_ms=1_000, buffer_version=0),
        ReleaseStats(2, 0, 0, 0, millis=0, started_ms=1_500, buffer_version=1, replay=True),
        ReleaseStats(3, 0, 0, 0, millis=50, started_ms=2_000, buffer_version=1),
    ]
    # Held at: a and b 1,050 (batch 1), c 2,050 (batch 3: a replay reads nothing), d never.
    released = {0: [(1_100, "a"), (2_200, "b"), (2_000, "c")], 1: [(3_000, "d")]}
    late = _held_late(buffer, stats, released)
    assert late == {"c", "d"}
    assert _in_order(released, late)
    assert not _in_order({0: [(2_200, "b"), (1_100, "a")]}, late)
    assert not _in_order({0: [(2_200, "b"), (2_000, "c")]}, set())


def demo_summary(c: Counters) -> tuple[int, str]:
    """The demo's exit code and summary for counters of a run otherwise as it should be."""
    console = Console(file=io.StringIO(), width=200)
    c.produced = PRIORITY_MESSAGES + TIMELINE_MESSAGES + BAD_MESSAGES
    buffered = {"orders": PRIORITY_MESSAGES, "reminders": TIMELINE_MESSAGES}
    code = _summary(console, c, [2, 1], buffered, BAD_MESSAGES, set(), 1.0)
    return code, console.file.getvalue()


def test_the_delivery_checks_fail_on_an_id_delivered_twice() -> None:
    """Each order acked exactly once, each reminder released exactly once: a repeat
    fails the check even where every id came (an order acked twice, a reminder written
    twice), as does a missing id. An order leased again (a lease answer lost, an ack
    failed) is at-least-once delivery: named, not failed."""
    orders = [f"order-{i}" for i in range(PRIORITY_MESSAGES)]
    reminders = [f"reminder-{i}" for i in range(TIMELINE_MESSAGES)]

    def counters(leased: list[str], acked: list[str], released: list[str]) -> Counters:
        return Counters(
            leased=len(leased),
            acked=len(acked),
            released=len(released),
            leased_ids=Counter(leased),
            acked_ids=Counter(acked),
            released_ids=Counter(released),
        )

    code, said = demo_summary(counters(orders, orders, reminders))
    assert code == 0 and "FAIL" not in said, said
    leased_line = f"every one of the {PRIORITY_MESSAGES} orders leased, each acked exactly once"
    released_line = f"each of the {TIMELINE_MESSAGES} reminders released exactly once"
    code, said = demo_summary(counters([*orders, orders[7]], orders, reminders))
    assert code == 0 and "FAIL" not in said, said
    assert "leased more than once, first order-7 (2 times)" in said, said
    for c, failed, named in (
        (counters(orders, [*orders, orders[7]], reminders), leased_line, "order-7 (2 times)"),
        (counters(orders, orders[1:], reminders), leased_line, "acked never, first order-0"),
        (counters(orders, orders, [*reminders, reminders[3]]), released_line, "reminder-3 (2"),
        (counters(orders, orders, reminders[:-1]), released_line, "released never"),
    ):
        code, said = demo_summary(c)
        assert code == 1, said
        assert [line for line in said.splitlines() if "FAIL" in line] == [f"  FAIL {failed}"]
        assert named in said, said
