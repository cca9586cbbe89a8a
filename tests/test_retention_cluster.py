"""Retention on a running 3-node broker: real processes, Raft, HTTP and Delta tables.

New rows are appended to the buffer through the ingest's Python connector's own writer
and commit (which commits again when a retention run's rewrite wins the race), from a
thread of the test, while workers lease and ack and the leader removes settled
messages; the Spark ingest beside retention is tested in test_ingest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from conftest import wait_until
from test_broker import buffer_rows
from test_broker_cluster import Workers, leader_of, restart_then_lease, start, stop
from test_retention import ingest_append

from dejaq.conf.tables import Table, ensure_table, scan
from dejaq.jobs import cluster
from dejaq.jobs.status import row_count

TOTAL = 3000


def write_conf(tmp_path: Path, bootstrap: str, source: str) -> Path:
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        "broker: {heartbeat_timeout_ms: 3000, lease_ms: 5000}\n"
        "topics:\n"
        f"  - {{name: ret, kind: priority, source: [{source}], buckets: 8,"
        " settled_retention_ms: 1000}\n"
    )
    return conf


def acked(client: httpx.Client, nodes: list[cluster.Node]) -> int:
    leader = leader_of(nodes, client)
    return client.get(f"{leader.url}/v1/topics/ret").json()["acked"] if leader else -1


def append_in_steps(buffer: str, started: threading.Event) -> None:
    """TOTAL rows in 30 appends, as the ingest's micro-batches land."""
    step = TOTAL // 30
    for k in range(30):
        keys = [(k * step + i) % 100 for i in range(step)]
        rows = buffer_rows(keys, lambda i: i % 8, prefix=f"r{k}-")
        ingest_append(buffer, rows, "dejaq-ingest-ret", k)
        started.set()


def test_retention_under_load_then_a_late_node_and_a_full_restart(
    tmp_path, kafka_bootstrap, kafka_source
) -> None:
    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source)
    warehouse = str(tmp_path / "warehouse")
    buffer = ensure_table(warehouse, Table.BUFFER, "ret")
    nodes = start(tmp_path, conf)
    try:
        with httpx.Client(timeout=10) as client:
            late = next(n for n in nodes if n is not leader_of(nodes, client))
            cluster.stop_node(late)  # misses everything, starts after retention
            live = [n for n in nodes if n is not late]
            started = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                appended = pool.submit(append_in_steps, buffer, started)
                started.wait(30)
                with Workers(live, n=3, batch=20, topic="ret") as w:
                    # An ack whose answer was lost is acked all the same: ask the cluster.
                    # A failed append fails the test at once, with its own error.
                    wait_until(
                        lambda: (
                            (appended.done() and appended.result() is None)
                            and acked(client, live) == TOTAL
                        ),
                        timeout=120,
                        what="all appended and acked",
                    )
            assert w.redelivered_after_ack == [], "an acked message is never delivered again"
            wait_until(lambda: row_count(buffer) == 0, timeout=60, what="settled rows removed")
            leader = leader_of(live, client)
            assert leader is not None

            def view() -> dict:
                return client.get(f"{leader.url}/v1/cluster").json()["topics"]["ret"]

            wait_until(lambda: view()["buffer_rows"] == 0, what="the leader's index follows")
            assert view()["last_retention"]["removed"] > 0
            metrics = client.get(f"{leader.url}/metrics").text
            assert 'dejaq_retention_removed_rows_total{topic="ret"}' in metrics
            assert "process_resident_memory_bytes" in metrics

            status = ["status", "--topic", "ret", "--conf-file", str(conf), "--broker", leader.url]
            shown = subprocess.run(
                [sys.executable, "-m", "dejaq.jobs.cli", *status],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert shown.returncode == 1, shown.stderr  # a failed check: the late node
            assert f"{late.url.removeprefix('http://')}" in shown.stdout
            assert "unreachable" in shown.stdout
            assert "buffer      0" in shown.stdout
            assert "removed" in shown.stdout.split("retention", 1)[1].split("\n", 1)[0]
            for node in live:
                assert f"  {node.node_id} " in shown.stdout and " MiB" in shown.stdout

            cluster.start_node(late, nodes, str(conf), dict(os.environ))
            cluster.wait_ready(nodes)
            for node in nodes:

                def agrees(node: cluster.Node = node) -> bool:
                    mine = client.get(f"{node.url}/v1/cluster").json()["topics"]["ret"]
                    return (mine["indexed"], mine["buffer_rows"], mine["settled_rows"]) == (0, 0, 0)

                wait_until(agrees, timeout=30, what=f"{node.node_id} agrees")
                stats = client.get(f"{node.url}/v1/topics/ret").json()
                assert (stats["pending"], stats["acked"]) == (0, TOTAL), node.node_id

        # A full restart after retention.
        leased, acked_after = restart_then_lease(nodes, conf, warehouse, "ret")
        assert leased == ["after0", "after1"], "nothing settled is back"
        assert acked_after == TOTAL
    finally:
        stop(nodes)
    ledger = scan(ensure_table(warehouse, Table.LEDGER, "ret"), Table.LEDGER, ["message_id"])
    ids = ledger.column("message_id").to_pylist()
    assert len(ids) == len(set(ids)) == TOTAL, "each message settled once, none lost"
