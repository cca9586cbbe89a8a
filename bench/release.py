"""Release benchmark: timeline lateness and priority throughput, on embedded Kafka.

`python bench/release.py [--messages N] [--window-s W] [--priority-messages M]` prints one
JSON object. The release job runs as `dejaq release` in its own process, as deployed; this
process writes the buffer rows (as ingest would) and consumes the output.

Timeline: N messages due evenly over W seconds, written to the buffer in shuffled order
a few seconds before the first is due. Lateness = the output record's CreateTime (set by
the job's producer when it sends) - deliver_at; the consumer's receive time is reported
too. Its baseline, in the same run once the job has stopped, is the simplest scheduler:
one kafka-python producer (idempotent, acks=all, to a topic like the job's output) that
sleeps until each of the same N messages over the same window is due and sends it, its
lateness measured the same way; `lateness_vs_baseline` is the job's p50 and p99 over
the baseline's, a baseline under CreateTime's resolution of 1 ms counted as 1 ms.
Priority: M messages released under the default per-trigger cap, against raw
kafka-python producing the same records (idempotent, acks=all) in the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT)]

import pyarrow as pa  # noqa: E402
from deltalake import write_deltalake  # noqa: E402
from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # noqa: E402
from kafka.admin import KafkaAdminClient, NewTopic  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.conf.settings import TopicConfig  # noqa: E402
from dejaq.conf.tables import BUFFER_SCHEMA, Table, ensure_table  # noqa: E402
from dejaq.jobs import children, embedded_kafka, ports  # noqa: E402

PARTITIONS = 3
LEAD_MS = 3000  # the first message is due this long after the rows are written


def buffer_rows(kind: str, sort_keys: list[int], first_offset: int) -> pa.Table:
    now = dt.datetime.now(dt.UTC)
    n = len(sort_keys)
    offsets = list(range(first_offset, first_offset + n))
    stamps = [dt.datetime.fromtimestamp(k / 1000, dt.UTC) for k in sort_keys]
    return pa.table(
        {
            "message_id": [f"m-{o}" for o in offsets],
            "bucket": [o % 4 for o in offsets],
            "sort_key": sort_keys,
            "priority": sort_keys if kind == "priority" else [None] * n,
            "deliver_at": stamps if kind == "timeline" else [None] * n,
            "event_time": [None] * n,
            "key": [f"key-{o % 100}".encode() for o in offsets],
            "payload": [b"x" * 100] * n,
            "headers": [[]] * n,
            "source_topic": ["in"] * n,
            "source_partition": [0] * n,
            "source_offset": offsets,
            "produced_at": [now] * n,
            "ingested_at": [now] * n,
        },
        schema=BUFFER_SCHEMA,
    )


class Output:
    """Reads an output topic from the start, noting each record's receive time."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self.consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        self.consumer.seek_to_beginning()
        self.records: list[tuple[int, int, dict[str, bytes]]] = []  # create ms, receive ms

    def read_until(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.records) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.records)} of {n} output records arrived")
            for batch in self.consumer.poll(timeout_ms=50).values():
                received = int(time.time() * 1000)
                self.records += [(r.timestamp, received, dict(r.headers)) for r in batch]


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_job(conf: Path, topic: str) -> subprocess.Popen:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dejaq.jobs.cli",
            "release",
            "--topic",
            topic,
            "--conf-file",
            str(conf),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_job(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def warm_up(warehouse: str, bootstrap: str, topic: str, kind: str, out: Output) -> None:
    """One message through the job: Spark has started and the first trigger ran."""
    path = ensure_table(warehouse, Table.BUFFER, topic)
    key = 0 if kind == "priority" else int(time.time() * 1000) - 1
    write_deltalake(path, buffer_rows(kind, [key], 10**9), mode="append")
    out.read_until(1, timeout_s=300)
    out.records.clear()


def spread(values: list[int]) -> dict[str, int]:
    """The figures each lateness is read by: its median, its tail and its worst."""
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "max": max(values)}


def due_times(n: int, window_ms: int) -> list[int]:
    """n times in epoch ms, evenly over the window, the first LEAD_MS from now."""
    first = int(time.time() * 1000) + LEAD_MS
    return [first + i * window_ms // n for i in range(n)]


def sleeping_producer(bootstrap: str, n: int, window_ms: int) -> list[int]:
    """The lateness of the simplest scheduler: a plain producer that sleeps until each
    message is due and sends it, the same records the job sends, measured as its are."""
    out = Output(bootstrap, "tl-raw")
    producer = KafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    try:
        producer.send("tl-raw", b"warm-up", headers=[("dejaq-deliver-at", b"0")])
        out.read_until(1, timeout_s=60)  # connected, the topic's metadata known
        out.records.clear()
        for r in buffer_rows("timeline", due_times(n, window_ms), 0).to_pylist():
            due = r["sort_key"]
            while (now := time.time() * 1000) < due:  # never early: sleep may wake before
                time.sleep((due - now) / 1000)
            headers = [("dejaq-id", r["message_id"].encode()), ("dejaq-deliver-at", b"%d" % due)]
            producer.send("tl-raw", key=r["key"], value=r["payload"], headers=headers)
        producer.flush()
    finally:
        producer.close()
    out.read_until(n, timeout_s=120)
    return [c - int(h["dejaq-deliver-at"]) for c, _, h in out.records]


def timeline(warehouse: str, bootstrap: str, conf: Path, n: int, window_ms: int) -> dict:
    out = Output(bootstrap, "tl-out")
    proc = start_job(conf, "tl")
    try:
        warm_up(warehouse, bootstrap, "tl", "timeline", out)
        due = due_times(n, window_ms)
        random.shuffle(due)
        path = ensure_table(warehouse, Table.BUFFER, "tl")
        write_deltalake(path, buffer_rows("timeline", due, 0), mode="append")
        out.read_until(n, timeout_s=LEAD_MS / 1000 + window_ms / 1000 + 120)
    finally:
        stop_job(proc)
    create = [c - int(h["dejaq-deliver-at"]) for c, _, h in out.records]
    receive = [r - int(h["dejaq-deliver-at"]) for _, r, h in out.records]
    span_ms = max(c for c, _, _ in out.records) - min(c for c, _, _ in out.records)
    slept = sleeping_producer(bootstrap, n, window_ms)
    lateness, baseline = spread(create), spread(slept)
    return {
        "messages": n,
        "window_ms": window_ms,
        "lateness_measured_as": "output record CreateTime (set by the job's producer at send)",
        "lateness_ms": lateness,
        "receive_lateness_ms": spread(receive),
        "early": sum(1 for v in create if v < 0),
        "early_by_receive_time": sum(1 for v in receive if v < 0),
        "throughput_msgs_per_s": round(n / max(span_ms / 1000, 0.001), 1),
        "baseline_sleeping_producer": {
            "measured_as": "kafka-python, sleeping until each is due, then send; CreateTime",
            "lateness_ms": baseline,
            "early": sum(1 for v in slept if v < 0),
        },
        "lateness_vs_baseline": {
            q: round(lateness[q] / max(baseline[q], 1), 3) for q in ("p50", "p99")
        },
    }


def raw_produce(bootstrap: str, rows: pa.Table) -> float:
    """Seconds for plain kafka-python to send and get acks for the same records."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    try:
        started = time.monotonic()
        for r in rows.to_pylist():
            headers = [("dejaq-id", r["message_id"].encode())]
            producer.send("raw-out", key=r["key"], value=r["payload"], headers=headers)
        producer.flush()
        return time.monotonic() - started
    finally:
        producer.close()


def priority(warehouse: str, bootstrap: str, conf: Path, n: int) -> dict:
    out = Output(bootstrap, "pr-out")
    proc = start_job(conf, "pr")
    rows = buffer_rows("priority", [random.randrange(65536) for _ in range(n)], 0)
    try:
        warm_up(warehouse, bootstrap, "pr", "priority", out)
        path = ensure_table(warehouse, Table.BUFFER, "pr")
        started = time.time()
        write_deltalake(path, rows, mode="append")
        out.read_until(n, timeout_s=600)
    finally:
        stop_job(proc)
    last_sent = max(c for c, _, _ in out.records) / 1000
    release_s = last_sent - started
    raw_s = raw_produce(bootstrap, rows)
    return {
        "messages": n,
        "release_msgs_per_s": round(n / release_s, 1),
        "release_seconds": round(release_s, 3),
        "measured_as": "buffer commit to the last output record's CreateTime",
        "raw_kafka_python_msgs_per_s": round(n / raw_s, 1),
        "raw_kafka_python_seconds": round(raw_s, 3),
        "release_vs_raw": round(raw_s / release_s, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=2000, help="timeline messages")
    p.add_argument("--window-s", type=float, default=10.0, help="timeline: due over this window")
    p.add_argument("--priority-messages", type=int, default=20000)
    p.add_argument(
        "--interval-ms",
        type=int,
        default=TopicConfig.model_fields["release_interval_ms"].default,
        help="release_interval_ms (default: the configuration's)",
    )
    args = p.parse_args()
    import pyspark

    with tempfile.TemporaryDirectory(prefix="dejaq-bench-") as tmp:
        port = ports.free_port()
        kafka = embedded_kafka.start(port, Path(tmp) / "kafka")
        bootstrap = f"127.0.0.1:{port}"
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap)
            admin.create_topics(
                [NewTopic(t, PARTITIONS, 1) for t in ("tl-out", "tl-raw", "pr-out", "raw-out")]
            )
            admin.close()
            warehouse = str(Path(tmp) / "warehouse")
            conf = Path(tmp) / "dejaq.yaml"
            common = (
                "source: [in], buckets: 4, delivery: release, "
                f"release_interval_ms: {args.interval_ms}"
            )
            conf.write_text(
                f"warehouse: {warehouse}\n"
                f"kafka: {{bootstrap: '{bootstrap}'}}\n"
                "topics:\n"
                f"  - {{name: tl, kind: timeline, output: tl-out, {common}}}\n"
                f"  - {{name: pr, kind: priority, output: pr-out, {common}}}\n"
            )
            result = {
                "timeline": timeline(
                    warehouse, bootstrap, conf, args.messages, int(args.window_s * 1000)
                ),
                "priority": priority(warehouse, bootstrap, conf, args.priority_messages),
            }
        finally:
            children.stop(kafka)
    result["parameters"] = {
        "release_interval_ms": args.interval_ms,
        "max_per_trigger": 10000,
        "payload_bytes": 100,
        "output_partitions": PARTITIONS,
        "kafka": "embedded Apache Kafka (one KRaft node) on 127.0.0.1",
    }
    result["machine"] = machine(spark=pyspark.__version__)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
