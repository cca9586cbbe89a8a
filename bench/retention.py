"""A leader's steady retention runs: their cost against the settled messages still inside
the retention window.

    .venv/bin/python bench/retention.py [--window 40000,160000,640000,1280000] [--span 2000]
        [--runs 3] [--payload-bytes 64] [--quick]

A leader runs retention on each topic about once a minute. Each run removes from the
buffer what settled between the buffer's watermark W and the cutoff C (now minus the
topic's retention, an hour here): about a minute's worth. The window [C, now) holds
the messages settled since, which must stay, and at a steady rate there are about
sixty times as many of them. A run should cost what it removes, not the window.

Each cell (S settled inside the window) gets a fresh warehouse, written straight into
Delta with delta-rs: a buffer of `runs` x `span` + S rows (16 buckets), and a ledger of
"acked" events in time order, `runs` spans a minute apart after C, then S spread over
the rest of the hour, appended as checkpoints write them and compacted as the leader
compacts its ledger. A first run moves W to C. Then `runs` runs, each a minute later
than the last, each removes one span and is timed (`run_s`), and so is its ledger read
(`read_s`: `settled_before`, from W to C). The baseline, in the same run, on the same
tables: reading every settling event from W on (`whole_tail_s`, `latest_events`), the
read a run needs when it decides by the latest event of the whole tail.

Prints one JSON object: each cell's medians and, per cell, `read_s / whole_tail_s`;
then the largest S's `run_s` and `read_s` over the smallest's, near 1 when a run's cost
follows what it removes, towards largest S / smallest S when it follows the window.
Progress goes to stderr. `--quick` runs S 2000 and 8000, a span of 200, 2 runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

import pyarrow as pa  # noqa: E402
from deltalake import DeltaTable, write_deltalake  # noqa: E402
from test_broker import fill  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.conf.tables import TIMESTAMP, Table, ensure_table, scan  # noqa: E402
from dejaq.pipelines import retention  # noqa: E402
from dejaq.pipelines.log_compaction import maintain_log  # noqa: E402

_spec = importlib.util.spec_from_file_location("growth_bench", ROOT / "bench" / "growth.py")
growth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(growth)

TOPIC = "retention"
HOUR_MS = 3600 * 1000
MINUTE_MS = 60_000
BUCKETS = 16
CHECKPOINT_EVENTS = 5_000  # events per ledger append, as a busy leader's checkpoints
DEFAULT_WINDOW = [40_000, 160_000, 640_000, 1_280_000]
QUICK_WINDOW = [2_000, 8_000]


def acked(ids: range, at_ms: list[int]) -> pa.Table:
    """An "acked" event for each of `ids` (`growth.ledger_chunk`), at the given times."""
    events = growth.ledger_chunk(ids, "priority", BUCKETS, 0)
    at = pa.array([t * 1000 for t in at_ms], pa.int64()).cast(TIMESTAMP)
    return events.set_column(events.schema.get_field_index("at"), "at", at)


def write_tables(
    warehouse: str, window: int, span: int, runs: int, payload: int, now_ms: int
) -> None:
    """The buffer, and the ledger in time order: `runs` spans, then the window."""
    total = runs * span + window
    for start in range(0, total, growth.BUFFER_CHUNK):
        ids = range(start, min(total, start + growth.BUFFER_CHUNK))
        fill(warehouse, TOPIC, growth.buffer_chunk(ids, "priority", BUCKETS, payload, now_ms))
    cutoff = now_ms - HOUR_MS
    at = [
        cutoff + (i // span) * MINUTE_MS + (i % span) * MINUTE_MS // span
        for i in range(runs * span)
    ]
    rest = cutoff + runs * MINUTE_MS
    at += [rest + j * (now_ms - MINUTE_MS - rest) // window for j in range(window)]
    ledger = ensure_table(warehouse, Table.LEDGER, TOPIC)
    for start in range(0, total, CHECKPOINT_EVENTS):
        end = min(total, start + CHECKPOINT_EVENTS)
        write_deltalake(ledger, acked(range(start, end), at[start:end]), mode="append")
    maintain_log(ledger, "at", HOUR_MS)


def run_cell(window: int, span: int, runs: int, payload: int) -> dict[str, Any]:
    """One cell: the first run to C, then `runs` timed runs a minute apart."""
    now_ms = int(time.time() * 1000)
    with tempfile.TemporaryDirectory(prefix="dejaq-retention-bench-") as tmp:
        warehouse = str(Path(tmp) / "wh")
        write_tables(warehouse, window, span, runs, payload, now_ms)
        buffer = ensure_table(warehouse, Table.BUFFER, TOPIC)
        ledger = ensure_table(warehouse, Table.LEDGER, TOPIC)
        first = retention.retain(buffer, ledger, HOUR_MS, now_ms)
        assert first is not None and first.removed == 0, first
        figures: dict[str, list[float]] = {"run_s": [], "read_s": [], "whole_tail_s": []}
        removed, read = [], []
        for r in range(1, runs + 1):
            at = now_ms + r * MINUTE_MS
            upto, cutoff = retention.watermark(DeltaTable(buffer)), at - HOUR_MS
            t0 = time.perf_counter()
            retention.latest_events(ledger, upto)
            t1 = time.perf_counter()
            retention.settled_before(ledger, upto, cutoff)
            t2 = time.perf_counter()
            done = retention.retain(buffer, ledger, HOUR_MS, at)
            t3 = time.perf_counter()
            assert done is not None and done.watermark_ms == cutoff, done
            figures["whole_tail_s"].append(t1 - t0)
            figures["read_s"].append(t2 - t1)
            figures["run_s"].append(t3 - t2)
            removed.append(done.removed)
            read.append(done.messages_read)
        left = scan(buffer, Table.BUFFER, ["message_id"]).num_rows
    cell: dict[str, Any] = {"window": window, "span": span, "runs": runs}
    cell |= {name: round(statistics.median(v), 4) for name, v in figures.items()}
    cell |= {"removed": removed, "messages_read": read, "buffer_rows_left": left}
    cell["read_vs_whole_tail"] = round(cell["read_s"] / cell["whole_tail_s"], 3)
    return cell


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", default=",".join(map(str, DEFAULT_WINDOW)))
    parser.add_argument("--span", type=int, default=2_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--payload-bytes", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    windows = QUICK_WINDOW if args.quick else [int(w) for w in args.window.split(",")]
    span, runs = (200, 2) if args.quick else (args.span, args.runs)
    cells = []
    for window in windows:
        cell = run_cell(window, span, runs, args.payload_bytes)
        print(f"S={window:,}: {json.dumps(cell)}", file=sys.stderr, flush=True)
        cells.append(cell)
    small, large = cells[0], cells[-1]
    report = {
        "benchmark": "retention",
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "parameters": {
            "windows": windows,
            "span": span,
            "runs": runs,
            "buckets": BUCKETS,
            "payload_bytes": args.payload_bytes,
        },
        "cells": cells,
        "ratios": {
            "window": large["window"] / small["window"],
            "run_s": round(large["run_s"] / small["run_s"], 3),
            "read_s": round(large["read_s"] / small["read_s"], 3),
            "whole_tail_s": round(large["whole_tail_s"] / small["whole_tail_s"], 3),
        },
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
