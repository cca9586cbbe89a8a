"""A buffer follower catching up on versions it missed, a rewrite among them.

    .venv/bin/python bench/follow.py [--history 200] [--behind 200] [--rows 20] [--rounds 3]

Broker nodes and the release job follow the buffer a version at a time. When a version
they have not read is a rewrite (a retention run about once a minute, a compaction),
they walk every missed version, so that appended files the rewrite replaced are read
all the same (`retention.commits`). The walk must cost less than reading the table
afresh, or a node paused long enough never catches up with an ingest committing each
second.

Each round, on a fresh buffer made by the contract (16 buckets, `ensure_table`): `history`
appends of `rows` rows, a release follower (`DeltaFollower`) reads them, then `behind`
more versions: appends, with a compaction halfway (a rewrite of files the follower has
read and of some it has not). Timed: the follower's poll that walks them (`walk_s`); the
baseline, in the same run on the same table: a fresh follower's first poll, which reads
every file of the newest version (`full_read_s`). The walk reads more, smaller files
(each append's, where the compaction merged some): per file read, its cost should be
the full read's. Prints one JSON object: the medians, per file read too, their ratios,
and the rows and files each read (the walk: each appended row once).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

from deltalake import DeltaTable, write_deltalake  # noqa: E402
from test_broker import buffer_rows  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.conf.tables import BUFFER_SCHEMA, Table, ensure_table  # noqa: E402
from dejaq.pipelines.delta_follower import DeltaFollower  # noqa: E402

BUCKETS = 16


def append(path: str, n: int, rows: int) -> None:
    """The `n`th append: `rows` new messages over the buckets, as an ingest batch."""
    batch = buffer_rows(
        list(range(rows)), bucket_of=lambda i: i % BUCKETS, prefix=f"b{n}-", noted=False
    )
    write_deltalake(path, batch, mode="append", partition_by=["bucket"])


def run_round(history: int, behind: int, rows: int) -> dict[str, float | int]:
    """One round on a fresh buffer: the walk's and the full read's seconds and rows."""
    with tempfile.TemporaryDirectory() as warehouse:
        path = ensure_table(warehouse, Table.BUFFER, "follow")
        for n in range(history):
            append(path, n, rows)
        follower = DeltaFollower(path, BUFFER_SCHEMA)
        follower.poll()
        for n in range(history, history + behind - 1):
            append(path, n, rows)
            if n == history + behind // 2:
                DeltaTable(path).optimize.compact()
        read = follower.files_read
        fresh = DeltaFollower(path, BUFFER_SCHEMA)
        t0 = time.perf_counter()
        walked = follower.poll()
        t1 = time.perf_counter()
        full = fresh.poll()
        t2 = time.perf_counter()
        return {
            "walk_s": t1 - t0,
            "full_read_s": t2 - t1,
            "rows_walked": walked.num_rows,
            "rows_full_read": full.num_rows,
            "files_walked": follower.files_read - read,
            "files_full_read": fresh.files_read,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=200)
    parser.add_argument("--behind", type=int, default=200)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = []
    for r in range(args.rounds):
        rounds.append(run_round(args.history, args.behind, args.rows))
        print(f"round {r}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
    walk = statistics.median(r["walk_s"] for r in rounds)
    full = statistics.median(r["full_read_s"] for r in rounds)
    walk_ms = statistics.median(1000 * r["walk_s"] / r["files_walked"] for r in rounds)
    full_ms = statistics.median(1000 * r["full_read_s"] / r["files_full_read"] for r in rounds)
    report = {
        "benchmark": "follow",
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "parameters": {
            "history": args.history,
            "behind": args.behind,
            "rows": args.rows,
            "rounds": args.rounds,
            "buckets": BUCKETS,
        },
        "walk_s": round(walk, 4),
        "full_read_s": round(full, 4),
        "walk_vs_full_read": round(walk / full, 3),
        "walk_ms_per_file": round(walk_ms, 3),
        "full_read_ms_per_file": round(full_ms, 3),
        "walk_vs_full_read_per_file": round(walk_ms / full_ms, 3),
    }
    report |= {
        name: [r[name] for r in rounds]
        for name in ("rows_walked", "rows_full_read", "files_walked", "files_full_read")
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
