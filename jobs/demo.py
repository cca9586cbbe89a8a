"""`dejaq demo`: the whole reorder buffer at work on embedded parts, with a summary.

Starts the embedded Kafka and a 3-node broker cluster; ingests a priority topic and a
timeline topic in one SparkSession; HTTP workers lease and ack the priority topic while
the release job emits the timeline topic to an output topic. A live display shows the
counts; the summary checks the claims (out of order in, in order out, 0 early, 0 lost,
none delivered twice) and the exit code is non-zero if any fails. Every process it
started is stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deltalake import DeltaTable
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from rich.console import Console
from rich.live import Live
from rich.table import Table as RichTable

from dejaq.client import BrokerError, Client
from dejaq.conf.jvm import JARS_DIR_ENV
from dejaq.conf.settings import ENV_PREFIX, load_settings
from dejaq.conf.tables import BUFFER_SCHEMA, Table, table_path
from dejaq.jobs import children, cluster, embedded_kafka, ports
from dejaq.jobs.logs import stderr_to
from dejaq.jobs.status import row_count
from dejaq.pipelines.delta_follower import DeltaFollower

if TYPE_CHECKING:
    from dejaq.pipelines.release import ReleaseStats

PRIORITY_MESSAGES = 3000
TIMELINE_MESSAGES = 1000
TIMELINE_WINDOW_S = 20
REMINDERS_FROM_S = 10  # produced once Spark is warm; time to ingest them first
BAD_MESSAGES = 10
WORKERS = 2
PARTITIONS = 4
TIMEOUT_S = 240
INGEST_SETTLE_S = 60
LOG_TAIL_LINES = 40  # shown when the demo fails: the cause is usually in the last lines


@dataclass
class Counters:
    """What the display shows and the summary checks; written by the demo's threads."""

    produced: int = 0
    leased: int = 0
    acked: int = 0
    released: int = 0
    early: int = 0
    lateness_ms: list[int] = field(default_factory=list)
    leases: dict[str, list[list[int]]] = field(default_factory=dict)
    output: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # (due, id)
    # How many times each id was leased, acked, released: once each is the claim.
    leased_ids: Counter[str] = field(default_factory=Counter)
    acked_ids: Counter[str] = field(default_factory=Counter)
    released_ids: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)


def _conf(work: Path, bootstrap: str, s3: dict[str, str] | None) -> Path:
    """The demo's configuration: a local warehouse, or the S3 server's bucket."""
    conf = work / "dejaq.yaml"
    if s3 is None:
        where = f"warehouse: {work / 'warehouse'}\n"
    else:
        where = (
            f"warehouse: {s3['DEJAQ_WAREHOUSE']}\n"
            f"storage: {{endpoint: '{s3['DEJAQ_STORAGE_ENDPOINT']}', path_style: true}}\n"
        )
    conf.write_text(
        where + f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        "topics:\n"
        "  - {name: orders, kind: priority, source: [orders-in], buckets: 8, delivery: lease}\n"
        "  - {name: reminders, kind: timeline, source: [reminders-in], buckets: 8,"
        " delivery: release, output: reminders-out}\n"
    )
    return conf


def _create_topics(bootstrap: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics(
        [NewTopic(t, PARTITIONS, 1) for t in ("orders-in", "reminders-in", "reminders-out")]
    )
    admin.close()


Record = tuple[bytes, bytes, list[tuple[str, bytes]]]


def _produce(bootstrap: str, topic: str, records: list[Record], c: Counters) -> None:
    """Send the records, then a few bad ones that must end up in quarantine."""
    bad: Record = (b"bad", b"?", [("dejaq-priority", b"asap!")])
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=10)
    for key, value, headers in [*records, *[bad] * (BAD_MESSAGES // 2)]:
        producer.send(topic, key=key, value=value, headers=headers)
        c.produced += 1
    producer.flush()
    producer.close()


def _ids(name: str, count: int) -> list[str]:
    """The ids of `count` records named `name`, as `_records` gives them."""
    return [f"{name}-{i}" for i in range(count)]


def _records(
    header: str, values: list[int], name: str, payload: bytes, key: str, keys: int
) -> list[Record]:
    """One record per value, in that header; ids `_ids(name, ...)`, keys spread over
    `keys`."""
    ids = _ids(name, len(values))
    return [
        (
            f"{key}-{i % keys}".encode(),
            payload,
            [(header, str(v).encode()), ("dejaq-id", mid.encode())],
        )
        for i, (v, mid) in enumerate(zip(values, ids, strict=True))
    ]


def _produce_orders(bootstrap: str, c: Counters) -> list[int]:
    """Orders with priorities in random order."""
    rng = random.Random(7)
    priorities = [rng.randrange(0, 1000) for _ in range(PRIORITY_MESSAGES)]
    records = _records("dejaq-priority", priorities, "order", b"job", "customer", keys=50)
    _produce(bootstrap, "orders-in", records, c)
    return priorities


def _produce_reminders(bootstrap: str, c: Counters) -> None:
    """Reminders due over the next window, shuffled."""
    rng = random.Random(11)
    start_ms = int(time.time() * 1000) + REMINDERS_FROM_S * 1000
    due = [start_ms + rng.randrange(TIMELINE_WINDOW_S * 1000) for _ in range(TIMELINE_MESSAGES)]
    records = _records("dejaq-deliver-at", due, "reminder", b"ping", "user", keys=40)
    _produce(bootstrap, "reminders-in", records, c)


def _worker(name: str, urls: list[str], c: Counters, stop: threading.Event) -> None:
    """Lease 50 at a time with the worker client (any node, failing over), ack them;
    remember the order they came in."""
    with Client(urls, deadline=10) as client:
        while not stop.is_set():
            try:
                batch = client.lease("orders", name, 50, wait_ms=500)
            except BrokerError:
                continue  # no node served it within the deadline: the next lease tries again
            if not batch:
                continue
            ids = [m.id for m in batch]
            c.leased += len(batch)
            c.leased_ids.update(ids)
            c.leases.setdefault(name, []).append([m.sort_key for m in batch])
            try:
                client.ack("orders", name, ids)
            except BrokerError as e:
                c.errors.append(f"ack: {str(e)[:200]}")
            else:
                c.acked += len(ids)
                c.acked_ids.update(ids)


def _output_reader(bootstrap: str, c: Counters, stop: threading.Event) -> None:
    """Read reminders-out: lateness = record time - deliver_at; per-partition order."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tps = [TopicPartition("reminders-out", p) for p in range(PARTITIONS)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    while not stop.is_set():
        for tp, records in consumer.poll(timeout_ms=200).items():
            for r in records:
                headers = dict(r.headers)
                due = int(headers["dejaq-deliver-at"])
                c.released += 1
                mid = headers["dejaq-id"].decode()
                c.released_ids[mid] += 1
                c.lateness_ms.append(r.timestamp - due)
                c.early += r.timestamp < due
                c.output.setdefault(tp.partition, []).append((due, mid))
    consumer.close()


def _join(urls: list[str], consumer: str) -> None:
    """Heartbeat once so the consumer holds its buckets before leasing."""
    with Client(urls, deadline=10) as client, contextlib.suppress(BrokerError):
        client.heartbeat("orders", consumer)


def _pending(url: str) -> int:
    """Orders the broker's index holds (0 while it is not ready)."""
    with Client([url], deadline=5) as client:
        try:
            return client.topic_stats("orders").pending
        except BrokerError:
            return 0


def _view(c: Counters, buffered: dict[str, int], elapsed: float) -> RichTable:
    t = RichTable(title=f"DejaQ demo - {elapsed:.0f}s")
    columns = ("records in", "buffered", "leased", "acked", "released", "early", "lateness p50/p99")
    for col in columns:
        t.add_column(col, justify="right")
    lat = sorted(c.lateness_ms)
    late = f"{lat[len(lat) // 2]} / {lat[int(len(lat) * 0.99) - 1]} ms" if lat else "-"
    t.add_row(
        str(c.produced),
        " + ".join(str(buffered.get(k, 0)) for k in ("orders", "reminders")),
        str(c.leased),
        str(c.acked),
        str(c.released),
        str(c.early),
        late,
    )
    return t


def run(s3: bool = False) -> int:
    """The demo in a fresh work folder; every log but the display's goes to a file there.
    `s3`: the warehouse in a bucket of an S3-compatible server (`dejaq s3`) it starts."""
    console = Console()
    if ignored := _own_environment():
        console.print(
            f"demo: ignoring {', '.join(ignored)} from the environment:"
            " the demo runs on its own embedded parts"
        )
    work = Path(tempfile.mkdtemp(prefix="dejaq-demo-"))
    log_file = work / "demo.log"
    console.print(f"[bold]demo[/]: work dir {work}")
    console.print(f"demo: Spark's, Kafka's and the brokers' logs go to {log_file}")
    try:
        with stderr_to(log_file):
            return _run(console, work, s3)
    except Exception:
        lines = log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print(f"demo: the last lines of {log_file}:", *lines, sep="\n", file=sys.stderr)
        raise


KEPT = frozenset({JARS_DIR_ENV})  # where the jars are: no table or topic of anyone's


def _own_environment() -> list[str]:
    """Drop the DejaQ settings' variables from this process's environment, which its
    settings and its children's read: an operator's `DEJAQ_WAREHOUSE` or
    `DEJAQ_KAFKA_BOOTSTRAP` would otherwise point the demo's jobs and workers at real
    tables and topics, to lease and ack real messages. Returns their names."""
    ignored = sorted(v for v in os.environ if v.startswith(ENV_PREFIX) and v not in KEPT)
    for name in ignored:
        del os.environ[name]
    return ignored


def _run(console: Console, work: Path, s3: bool) -> int:
    from dejaq.conf.storage import export, spark_conf
    from dejaq.jobs import embedded_s3
    from dejaq.jobs.logs import setup
    from dejaq.pipelines.ingest import IngestJob
    from dejaq.pipelines.release import ReleaseJob
    from dejaq.pipelines.session import detect_connectors, get_spark

    c = Counters()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    queries = []
    nodes: list[cluster.Node] = []
    port = ports.free_port()
    console.print(f"demo: embedded Apache Kafka on 127.0.0.1:{port}")
    kafka = embedded_kafka.start(port, work / "kafka")
    store = None
    started = time.monotonic()
    try:
        bootstrap = f"127.0.0.1:{port}"
        s3_settings = None
        if s3:
            store, s3_settings = embedded_s3.start(ports.free_port(), work / "s3")
            # The key as the AWS variables, for this process's engines and the nodes'.
            os.environ.update({k: v for k, v in s3_settings.items() if k.startswith("AWS_")})
            console.print(
                f"demo: S3-compatible server (S3Proxy) at {s3_settings['DEJAQ_STORAGE_ENDPOINT']},"
                f" warehouse {s3_settings['DEJAQ_WAREHOUSE']}"
            )
        conf = _conf(work, bootstrap, s3_settings)
        settings = load_settings(conf)
        export(settings)
        _create_topics(bootstrap)
        nodes = cluster.up(3, work / "cluster", str(conf))
        console.print(f"demo: 3-node broker at {', '.join(n.url for n in nodes)}")
        setup()
        mode = settings.spark.connectors
        spark = get_spark(
            "dejaq-demo", settings.spark.master, connectors=mode, conf=spark_conf(settings)
        )
        connectors = detect_connectors(spark, mode)
        for name in ("orders", "reminders"):
            queries.append(
                IngestJob(spark, settings, settings.topic(name), connectors).start(False)
            )
        release = ReleaseJob(spark, settings, settings.topic("reminders"))
        queries.append(release.start())
        priorities = _produce_orders(bootstrap, c)
        console.print(
            f"demo: produced {len(priorities)} orders and {BAD_MESSAGES // 2} malformed records"
            f" (for the quarantine); first priorities {priorities[:8]}"
        )
        buffers = {
            n: table_path(settings.warehouse, Table.BUFFER, n) for n in ("orders", "reminders")
        }
        buffered = {n: 0 for n in buffers}
        urls = [n.url for n in nodes]
        deadline = time.monotonic() + TIMEOUT_S
        threads.append(threading.Thread(target=_output_reader, args=(bootstrap, c, stop)))
        with Live(
            _view(c, buffered, 0), console=console, refresh_per_second=4, redirect_stderr=False
        ) as live:
            threads[-1].start()
            while _pending(urls[0]) < PRIORITY_MESSAGES and time.monotonic() < deadline:
                buffered = {n: row_count(p) or 0 for n, p in buffers.items()}
                live.update(_view(c, buffered, time.monotonic() - started))
                time.sleep(0.25)
            # The reminders' schedule starts once Spark is warm, so lateness is the job's own.
            _produce_reminders(bootstrap, c)
            # Workers join before any leases and start once the broker holds every order,
            # so no bucket changes hands mid-run and each worker's leases show pure order.
            for i in range(WORKERS):
                _join(urls, f"w{i}")
            for i in range(WORKERS):
                threads.append(threading.Thread(target=_worker, args=(f"w{i}", urls, c, stop)))
                threads[-1].start()
            while time.monotonic() < deadline and not (
                len(c.acked_ids) >= PRIORITY_MESSAGES and len(c.released_ids) >= TIMELINE_MESSAGES
            ):
                buffered = {n: row_count(p) or 0 for n, p in buffers.items()}
                live.update(_view(c, buffered, time.monotonic() - started))
                time.sleep(0.25)
            live.update(_view(c, buffered, time.monotonic() - started))
        # The bad records were produced last: let the ingest account for every record.
        quarantines = [table_path(settings.warehouse, Table.QUARANTINE, n) for n in buffers]
        ingest_deadline = time.monotonic() + INGEST_SETTLE_S
        while True:
            buffered = {n: row_count(p) or 0 for n, p in buffers.items()}
            quarantined = sum(row_count(p) or 0 for p in quarantines)
            if sum(buffered.values()) + quarantined >= c.produced or (
                time.monotonic() > ingest_deadline
            ):
                break
            time.sleep(0.25)
        late = _held_late(buffers["reminders"], list(release.releaser.stats), c.output)
        seconds = time.monotonic() - started
        return _summary(console, c, priorities, buffered, quarantined, late, seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=40)
        for q in queries:
            q.stop()
        for node in nodes:
            cluster.stop_node(node)
        children.stop(kafka)
        if store is not None:
            children.stop(store)
        what = "Kafka and the S3 server" if store is not None else "Kafka"
        console.print(f"demo: stopped Spark queries, 3 broker nodes and {what}")


def _held_late(
    buffer: str, stats: list[ReleaseStats], output: dict[int, list[tuple[int, str]]]
) -> set[str]:
    """Reminders the release job first held after they fell due (ingest lag on a starved
    machine): it releases one on arrival, after any due later that it had already sent.
    Any other it held in time, and its timed sender sends what it holds in deliver_at
    order. Held at: the end of the first batch that read the buffer version adding the
    reminder (a batch hands the sender what it read before it ends). A reminder that no
    recorded batch read (the stats keep the last 1,000) counts as late too.
    """
    batches = [s for s in stats if not s.replay]  # in batch order, as the job ran them
    added = _added_in(buffer)
    held_at = {
        v: next((s.started_ms + s.millis for s in batches if s.buffer_version >= v), None)
        for v in set(added.values())
    }
    late = set()
    for due, mid in itertools.chain.from_iterable(output.values()):
        held = held_at.get(added.get(mid, -1))
        if held is None or held > due:
            late.add(mid)
    return late


def _added_in(buffer: str) -> dict[str, int]:
    """The buffer version that added each row (a compaction rewrites rows, not adds)."""
    follower = DeltaFollower(buffer, BUFFER_SCHEMA)
    added: dict[str, int] = {}
    for version in range(DeltaTable(buffer).version() + 1):
        for mid in follower.poll(upto=version)["message_id"].to_pylist():
            added.setdefault(mid, version)
    return added


def _in_order(output: dict[int, list[tuple[int, str]]], late: set[str]) -> bool:
    """Each output partition's reminders in deliver_at order, late arrivals aside."""
    return all(
        a <= b
        for seq in output.values()
        for a, b in itertools.pairwise(due for due, mid in seq if mid not in late)
    )


def _summary(
    console: Console,
    c: Counters,
    priorities: list[int],
    buffered: dict[str, int],
    quarantined: int,
    late: set[str],
    seconds: float,
) -> int:
    inversions = {
        worker: next((f"{a} then {b}" for a, b in itertools.pairwise(seq) if b < a), None)
        for worker, batches in c.leases.items()
        for seq in [list(itertools.chain.from_iterable(batches))]
    }
    in_order = not any(inversions.values())
    lat = sorted(c.lateness_ms)
    orders, reminders = _ids("order", PRIORITY_MESSAGES), _ids("reminder", TIMELINE_MESSAGES)
    checks = {
        "priorities were produced out of order": priorities != sorted(priorities),
        f"every lease came lowest priority first (per worker, {WORKERS} workers)": in_order,
        # At least once: a lease whose answer was lost, or whose ack failed, is leased
        # again (said below); an ack is taken from one lease holder only.
        f"every one of the {PRIORITY_MESSAGES} orders leased, each acked exactly once": (
            c.leased_ids.keys() == set(orders) and _once(c.acked_ids, orders)
        ),
        f"each of the {TIMELINE_MESSAGES} reminders released exactly once": _once(
            c.released_ids, reminders
        ),
        "0 released early": c.early == 0,
        "reminders in deliver_at order per output partition": _in_order(c.output, late),
        f"{BAD_MESSAGES} bad records quarantined, none lost": quarantined == BAD_MESSAGES
        and sum(buffered.values()) + quarantined == c.produced,
    }
    console.print(f"\n[bold]demo summary[/] ({seconds:.0f}s)")
    if lat:
        console.print(
            f"  release lateness: p50 {statistics.median(lat):.0f} ms, "
            f"p99 {lat[int(len(lat) * 0.99) - 1]} ms, max {lat[-1]} ms"
        )
    for what, ok in checks.items():
        console.print(f"  {'[green]ok  [/]' if ok else '[red]FAIL[/]'} {what}")
    if late:
        console.print(
            f"  [yellow]{len(late)} reminders[/] reached the release job after they fell due "
            "(ingest lag on a busy machine): released on arrival, left out of the order check"
        )
    for worker, first in inversions.items():
        if first:
            console.print(f"  [yellow]{worker}[/]: first out-of-order lease: {first}")
    for what, seen in (("leased", c.leased_ids), ("acked", c.acked_ids)):
        _say_not_once(console, "orders", what, seen, orders)
    _say_not_once(console, "reminders", "released", c.released_ids, reminders)
    for e in c.errors[:5]:
        console.print(f"  [yellow]worker error[/]: {e}")
    return 0 if all(checks.values()) else 1


def _once(seen: Counter[str], expected: list[str]) -> bool:
    """Every expected id seen, each exactly once, and no other."""
    return seen.keys() == set(expected) and all(n == 1 for n in seen.values())


def _say_not_once(
    console: Console, name: str, what: str, seen: Counter[str], expected: list[str]
) -> None:
    """Name an id of `name` `what` twice or more, and one expected but never `what`."""
    twice = [f"{mid} ({n} times)" for mid, n in seen.items() if n > 1]
    never = [mid for mid in expected if mid not in seen]
    for ids, how in ((twice, "more than once"), (never, "never")):
        if ids:
            console.print(f"  [yellow]{len(ids)} {name}[/] {what} {how}, first {ids[0]}")
