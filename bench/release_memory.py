"""What a release job's driver holds per pending message once its start has read the
buffer.

    .venv/bin/python bench/release_memory.py [--pending 200000] [--payload 1024]

The job keeps every pending message in its driver (payload, key, headers and its place
in the order) and reads the whole buffer at start. A timeline buffer of P messages due
tomorrow, each with a payload of B bytes and a header, is written as the ingest writes
it; then, each in a fresh process, the resident memory the read adds is measured twice:
the release job's start (`Releaser.refresh`), and the baseline, the same rows read and
held as one Arrow table (the columns alone, what any reader of them holds). Prints one
JSON object: bytes per message of each, the read's seconds, and the ratio.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

from test_release import add_buffer, settings_for  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.conf.tables import Table, ensure_table, scan  # noqa: E402

SLICE = 50_000  # rows an append writes, as the ingest's batches would


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(tmp: Path, how: str) -> dict:
    """In this process: the resident memory one way of reading the buffer adds, per row."""
    settings = settings_for(tmp, "127.0.0.1:9", "timeline", "out")
    gc.collect()
    before, began = resident(), time.monotonic()
    if how == "release":
        from dejaq.pipelines.release import Releaser

        held = Releaser(settings, settings.topic("jobs"))
        held.refresh()
        rows = len(held.pending)
    else:  # read as every reader of the tables here reads them (`conf.tables.scan`)
        held = scan(ensure_table(settings.warehouse, Table.BUFFER, "jobs"), Table.BUFFER)
        rows = held.num_rows
    seconds = time.monotonic() - began
    gc.collect()
    return {
        "rows": rows,
        "seconds": round(seconds, 2),
        "bytes_per_message": (resident() - before) // rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pending", type=int, default=200_000)
    parser.add_argument("--payload", type=int, default=1024)
    parser.add_argument("--measure", choices=["release", "arrow"], help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.tmp), args.measure)))
        return 0
    with tempfile.TemporaryDirectory(prefix="dejaq-release-memory-") as tmp:
        settings = settings_for(Path(tmp), "127.0.0.1:9", "timeline", "out")
        tomorrow = int(time.time() * 1000) + 86_400_000
        for first in range(0, args.pending, SLICE):
            keys = [tomorrow + i for i in range(first, min(first + SLICE, args.pending))]
            add_buffer(settings, "timeline", keys, first_offset=first, payload_bytes=args.payload)
        runs = {}
        for how in ("release", "arrow"):
            command = [sys.executable, __file__, "--measure", how, "--tmp", tmp]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[how] = json.loads(done.stdout.splitlines()[-1])
    release, arrow = runs["release"], runs["arrow"]
    report = {
        "benchmark": "release_memory",
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "parameters": {"pending": args.pending, "payload_bytes": args.payload},
        "release_job": release,
        "arrow_table": arrow,
        "release_vs_arrow": round(release["bytes_per_message"] / arrow["bytes_per_message"], 3)
        if arrow["bytes_per_message"] > 0
        else None,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
