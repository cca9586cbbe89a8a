"""Ingest benchmark: Kafka → Delta buffer on Apache Kafka, both connector paths, one run.

Produces N 100-byte messages with random priorities to a 4-partition topic on the
embedded Apache Kafka, then measures in the same run:
- baseline: one kafka-python consumer process reading the topic end to end;
- floor: Spark's plain copy of the topic, `format("kafka")` → `format("delta")`, no
  parsing: what this job cannot beat;
- ingest on the JVM path (`format("kafka")`, `format("delta")`) and on the Python Data
  Source path (kafka-python, delta-rs): `IngestJob` with availableNow (what
  `dejaq ingest --once` runs), each on its own copy of the topic, with each batch's phases;
- the floor in the buffer's shape: the same copy writing what the ingest writes, the raw
  records as a bucket-partitioned, idempotent (app id, batch id) append through the
  ingest's own writer (delta-rs), without parsing, dedup or quarantine;
- visibility latency on the JVM path: a continuous ingest while a producer writes at a
  steady rate; a message is visible when the Delta commit holding it is readable.
With `--s3`, the JVM ingest and its visibility again with the warehouse on an
S3-compatible server (`dejaq s3`), as ratios to the same run on local disk, with the
requests the store served (its own counts by S3 operation).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
from deltalake import DeltaTable
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from pyspark.sql import functions as F

from dejaq.conf.settings import Settings
from dejaq.conf.storage import export, spark_conf
from dejaq.conf.tables import Table, table_path
from dejaq.jobs import children, embedded_kafka, embedded_s3, ports
from dejaq.pipelines.ingest import DEFAULT_MAX_OFFSETS_PER_TRIGGER, IngestJob
from dejaq.pipelines.session import (
    JVM,
    PY_DELTA_FORMAT,
    PYTHON_CONNECTORS,
    Connectors,
    detect_connectors,
    get_spark,
)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # appended: nothing on the path is shadowed
    sys.path.append(str(ROOT))

from bench.machine import machine  # noqa: E402

WARMUP_MESSAGES = 20_000
PHASES = ("read_parse_write", "dedup", "commit_quarantine", "commit_buffer")  # of a batch


def produce(bootstrap: str, topic: str, n: int, payload: int, seed: int = 1) -> float:
    """Send n messages; return msgs/s. Random priorities, keys spread over 1000 customers."""
    rng = random.Random(seed)
    body = b"x" * payload
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, acks=1, linger_ms=20, batch_size=256 * 1024
    )
    started = time.perf_counter()
    for i in range(n):
        prio = str(rng.randrange(65536)).encode()
        producer.send(
            topic, key=b"c%d" % (i % 1000), value=body, headers=[("dejaq-priority", prio)]
        )
    producer.flush()
    producer.close()
    return n / (time.perf_counter() - started)


def baseline_consumer(bootstrap: str, topic: str) -> dict:
    """Run in its own process: read every record of the topic once, as fast as it goes."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    ends = consumer.end_offsets(tps)
    started = time.perf_counter()
    count = 0
    while any(consumer.position(tp) < ends[tp] for tp in tps):
        for records in consumer.poll(timeout_ms=1000).values():
            count += len(records)
    seconds = time.perf_counter() - started
    consumer.close()
    return {"records": count, "seconds": round(seconds, 3), "msgs_per_s": round(count / seconds)}


def run_baseline(bootstrap: str, topic: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--baseline-consumer", bootstrap, topic],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def kafka_stream(spark, bootstrap: str, topic: str):
    """The topic from the start, as the ingest reads it (JVM connector, headers)."""
    return (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .option("maxOffsetsPerTrigger", str(DEFAULT_MAX_OFFSETS_PER_TRIGGER))
        .load()
    )


def plain_copy(spark, bootstrap: str, topic: str, warehouse: Path) -> dict:
    """Spark's own Kafka → Delta copy of the topic, no parsing: the floor for ingest."""
    path = str(warehouse / "plain_copy")
    started = time.perf_counter()
    query = (
        kafka_stream(spark, bootstrap, topic)
        .writeStream.format("delta")
        .option("checkpointLocation", str(warehouse / "_checkpoints" / "plain_copy"))
        .trigger(availableNow=True)
        .start(path)
    )
    query.awaitTermination()
    seconds = time.perf_counter() - started
    rows = DeltaTable(path).to_pyarrow_dataset().count_rows()
    return {"rows": rows, "seconds": round(seconds, 2), "msgs_per_s": round(rows / seconds)}


def shaped_copy(spark, bootstrap: str, topic: str, warehouse: Path, buckets: int = 16) -> dict:
    """The copy again, written as the ingest writes the buffer: each micro-batch's raw
    records with a bucket column, in no more tasks than cores, appended partitioned by
    bucket through `dejaq_delta` with its (app id, batch id)."""
    path = str(warehouse / "shaped_copy")

    def append(batch, batch_id: int) -> None:
        bucket = F.pmod(F.xxhash64("key"), F.lit(buckets)).cast("int")
        (
            batch.coalesce(spark.sparkContext.defaultParallelism)
            .withColumn("bucket", bucket)
            .write.format(PY_DELTA_FORMAT)
            .mode("append")
            .option("partitionBy", "bucket")
            .option("txnAppId", "shaped-copy")
            .option("txnVersion", str(batch_id))
            .save(path)
        )

    started = time.perf_counter()
    query = (
        kafka_stream(spark, bootstrap, topic)
        .writeStream.foreachBatch(append)
        .option("checkpointLocation", str(warehouse / "_checkpoints" / "shaped_copy"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - started
    rows = DeltaTable(path).to_pyarrow_dataset().count_rows()
    return {"rows": rows, "seconds": round(seconds, 2), "msgs_per_s": round(rows / seconds)}


def ingest(spark, settings: Settings, topic: str, connectors: Connectors, per_trigger: int) -> dict:
    """`IngestJob` with availableNow (what `dejaq ingest --once` runs), timed end to end."""
    job = IngestJob(spark, settings, settings.topic(topic), connectors, per_trigger)
    started = time.perf_counter()
    query = job.start(once=True)
    query.awaitTermination()
    seconds = time.perf_counter() - started
    if query.exception():
        raise SystemExit(f"ingest failed: {query.exception()}")
    rows = sum(s.buffered for s in job.stats)
    phases: dict[str, int] = {}
    for s in job.stats:
        for k, v in s.phases_ms.items():
            phases[k] = phases.get(k, 0) + v
    spark_phases: dict[str, int] = {}
    for p in query.recentProgress:
        if p.numInputRows:
            for k, v in p.durationMs.items():
                spark_phases[k] = spark_phases.get(k, 0) + v
    return {
        "connectors": connectors.describe().replace("\n", "; "),
        "rows_buffered": rows,
        "seconds": round(seconds, 2),
        "msgs_per_s": round(rows / seconds),
        "batches": len(job.stats),
        "batch_phases_ms_total": phases,
        "spark_duration_ms_total": spark_phases,
    }


def settings_for(
    warehouse: Path | str, bootstrap: str, topics: dict[str, str], storage: dict | None = None
) -> Settings:
    return Settings.model_validate(
        {
            "warehouse": str(warehouse),
            "storage": storage or {},
            "kafka": {"bootstrap": bootstrap},
            "topics": [
                {"name": name, "kind": "priority", "source": [src]} for name, src in topics.items()
            ],
        }
    )


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, partitions, 1)])
    admin.close()


class CommitWatcher(threading.Thread):
    """Records when each message id first becomes readable in a Delta table."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.seen_files: set[str] = set()
        self.visible_at: dict[str, float] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            if DeltaTable.is_deltatable(self.path):
                now = time.time()
                for uri in DeltaTable(self.path).file_uris():
                    if uri not in self.seen_files:
                        self.seen_files.add(uri)
                        for mid in pq.read_table(uri, columns=["message_id"]).column(0).to_pylist():
                            self.visible_at.setdefault(mid, now)
            self.stopping.wait(0.02)


def visibility_latency(
    spark, settings: Settings, topic: str, connectors: Connectors, n: int, rate: int
) -> dict:
    """Continuous ingest; produce n messages at `rate`/s; latency = visible - sent."""

    conf = settings.topic(topic)
    job = IngestJob(spark, settings, conf, connectors)
    watcher = CommitWatcher(table_path(settings.warehouse, Table.BUFFER, topic))
    watcher.start()
    query = job.start(once=False)
    producer = KafkaProducer(bootstrap_servers=settings.kafka.bootstrap, acks=1, linger_ms=0)
    sent_at: dict[str, float] = {}
    started = time.time()
    for i in range(n):
        due = started + i / rate
        if (wait := due - time.time()) > 0:
            time.sleep(wait)
        mid = f"lat-{i}"
        sent_at[mid] = time.time()
        producer.send(
            conf.source[0],
            value=b"x" * 100,
            headers=[("dejaq-priority", b"1"), ("dejaq-id", mid.encode())],
        )
    producer.flush()
    deadline = time.time() + 120
    while len(watcher.visible_at) < n and time.time() < deadline:
        time.sleep(0.1)
    query.stop()
    watcher.stopping.set()
    watcher.join()
    lat = sorted(watcher.visible_at[m] - sent_at[m] for m in sent_at if m in watcher.visible_at)
    batches = [s for s in job.stats if s.buffered]
    phases = {k: round(statistics.median(s.phases_ms.get(k, 0) for s in batches)) for k in PHASES}
    return {
        "visible": len(lat),
        "p50_ms": round(statistics.median(lat) * 1000),
        "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1000),
        "trigger": "processingTime 1 second",
        "batches": len(batches),
        "batch_ms_p50": round(statistics.median(s.millis for s in batches)),
        "batch_phases_ms_p50": phases,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--payload-bytes", type=int, default=100)
    p.add_argument(
        "--max-offsets-per-trigger",
        type=int,
        default=DEFAULT_MAX_OFFSETS_PER_TRIGGER,
        help="default: the job's own, as `dejaq ingest --once` runs",
    )
    p.add_argument("--latency-messages", type=int, default=3000)
    p.add_argument("--latency-rate", type=int, default=300)
    p.add_argument("--s3", action="store_true", help="also ingest into a warehouse on `dejaq s3`")
    p.add_argument(
        "--baseline-consumer", nargs=2, metavar=("BOOTSTRAP", "TOPIC"), help=argparse.SUPPRESS
    )
    args = p.parse_args()
    if args.baseline_consumer:
        print(json.dumps(baseline_consumer(*args.baseline_consumer)))
        return

    work = Path(tempfile.mkdtemp(prefix="dejaq-bench-ingest-"))
    port = ports.free_port()
    kafka = embedded_kafka.start(port, work / "kafka")
    store = s3_settings = None
    try:
        if args.s3:
            store, s3_env = embedded_s3.start(ports.free_port(), work / "s3")
            os.environ.update({k: v for k, v in s3_env.items() if k.startswith("AWS_")})
            s3_settings = settings_for(
                s3_env["DEJAQ_WAREHOUSE"],
                f"127.0.0.1:{port}",
                {"jvm": "bench-in", "latency": "latency-s3-in"},
                {"endpoint": s3_env["DEJAQ_STORAGE_ENDPOINT"], "path_style": True},
            )
            export(s3_settings)
        bootstrap = f"127.0.0.1:{port}"
        for name in ("bench-in", "latency-in", "latency-s3-in", "warmup-in"):
            create_topic(bootstrap, name, args.partitions)
        produce(bootstrap, "warmup-in", WARMUP_MESSAGES, args.payload_bytes)
        produce_rate = produce(bootstrap, "bench-in", args.messages, args.payload_bytes)
        baseline = run_baseline(bootstrap, "bench-in")

        t0 = time.perf_counter()
        spark = get_spark(
            "dejaq-bench-ingest",
            connectors=JVM,
            conf=spark_conf(s3_settings) if s3_settings else None,
        )
        jvm_connectors = detect_connectors(spark, JVM)
        spark.range(1).collect()
        startup_s = time.perf_counter() - t0
        # Each reader gets its own table: the JVM and Python ingests, and the warm-ups.
        settings = settings_for(
            work / "warehouse",
            bootstrap,
            {
                "jvm": "bench-in",
                "python": "bench-in",
                "latency": "latency-in",
                "warmup-jvm": "warmup-in",
                "warmup-python": "warmup-in",
            },
        )
        # Python workers, imports and the JIT warm up on a small topic first, so each
        # figure is the steady rate.
        t0 = time.perf_counter()
        ingest(spark, settings, "warmup-jvm", jvm_connectors, args.max_offsets_per_trigger)
        ingest(spark, settings, "warmup-python", PYTHON_CONNECTORS, args.max_offsets_per_trigger)
        warmup_s = time.perf_counter() - t0
        floor = plain_copy(spark, bootstrap, "bench-in", work / "warehouse")
        shaped = shaped_copy(spark, bootstrap, "bench-in", work / "warehouse")
        jvm_ingest = ingest(spark, settings, "jvm", jvm_connectors, args.max_offsets_per_trigger)
        py_ingest = ingest(
            spark, settings, "python", PYTHON_CONNECTORS, args.max_offsets_per_trigger
        )
        latency = visibility_latency(
            spark, settings, "latency", jvm_connectors, args.latency_messages, args.latency_rate
        )
        on_s3 = None
        if s3_settings is not None:
            before = embedded_s3.requests(work / "s3")
            s3_ingest = ingest(
                spark, s3_settings, "jvm", jvm_connectors, args.max_offsets_per_trigger
            )
            ingest_requests = per_second(before, embedded_s3.requests(work / "s3"), s3_ingest)
            s3_latency = visibility_latency(
                spark,
                s3_settings,
                "latency",
                jvm_connectors,
                args.latency_messages,
                args.latency_rate,
            )
            on_s3 = {
                "ingest": s3_ingest,
                "ingest_vs_local": round(s3_ingest["msgs_per_s"] / jvm_ingest["msgs_per_s"], 3),
                "ingest_requests": ingest_requests,
                "visibility_latency": s3_latency,
                "visibility_p50_vs_local": round(s3_latency["p50_ms"] / latency["p50_ms"], 3),
                "visibility_p99_vs_local": round(s3_latency["p99_ms"] / latency["p99_ms"], 3),
                "store": "S3Proxy 4.1.0 (filesystem) on 127.0.0.1",
            }
        base_rate = baseline["msgs_per_s"]
        print(
            json.dumps(
                {
                    "benchmark": "ingest",
                    "date": dt.date.today().isoformat(),
                    "parameters": {
                        "messages": args.messages,
                        "partitions": args.partitions,
                        "payload_bytes": args.payload_bytes,
                        "max_offsets_per_trigger": args.max_offsets_per_trigger,
                        "latency_messages": args.latency_messages,
                        "latency_offered_rate": args.latency_rate,
                        "kafka": "Apache Kafka (one KRaft node) on 127.0.0.1",
                        "master": spark.sparkContext.master,
                    },
                    "ingest": jvm_ingest,
                    "ingest_python_connectors": py_ingest,
                    "baseline_kafka_python_consumer": baseline,
                    "spark_plain_copy": floor,
                    "ingest_vs_baseline": round(jvm_ingest["msgs_per_s"] / base_rate, 3),
                    "ingest_vs_plain_copy": round(
                        jvm_ingest["msgs_per_s"] / floor["msgs_per_s"], 3
                    ),
                    "spark_shaped_copy": shaped,
                    "ingest_vs_shaped_copy": round(
                        jvm_ingest["msgs_per_s"] / shaped["msgs_per_s"], 3
                    ),
                    "s3_warehouse": on_s3,
                    "python_ingest_vs_baseline": round(py_ingest["msgs_per_s"] / base_rate, 3),
                    "visibility_latency": latency,
                    "produce_msgs_per_s": round(produce_rate),
                    "spark_startup_s": round(startup_s, 2),
                    "warmup_s": round(warmup_s, 2),
                    "machine": machine(spark=spark.version),
                },
                indent=2,
            )
        )
        spark.stop()
    finally:
        children.stop(kafka)
        if store is not None:
            children.stop(store)


def per_second(before: dict[str, int], after: dict[str, int], timed: dict) -> dict:
    """The store's requests between two counts, in all and per second of `timed`."""
    made = embedded_s3.requests_between(before, after)
    return {"requests": made, "per_s": round(sum(made.values()) / timed["seconds"], 2)}


if __name__ == "__main__":
    main()
