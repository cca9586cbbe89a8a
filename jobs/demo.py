"""`dejaq demo`: the buffer at work on embedded parts, from nothing to a summary.

Starts the embedded Kafka, produces out-of-order messages (and a few bad ones) to a
priority topic, ingests them into the Delta buffer, and reads the buffer back in
sort-key order. Exits non-zero if a check fails. Broker and release come later.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from conf.settings import load_settings
from conf.tables import Table, table_path

DEMO_MESSAGES = 2000
DEMO_BAD = 20


def _produce(bootstrap: str, topic: str, n: int, bad: int) -> list[int]:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 4, 1)])
    admin.close()
    rng = random.Random(7)
    priorities = [rng.randrange(0, 1000) for _ in range(n)]
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=10)
    for i, prio in enumerate(priorities):
        headers = [("dejaq-priority", str(prio).encode()), ("dejaq-id", f"msg-{i}".encode())]
        producer.send(
            topic, key=f"customer-{i % 50}".encode(), value=f"job {i}".encode(), headers=headers
        )
    for _ in range(bad):
        producer.send(topic, key=b"bad", value=b"?", headers=[("dejaq-priority", b"urgent!")])
    producer.flush()
    producer.close()
    return priorities


def run(conf_file: str | None) -> int:
    from deltalake import DeltaTable

    from jobs import embedded_kafka
    from jobs.ingest import run as ingest

    work = Path(tempfile.mkdtemp(prefix="dejaq-demo-"))
    port = embedded_kafka.free_port()
    print(f"demo: starting embedded Kafka on 127.0.0.1:{port} (data in {work})", flush=True)
    kafka = embedded_kafka.start(port, work / "kafka")
    try:
        bootstrap = f"127.0.0.1:{port}"
        conf = work / "dejaq.yaml"
        conf.write_text(
            f"warehouse: {work / 'warehouse'}\nkafka: {{bootstrap: '{bootstrap}'}}\n"
            "topics:\n  - {name: orders, kind: priority, source: [orders-in]}\n"
        )
        settings = load_settings(conf)
        started = time.monotonic()
        priorities = _produce(bootstrap, "orders-in", DEMO_MESSAGES, DEMO_BAD)
        print(
            f"demo: produced {DEMO_MESSAGES} messages with random priorities + {DEMO_BAD} bad ones"
        )
        print(f"demo: first ten priorities as produced: {priorities[:10]}", flush=True)
        code = ingest("orders", str(conf), once=True, max_offsets_per_trigger=500)
        if code:
            return code
        buffer = DeltaTable(
            table_path(settings.warehouse, Table.BUFFER, "orders")
        ).to_pyarrow_table(columns=["sort_key", "source_partition", "source_offset"])
        quarantined = DeltaTable(
            table_path(settings.warehouse, Table.QUARANTINE, "orders")
        ).to_pyarrow_table(columns=["reason"])
        ordered = buffer.sort_by(
            [
                ("sort_key", "ascending"),
                ("source_partition", "ascending"),
                ("source_offset", "ascending"),
            ]
        )
        keys = ordered.column("sort_key").to_pylist()
        checks = {
            "every good message buffered": buffer.num_rows == DEMO_MESSAGES,
            "every bad message quarantined": quarantined.num_rows == DEMO_BAD,
            "nothing lost: in = buffer + quarantine": buffer.num_rows + quarantined.num_rows
            == DEMO_MESSAGES + DEMO_BAD,
            "buffer reads back lowest priority first": keys == sorted(priorities),
        }
        print(f"demo: first ten priorities as the buffer gives them: {keys[:10]}")
        print(f"demo summary ({time.monotonic() - started:.1f}s):")
        for what, ok in checks.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        return 0 if all(checks.values()) else 1
    finally:
        embedded_kafka.stop(kafka)
        print("demo: embedded Kafka stopped", flush=True)
