"""Time to ready, memory and lease latency of one broker node over a grid of history.

    .venv/bin/python bench/growth.py [--settled 100000,400000,1600000] [--pending 10000]
        [--payload-bytes 16] [--kind priority|timeline] [--buckets 16] [--quick]

A node's time to ready and its memory should depend on what it serves: the pending
messages, and the settled ones still inside the retention window. Not on the topic's
history. Each cell of the grid (S settled, P pending) gets a fresh warehouse, written
straight into Delta with delta-rs as the ingest and a broker's checkpoints would (the
contract's schemas, the buffer partitioned by bucket): S + P buffer rows, all ingested
three hours ago, and S "acked" ledger events, two hours ago (past a retention of an
hour), in appends of 50k as checkpoints make them. Then one node starts, a 1-node
cluster, and the cell records: seconds from its process start to its HTTP port
listening (`listening_s`: it listens once its indexes are loaded) and to /readyz
answering 200 (`ready_s`: its Raft election too, a random 0.5-1.5 s more); its RSS once
ready (VmRSS; VmHWM as `rss_peak_mb`, the high-water mark of loading); and the p50/p99
latency of one consumer leasing 100 at a time and acking each batch, over 30 leases of
the head, with the broker's own client; then the share of a core the node uses over 5 s
with nothing asked of it (`idle_cpu_pct`: following the tables, metrics, Raft's ticks;
and, in a cell without a retention run before it starts, its own first one). Before the
node starts, the release job's start over the same tables (`release_start_s`: its first
refresh, in this process).

Each cell runs twice: without retention (the buffer keeps every settled row and the
node reads the whole ledger, as a buffer nothing has trimmed yet) and with one
retention run over the cell's tables before the node starts, as the leader makes them
(`dejaq.pipelines.retention.retain`, the topic's default hour), timed as `retention_s`.

Baseline in the same run: the cell with the smallest S of each P and mode. `ratios`
divides the largest S's ready and listening times, RSS and peak RSS by the baseline's,
per mode: near 1 when a node's cost follows P alone, towards largest S / smallest S
when it follows history.
Prints one JSON object; progress goes to stderr. `--quick` runs a small grid (S 2000 and
8000, P 500) in well under a minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

import pyarrow as pa  # noqa: E402
import yaml  # noqa: E402
from deltalake import write_deltalake  # noqa: E402
from test_broker import fill  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.client import Client  # noqa: E402
from dejaq.conf.settings import (  # noqa: E402
    BrokerConfig,
    Delivery,
    KafkaConfig,
    Settings,
    TopicConfig,
)
from dejaq.conf.tables import (  # noqa: E402
    BUFFER_SCHEMA,
    HEADERS,
    LEDGER_SCHEMA,
    TIMESTAMP,
    LedgerEvent,
    Table,
    ensure_table,
)
from dejaq.jobs import cluster  # noqa: E402
from dejaq.jobs.children import wait_for_port  # noqa: E402
from dejaq.pipelines import retention  # noqa: E402
from dejaq.pipelines.release import Releaser  # noqa: E402

TOPIC = "growth"
CONSUMER = "growth-bench"
BUFFER_CHUNK = 100_000  # rows per buffer append: the writer's memory stays bounded
LEDGER_APPEND = 50_000  # events per ledger append, as a broker checkpoint writes them
INGESTED_AGO_MS = 3 * 3600 * 1000
ACKED_AGO_MS = 2 * 3600 * 1000  # past a retention of an hour
LEASE_BATCH = 100
LEASES = 30
IDLE_S = 5.0
READY_TIMEOUT_S = 1800
DEFAULT_SETTLED = [100_000, 400_000, 1_600_000]
DEFAULT_PENDING = [10_000]
QUICK_SETTLED = [2_000, 8_000]
QUICK_PENDING = [500]


def sort_keys(ids: range, kind: str, start_ms: int) -> list[int]:
    """Spread over the range: priorities 0..65535, or deliver_at within an hour from
    `start_ms` (in the past, so every message is deliverable)."""
    span = 65_536 if kind == "priority" else 3_600_000
    base = 0 if kind == "priority" else start_ms
    return [base + (i * 7919) % span for i in ids]


def buffer_chunk(ids: range, kind: str, buckets: int, payload_bytes: int, now_ms: int) -> pa.Table:
    """Buffer rows `ids`: distinct ids and source offsets, random payloads."""
    n = len(ids)
    ingested_ms = now_ms - INGESTED_AGO_MS
    keys = sort_keys(ids, kind, ingested_ms)
    blob = os.urandom(n * payload_bytes)
    ingested = pa.array([ingested_ms * 1000] * n, pa.int64()).cast(TIMESTAMP)
    columns = {
        "message_id": pa.array([f"m{i}" for i in ids], pa.string()),
        "bucket": pa.array([i % buckets for i in ids], pa.int32()),
        "sort_key": pa.array(keys, pa.int64()),
        "priority": pa.array(keys if kind == "priority" else [None] * n, pa.int32()),
        "deliver_at": (
            pa.array([k * 1000 for k in keys], pa.int64()).cast(TIMESTAMP)
            if kind == "timeline"
            else pa.nulls(n, TIMESTAMP)
        ),
        "event_time": pa.nulls(n, TIMESTAMP),
        "key": pa.array([b"k%d" % i for i in ids], pa.binary()),
        "payload": pa.array(
            [blob[j : j + payload_bytes] for j in range(0, n * payload_bytes, payload_bytes)],
            pa.binary(),
        ),
        "headers": pa.array([[]] * n, HEADERS),
        "source_topic": pa.array([f"{TOPIC}-in"] * n, pa.string()),
        "source_partition": pa.array([0] * n, pa.int32()),
        "source_offset": pa.array(ids, pa.int64()),
        "produced_at": ingested,
        "ingested_at": ingested,
    }
    return pa.table(columns, schema=BUFFER_SCHEMA)


def ledger_chunk(ids: range, kind: str, buckets: int, now_ms: int) -> pa.Table:
    """An "acked" event, delivered once, for each of `ids`."""
    n = len(ids)
    columns = {
        "message_id": pa.array([f"m{i}" for i in ids], pa.string()),
        "bucket": pa.array([i % buckets for i in ids], pa.int32()),
        "event": pa.array([LedgerEvent.ACKED.value] * n, pa.string()),
        "sort_key": pa.array(sort_keys(ids, kind, now_ms - INGESTED_AGO_MS), pa.int64()),
        "deliveries": pa.array([1] * n, pa.int32()),
        "at": pa.array([(now_ms - ACKED_AGO_MS) * 1000] * n, pa.int64()).cast(TIMESTAMP),
    }
    return pa.table(columns, schema=LEDGER_SCHEMA)


def write_history(
    warehouse: str, topic: TopicConfig, settled: int, pending: int, payload: int
) -> None:
    """Message ids m0 to m<settled - 1> settled, the next `pending` ones pending."""
    now_ms = int(time.time() * 1000)
    total = settled + pending
    for start in range(0, total, BUFFER_CHUNK):
        ids = range(start, min(total, start + BUFFER_CHUNK))
        fill(warehouse, topic.name, buffer_chunk(ids, topic.kind, topic.buckets, payload, now_ms))
    # Untagged appends: a checkpoint's (app id, seq) tag would have the fresh node, whose
    # Raft log starts again at seq 1, skip writing its own acks to the ledger.
    ledger = ensure_table(warehouse, Table.LEDGER, topic.name)
    for start in range(0, settled, LEDGER_APPEND):
        ids = range(start, min(settled, start + LEDGER_APPEND))
        write_deltalake(ledger, ledger_chunk(ids, topic.kind, topic.buckets, now_ms), mode="append")


def retain(warehouse: str, topic: TopicConfig) -> float:
    """Seconds one retention run took over the cell's tables."""
    t0 = time.perf_counter()
    retention.retain(
        ensure_table(warehouse, Table.BUFFER, topic.name),
        ensure_table(warehouse, Table.LEDGER, topic.name),
        topic.settled_retention_ms,
        int(time.time() * 1000),
    )
    return round(time.perf_counter() - t0, 2)


def release_start(settings: Settings, topic: TopicConfig) -> tuple[float, int]:
    """Seconds the release job's first refresh over the cell's tables takes (its start:
    the buffer, and the ledger from the retention watermark), and what it finds pending.
    In this process: the release job reads the same tables on its driver."""
    released = topic.model_copy(update={"delivery": Delivery.RELEASE, "output": f"{TOPIC}-out"})
    t0 = time.perf_counter()
    releaser = Releaser(settings, released)
    releaser.refresh()
    return round(time.perf_counter() - t0, 2), len(releaser.pending)


def proc_status_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB (Linux /proc)."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)
    return fields


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_pct(pid: int, seconds: float) -> float:
    """The share of one core a process uses over `seconds` with nothing asked of it: a
    node's background work (following tables, metrics, ticks) should follow what is
    pending, not the history."""
    before = cpu_seconds(pid)
    time.sleep(seconds)  # the measuring window, not a wait for anything
    return round((cpu_seconds(pid) - before) / seconds * 100, 1)


def pct(values: list[float], p: float) -> float:
    """The p-th quantile (nearest rank) in ms."""
    values = sorted(values)
    return round(values[min(len(values) - 1, int(p * len(values)))] * 1000, 2)


def lease_latency(url: str, leases: int) -> tuple[list[float], int]:
    """One consumer leasing LEASE_BATCH and acking, `leases` times: each lease's
    seconds, and how many messages were leased. A heartbeat joins the topic first, so
    no lease pays for the join. This process's heap is frozen meanwhile: a full
    collection of it (60-70 ms after writing a large history) inside a lease would
    count this client's pause as the node's."""
    took: list[float] = []
    leased = 0
    gc.collect()
    gc.freeze()
    try:
        with Client([url]) as client:
            client.heartbeat(TOPIC, CONSUMER)
            for _ in range(leases):
                t0 = time.perf_counter()
                messages = client.lease(TOPIC, CONSUMER, LEASE_BATCH)
                took.append(time.perf_counter() - t0)
                leased += len(messages)
                client.ack(TOPIC, CONSUMER, [m.id for m in messages])
    finally:
        gc.unfreeze()
    return took, leased


def run_cell(
    args: argparse.Namespace, settled: int, pending: int, retained: bool
) -> dict[str, Any]:
    """One cell: write its history, retain (or not), start a node, measure it, clean up."""
    tmp = Path(tempfile.mkdtemp(prefix="dejaq-growth-", dir=args.tmp))
    try:
        warehouse = str(tmp / "warehouse")
        topic = TopicConfig(
            name=TOPIC, kind=args.kind, source=[f"{TOPIC}-in"], buckets=args.buckets
        )
        progress(f"S={settled:,} P={pending:,}: writing the history")
        t0 = time.perf_counter()
        write_history(warehouse, topic, settled, pending, args.payload_bytes)
        write_s = round(time.perf_counter() - t0, 2)
        retention_s = retain(warehouse, topic) if retained else None
        progress(f"S={settled:,} P={pending:,}: written in {write_s} s, retention {retention_s}")
        settings = Settings(
            warehouse=warehouse,
            kafka=KafkaConfig(bootstrap="127.0.0.1:9"),
            broker=BrokerConfig(lease_ms=30_000, heartbeat_timeout_ms=60_000),
            topics=[topic],
        )
        release_s, release_pending = release_start(settings, topic)
        conf = tmp / "dejaq.yaml"
        conf.write_text(yaml.safe_dump(settings.model_dump(mode="json", exclude_defaults=True)))
        # The node's settings are the file's alone: no DEJAQ_* variable overrides them.
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEJAQ_")}
        nodes = cluster.plan(1, tmp / "raft")
        node = nodes[0]
        t0 = time.perf_counter()
        cluster.start_node(node, nodes, str(conf), env)
        try:
            # Listening once its indexes are loaded; ready once it has elected itself
            # too, 0.5-1.5 s later (a random Raft election timeout).
            port = int(node.http.rsplit(":", 1)[1])
            wait_for_port(port, READY_TIMEOUT_S, node.proc, "the broker node")
            listening_s = round(time.perf_counter() - t0, 2)
            cluster.wait_ready(nodes, READY_TIMEOUT_S)
            ready_s = round(time.perf_counter() - t0, 2)
            assert node.proc is not None
            if node.proc.poll() is not None:
                raise RuntimeError(f"the broker exited with code {node.proc.returncode}")
            memory = proc_status_mb(node.proc.pid)
            progress(f"S={settled:,} P={pending:,}: ready in {ready_s} s, {memory}")
            took, leased = lease_latency(node.url, max(1, min(LEASES, pending // LEASE_BATCH)))
            idle = idle_cpu_pct(node.proc.pid, IDLE_S)
        finally:
            cluster.stop_node(node)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cell = {
        "settled": settled,
        "pending": pending,
        "retention": retained,
        "ready_s": ready_s,
        "listening_s": listening_s,
        "rss_mb": memory["VmRSS"],
        "rss_peak_mb": memory["VmHWM"],
        "lease_p50_ms": pct(took, 0.5),
        "lease_p99_ms": pct(took, 0.99),
        "leased": leased,
        "idle_cpu_pct": idle,
        "retention_s": retention_s,
        "release_start_s": release_s,
        "release_pending": release_pending,
        "write_s": write_s,
    }
    progress(f"S={settled:,} P={pending:,}: {json.dumps(cell)}")
    return cell


def ratios(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and pending value, the largest S's figures over the smallest S's.
    Listening and peak RSS too: the first without the election's random second, the
    second the memory a node must have to start at all."""
    out: dict[str, Any] = {}
    for retained in sorted({c["retention"] for c in cells}):
        for pending in sorted({c["pending"] for c in cells}):
            mine = sorted(
                (c for c in cells if c["pending"] == pending and c["retention"] == retained),
                key=lambda c: c["settled"],
            )
            small, large = mine[0], mine[-1]
            key = f"{'with' if retained else 'without'}_retention/pending_{pending}"
            out[key] = {
                f"{name}_largest_vs_smallest": round(large[field] / small[field], 2)
                for name, field in (
                    ("ready_s", "ready_s"),
                    ("rss", "rss_mb"),
                    ("listening_s", "listening_s"),
                    ("rss_peak", "rss_peak_mb"),
                    ("release_start_s", "release_start_s"),
                )
            }
    return out


def progress(line: str) -> None:
    print(f"growth: {line}", file=sys.stderr, flush=True)


def counts(text: str) -> list[int]:
    """A comma-separated list of counts: "100000,400000"."""
    values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected counts >= 0, comma-separated; got {text!r}")
    return values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settled", type=counts, help=f"settled history sizes ({DEFAULT_SETTLED})")
    ap.add_argument("--pending", type=counts, help=f"pending counts ({DEFAULT_PENDING})")
    ap.add_argument("--payload-bytes", type=int, default=16)
    ap.add_argument("--kind", choices=["priority", "timeline"], default="priority")
    ap.add_argument("--buckets", type=int, default=16)
    ap.add_argument("--tmp", help="where each cell's warehouse goes (default: the temp folder)")
    ap.add_argument(
        "--quick", action="store_true", help=f"S {QUICK_SETTLED}, P {QUICK_PENDING}: for a test"
    )
    ap.add_argument(
        "--retention",
        choices=["both", "on", "off"],
        default="both",
        help="run each cell without and with a retention run first (both)",
    )
    args = ap.parse_args()
    settled = args.settled or (QUICK_SETTLED if args.quick else DEFAULT_SETTLED)
    pending = args.pending or (QUICK_PENDING if args.quick else DEFAULT_PENDING)
    if min(pending) < 1:
        ap.error("--pending: at least 1 message")
    # Unrecorded: the first node of a run starts from cold caches (imports, page cache),
    # which would slow the baseline cell, the smallest, and flatter the ratios.
    progress("warm-up: one node over an empty history")
    run_cell(args, 0, LEASE_BATCH, False)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.retention]
    cells = [
        run_cell(args, s, p, retained)
        for retained in modes
        for p in pending
        for s in sorted(settled)
    ]
    print(
        json.dumps(
            {
                "benchmark": "growth",
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "machine": machine(),
                "parameters": {
                    "settled": sorted(settled),
                    "pending": pending,
                    "payload_bytes": args.payload_bytes,
                    "kind": args.kind,
                    "buckets": args.buckets,
                    "nodes": 1,
                    "lease_batch": LEASE_BATCH,
                    "leases_per_cell": LEASES,
                    "buffer_chunk_rows": BUFFER_CHUNK,
                    "ledger_append_events": LEDGER_APPEND,
                    "ingested_ago_s": INGESTED_AGO_MS // 1000,
                    "acked_ago_s": ACKED_AGO_MS // 1000,
                },
                "cells": cells,
                "ratios": ratios(cells),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
