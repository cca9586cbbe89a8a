"""A leader's ledger checkpoints over a long run: CPU per commit as commits accumulate.

    .venv/bin/python bench/ledger_commits.py [--commits 100] [--events 2000] [--rounds 2]

The leader appends one ledger commit a second (`write_ledger`: it opens the table, reads
its tag, appends), and each open of, and commit to, a Delta table replays its log since
the table's last Delta checkpoint. A table made by the contract (`TABLE_PROPERTIES`:
one each 10 commits) against the baseline, the same table with delta-rs's default of
100, in the same run: N commits of E acked events each to both, alternated commit by
commit, R times on fresh tables, both compacted every `COMPACT_EVERY` commits as the
leader compacts its ledger (untimed). Prints one JSON object: the mean CPU ms per commit of
each (the process's, delta-rs's threads included), per tenth of the run, and the
ratio of the means, and each ledger's rows (every event once). A cost that follows
history climbs tenth by tenth; one that does not stays flat.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT)]

from deltalake import DeltaTable  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.broker.state.handles import handles_in, mhs, packed  # noqa: E402
from dejaq.broker.state.settlements import Run  # noqa: E402
from dejaq.broker.storage.ledger_writer import COMPACT_EVERY, write_ledger  # noqa: E402
from dejaq.conf.tables import LEDGER_SCHEMA, LedgerEvent, Table, scan, table_path  # noqa: E402
from dejaq.pipelines.log_compaction import compact_log  # noqa: E402

TOPIC = "jobs"


# The runs' messages' ids by handle, as the leader's index names them.
IDS: dict[int, str] = {}


def runs(first_seq: int, events: int, at: int) -> list[Run]:
    """`events` acked events from `first_seq` on, in runs of 100 as a batch-100 ack makes
    them, with 16-byte ids."""
    out = []
    for start in range(first_seq, first_seq + events, 100):
        ids = [f"m{s:015d}" for s in range(start, start + 100)]
        IDS.update(zip(mhs(ids), ids, strict=True))
        out.append(
            Run(
                start,
                packed(ids),
                array("H", [start // 100 % 64]) * 100,
                LedgerEvent.ACKED,
                array("q", range(100)),
                array("i", [1]) * 100,
                at,
            )
        )
    return out


def names(handles: bytes) -> list[str | None]:
    """The ids of the runs' messages (`ledger_writer.Names`)."""
    return [IDS.get(h) for h in handles_in(handles)]


def tenths(values: list[float]) -> list[float]:
    n = max(len(values) // 10, 1)
    return [
        round(sum(values[i : i + n]) / len(values[i : i + n]), 1) for i in range(0, len(values), n)
    ]


def commit_all(
    warehouses: dict[str, str], commits: int, events: int, r: int
) -> dict[str, list[float]]:
    """`commits` ledger commits of `events` each to every warehouse's ledger, alternated
    commit by commit (which goes first changing with `r`): the CPU ms of each."""
    baseline = table_path(warehouses["delta_rs_default"], Table.LEDGER, TOPIC)
    DeltaTable.create(baseline, LEDGER_SCHEMA)
    per: dict[str, list[float]] = {name: [] for name in warehouses}
    for c in range(commits):
        batch = runs(c * events + 1, events, 1_700_000_000_000 + c)
        order = list(warehouses) if (c + r) % 2 == 0 else list(reversed(warehouses))
        for name in order:
            t0 = time.process_time()
            write_ledger(warehouses[name], TOPIC, batch, names)
            per[name].append((time.process_time() - t0) * 1000)
        # As the leader compacts, untimed; not `maintain_log`, which would give the
        # baseline the contract's properties.
        if (c + 1) % COMPACT_EVERY == 0:
            for name in warehouses:
                compact_log(table_path(warehouses[name], Table.LEDGER, TOPIC), "at")
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", type=int, default=100, help="per table and round")
    ap.add_argument("--events", type=int, default=2000, help="per commit")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    ms: dict[str, list[list[float]]] = {"contract": [], "delta_rs_default": []}
    rows: dict[str, list[int]] = {name: [] for name in ms}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="ledger-commits-") as tmp:
            warehouses = {name: f"{tmp}/{name}" for name in ms}
            per = commit_all(warehouses, args.commits, args.events, r)
            for name in ms:
                ms[name].append(per[name])
                ledger = table_path(warehouses[name], Table.LEDGER, TOPIC)
                rows[name].append(scan(ledger, Table.LEDGER, ["message_id"]).num_rows)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    by_commit = {
        name: [sum(v) / len(v) for v in zip(*rounds, strict=True)] for name, rounds in ms.items()
    }
    mean = {name: round(sum(v) / len(v), 2) for name, v in by_commit.items()}
    print(
        json.dumps(
            {
                "benchmark": "ledger checkpoint commits over a long run",
                "cpu_ms_per_commit": mean,
                "cpu_ms_per_commit_by_tenth": {name: tenths(v) for name, v in by_commit.items()},
                "contract_vs_delta_rs_default": round(
                    mean["contract"] / mean["delta_rs_default"], 3
                ),
                "ledger_rows_per_round": rows,
                "parameters": vars(args),
                "machine": machine(),
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
