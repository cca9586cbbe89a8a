"""A ledger's cost against its history: the leader's checkpoint append and a tail read,
on a ledger of H old files, before and after sealing them.

    .venv/bin/python bench/ledger_history.py [--files 500,2000,8000,16000] [--quick]

The leader appends a checkpoint to its topic's ledger about once a second, and every
append opens the table: an entry per file, read from the last Delta checkpoint, which
every tenth commit writes again whole. Compaction keeps the ledger's files at ~4 MB, so
their count grows with the ledger's history; a seal (`pipelines.log_compaction`) makes the old
ones few.

Each cell (H old files) gets a fresh ledger written with delta-rs: H files of 1,024
"acked" events spread over the 60 days before the seal's cutoff, then 10 recent files.
Timed on it, unsealed, then sealed (seals until none is due, timed too), then once the
Delta checkpoints no longer carry the replaced files (`sealed_expired`: after the
table's file retention, two hours, which the bench sets to 0 for this step):
- `open_s`: opening the table, median of 5;
- `checkpoint_s`: a tagged append of 2,000 events as a leader's checkpoint makes it
  (open, read the tag, append), the mean of 20, so two Delta checkpoints are in it;
- `tail_s`: `retention.ledger_tail` of the last hour, median of 5.
The baseline is the same table unsealed, in the same run. `seal_peak_mb_over_resting`:
the process's peak resident memory during the seals over its resident memory before.

Prints one JSON object: each cell's figures, then the largest H's over the smallest's,
unsealed and sealed (near 1 when the cost does not follow the history), and sealed over
unsealed at the largest H. Progress goes to stderr. `--quick` runs H 100 and 400.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT)]

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from deltalake import (  # noqa: E402
    CommitProperties,
    DeltaTable,
    Transaction,
    WriterProperties,
    write_deltalake,
)

from bench.machine import machine  # noqa: E402
from dejaq.conf.tables import LEDGER_SCHEMA, TIMESTAMP, Table, ensure_table  # noqa: E402
from dejaq.pipelines.log_compaction import SEAL_AGE_MS, seal  # noqa: E402
from dejaq.pipelines.retention import ledger_tail  # noqa: E402

TOPIC = "history"
HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS
HISTORY_DAYS = 60
FILE_EVENTS = 1024  # delta-rs's writer closes a file at each batch of this many here
CHECKPOINT_EVENTS = 2_000
CHECKPOINTS = 20
RECENT_FILES = 10
DEFAULT_FILES = [500, 2_000, 8_000, 16_000]
QUICK_FILES = [100, 400]


def acked(first: int, n: int, start_ms: int, end_ms: int) -> pa.Table:
    """`n` "acked" events of ids m<first>.., spread evenly over [start_ms, end_ms)."""
    ids = np.arange(first, first + n)
    at = start_ms + (np.arange(n, dtype=np.int64) * (end_ms - start_ms)) // n
    columns = {
        "message_id": pc.binary_join_element_wise("m", pa.array(ids).cast(pa.string()), ""),
        "bucket": pa.array(ids % 16, pa.int32()),
        "event": pa.array(np.full(n, "acked")),
        "sort_key": pa.array(ids, pa.int64()),
        "deliveries": pa.array(np.ones(n, np.int32)),
        "at": pa.array(at * 1000).cast(TIMESTAMP),
    }
    return pa.table(columns, schema=LEDGER_SCHEMA)


def write_ledger(path: str, files: int, cutoff_ms: int, now_ms: int) -> None:
    """`files` files of history before the cutoff, `RECENT_FILES` in the last hour."""
    old = acked(0, files * FILE_EVENTS, cutoff_ms - HISTORY_DAYS * DAY_MS, cutoff_ms)
    small = WriterProperties(max_row_group_size=FILE_EVENTS, write_batch_size=FILE_EVENTS)
    write_deltalake(path, old, mode="append", target_file_size=1, writer_properties=small)
    for k in range(RECENT_FILES):
        start = now_ms - HOUR_MS + k * HOUR_MS // RECENT_FILES
        events = acked((files + k) * FILE_EVENTS, FILE_EVENTS, start, start + 60_000)
        write_deltalake(path, events, mode="append")


def memory() -> dict[str, int]:
    """This process's resident and peak resident memory, in kB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return {
        k: int(v.split()[0])
        for k, v in (ln.split(":", 1) for ln in lines)
        if k in ("VmRSS", "VmHWM")
    }


def peak_reset() -> int:
    """Start the peak over from the resident memory now (Linux), and return that."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return memory()["VmRSS"]


def timed(action: Callable[[], object], times: int) -> list[float]:
    out = []
    for _ in range(times):
        t0 = time.perf_counter()
        action()
        out.append(time.perf_counter() - t0)
    return out


def measure(path: str, first_id: int, tag: int, now_ms: int) -> dict[str, float]:
    """`open_s`, `checkpoint_s` and `tail_s` on the table as it is."""

    def checkpoint(k: list[int] = [0]) -> None:  # noqa: B006 (a counter across calls)
        k[0] += 1
        table = DeltaTable(path)
        table.transaction_version("bench")
        events = acked(first_id + k[0] * CHECKPOINT_EVENTS, CHECKPOINT_EVENTS, now_ms, now_ms + 1)
        commit = CommitProperties(app_transactions=[Transaction("bench", tag + k[0])])
        write_deltalake(table, events, mode="append", commit_properties=commit)

    return {
        "open_s": round(statistics.median(timed(lambda: DeltaTable(path), 5)), 4),
        "checkpoint_s": round(statistics.mean(timed(checkpoint, CHECKPOINTS)), 4),
        "tail_s": round(
            statistics.median(
                timed(lambda: ledger_tail(path, now_ms - HOUR_MS, ["message_id"]), 5)
            ),
            4,
        ),
    }


def run_cell(files: int) -> dict[str, Any]:
    now_ms = int(time.time() * 1000)
    cutoff_ms = now_ms - HOUR_MS - SEAL_AGE_MS
    with tempfile.TemporaryDirectory(prefix="dejaq-ledger-history-bench-") as tmp:
        path = ensure_table(str(Path(tmp) / "wh"), Table.LEDGER, TOPIC)
        write_ledger(path, files, cutoff_ms, now_ms)
        written = len(DeltaTable(path).file_uris())
        first_id = (files + RECENT_FILES) * FILE_EVENTS
        unsealed = measure(path, first_id, 0, now_ms)
        resting = peak_reset()
        seals, t0 = 0, time.perf_counter()
        while seal(path, "at", cutoff_ms) is not None:
            seals += 1
        seal_s = time.perf_counter() - t0
        seal_peak_mb = round((memory()["VmHWM"] - resting) / 1024, 1)
        left = len(DeltaTable(path).file_uris())
        sealed = measure(path, first_id + 10 * CHECKPOINTS * CHECKPOINT_EVENTS, 1000, now_ms)
        # The replaced files' records expire from Delta checkpoints after the table's
        # file retention (two hours); here at once, then a checkpoint without them.
        table = DeltaTable(path)
        table.alter.set_table_properties(
            {"delta.deletedFileRetentionDuration": "interval 0 seconds"}
        )
        DeltaTable(path).create_checkpoint()
        expired = measure(path, first_id + 20 * CHECKPOINTS * CHECKPOINT_EVENTS, 2000, now_ms)
    return {
        "files": files,
        "files_written": written,
        "unsealed": unsealed,
        "seals": seals,
        "seal_s": round(seal_s, 3),
        "seal_peak_mb_over_resting": seal_peak_mb,
        "files_after_seal": left,
        "sealed": sealed,
        "sealed_expired": expired,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default=",".join(map(str, DEFAULT_FILES)))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = QUICK_FILES if args.quick else [int(f) for f in args.files.split(",")]
    cells = []
    for files in sizes:
        cell = run_cell(files)
        print(f"H={files:,}: {json.dumps(cell)}", file=sys.stderr, flush=True)
        cells.append(cell)
    small, large = cells[0], cells[-1]
    figures = ("open_s", "checkpoint_s", "tail_s")
    report = {
        "benchmark": "ledger_history",
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "parameters": {
            "files": sizes,
            "file_events": FILE_EVENTS,
            "history_days": HISTORY_DAYS,
            "checkpoint_events": CHECKPOINT_EVENTS,
            "checkpoints": CHECKPOINTS,
        },
        "cells": cells,
        "ratios": {
            "files": large["files"] / small["files"],
            **{
                f"{state}_{f}": round(large[state][f] / small[state][f], 3)
                for state in ("unsealed", "sealed", "sealed_expired")
                for f in figures
            },
            **{
                f"{state}_vs_unsealed_{f}": round(large[state][f] / large["unsealed"][f], 3)
                for state in ("sealed", "sealed_expired")
                for f in figures
            },
        },
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
