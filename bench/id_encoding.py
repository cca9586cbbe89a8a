"""What the id column's encoding costs a ledger append, and its reads.

    .venv/bin/python bench/id_encoding.py [--rows 50000] [--appends 3] [--rounds 7]

The leader appends its ledger once a second, a row per settled message, in delta-rs's
own threads beside the event loop's work. DejaQ writes the ids by prefix deltas, with no
dictionary (`APPEND_PROPERTIES`); the baseline, in the same run, is delta-rs's default
(a dictionary, spilled to plain once the ids outgrow it). Each round appends A batches
of N ledger rows to a fresh table in each way, alternated, then reads each back as the
broker does (`conf.tables.scan`). Two id shapes: sequential (`m000000123`) and random
(UUID4). Prints one JSON object: per shape, the median CPU µs a row (the process's,
delta-rs's threads included) of the appends and of the read, the files' bytes, and
DejaQ's ratios to the baseline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT)]

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from deltalake import WriterProperties, write_deltalake  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.conf.tables import APPEND_PROPERTIES, LEDGER_SCHEMA, TIMESTAMP, Table, scan  # noqa: E402

WAYS: dict[str, WriterProperties | None] = {"delta_rs_default": None, "dejaq": APPEND_PROPERTIES}


def ledger_rows(first: int, n: int, shape: str, rng: np.random.Generator) -> pa.Table:
    """`n` acked events as a checkpoint writes them, ids of `shape` from number `first`."""
    if shape == "sequential":
        ids = [f"m{i:09d}" for i in range(first, first + n)]
    else:
        ids = [str(uuid.UUID(int=int(x), version=4)) for x in rng.integers(0, 2**63, n)]
    at = pa.array(1_700_000_000_000 + np.arange(n, dtype=np.int64) * 20, pa.int64())
    return pa.table(
        {
            "message_id": ids,
            "bucket": rng.integers(0, 64, n, dtype=np.int32),
            "event": ["acked"] * n,
            "sort_key": rng.integers(0, 65_536, n),
            "deliveries": np.ones(n, np.int32),
            "at": at.cast(pa.timestamp("ms", tz="UTC")).cast(TIMESTAMP),
        },
        schema=LEDGER_SCHEMA,
    )


def bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.parquet"))


def measure(args: argparse.Namespace, shape: str, root: Path) -> dict:
    rng = np.random.default_rng(7)
    batches = [ledger_rows(i * args.rows, args.rows, shape, rng) for i in range(args.appends)]
    rows = args.rows * args.appends
    writes: dict[str, list[float]] = {w: [] for w in WAYS}
    reads: dict[str, list[float]] = {w: [] for w in WAYS}
    sizes: dict[str, int] = {}
    for _ in range(args.rounds):
        for way, properties in WAYS.items():
            path = root / f"{shape}-{way}"
            shutil.rmtree(path, ignore_errors=True)
            t = time.process_time()
            for batch in batches:
                write_deltalake(path, batch, mode="append", writer_properties=properties)
            writes[way].append((time.process_time() - t) / rows * 1e6)
            t = time.process_time()
            read = scan(str(path), Table.LEDGER)
            reads[way].append((time.process_time() - t) / rows * 1e6)
            if read.num_rows != rows:
                raise SystemExit(f"{way} read {read.num_rows} rows of {rows}")
            sizes[way] = bytes_under(path)
    med = {w: (statistics.median(writes[w]), statistics.median(reads[w])) for w in WAYS}
    base, ours = med["delta_rs_default"], med["dejaq"]
    return {
        "append_cpu_us_per_row": {w: round(m[0], 3) for w, m in med.items()},
        "append_cpu_us_per_row_runs": {w: [round(v, 3) for v in writes[w]] for w in WAYS},
        "read_cpu_us_per_row": {w: round(m[1], 3) for w, m in med.items()},
        "bytes": sizes,
        "ratio_append_cpu": round(ours[0] / base[0], 2),
        "ratio_read_cpu": round(ours[1] / base[1], 2),
        "ratio_bytes": round(sizes["dejaq"] / sizes["delta_rs_default"], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=50_000, help="rows an append")
    ap.add_argument("--appends", type=int, default=3, help="appends a table and round")
    ap.add_argument("--rounds", type=int, default=7, help="alternations of the two ways")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dejaq-ids-") as root:
        shapes = {s: measure(args, s, Path(root)) for s in ("sequential", "uuid4")}
    print(
        json.dumps(
            {
                "benchmark": "ledger appends: the id column's encoding",
                "shapes": shapes,
                "parameters": {"rows": args.rows, "appends": args.appends, "rounds": args.rounds},
                "machine": machine(),
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
