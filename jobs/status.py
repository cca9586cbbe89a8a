"""`dejaq status --topic NAME [--broker URL]`: how much is buffered, quarantined, and
not yet ingested; retention's last run; with a broker, each node's index and memory.
For a cron topic, its schedules, naming those whose occurrences are late unsent (the
materialiser on the Raft leader sends them ahead of their time). Exit 1 when a check
fails: Kafka not answering, a node unreachable, starting (its indexes loading, shown
with their progress), not ready or naming an alert in its `/readyz`, no node knowing of
a Raft leader, a node's checkpoints failing, or a schedule behind. A source topic Kafka
does not show is named, lag unknown, but is no failure: the ingest waits for a topic
not made yet.

Spark-free: it reads the Delta logs with delta-rs, the ingest checkpoint's offset log,
Kafka's end offsets and the nodes' `/v1/cluster` and `/readyz`, so it answers in a
second while the jobs run.
"""

from __future__ import annotations

import datetime as dt
import ssl
import time
from typing import NamedTuple

import httpx
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from kafka.errors import KafkaError

from dejaq.broker.state import cron
from dejaq.broker.state.schedules import ScheduleStore
from dejaq.client import BrokerError
from dejaq.client.models import Cluster
from dejaq.conf.kafka_clients import python_config
from dejaq.conf.settings import ConfigError, KafkaConfig, TopicKind, load_settings
from dejaq.conf.storage import describe, export
from dejaq.conf.tables import Table, checkpoint_path, table_path
from dejaq.jobs.doctor import kafka_answers
from dejaq.jobs.operations import connect
from dejaq.pipelines.offsets_log import last_committed
from dejaq.pipelines.retention import OPERATION, watermark

# How late a schedule's next occurrence may be, still unsent, before status calls it
# behind: the materialiser sends within a second of an occurrence entering the horizon.
SCHEDULE_LATE_MS = 60_000
# The title of a starting node's 503s, `/readyz`'s too (`broker.api.starting`, which
# status does not import: it would load the node's HTTP app).
NODE_STARTING = "node starting"


def schedules_behind(warehouse: str, topic: str, now_ms: int) -> tuple[int, list[str]] | None:
    """A cron topic's schedule count and those behind (`SCHEDULE_LATE_MS`), each named
    with how far it has been sent; None if the topic has no schedules table yet."""
    if not DeltaTable.is_deltatable(table_path(warehouse, Table.SCHEDULES, topic)):
        return None
    schedules = ScheduleStore(warehouse, topic).all()
    behind = []
    for s in sorted(schedules.values(), key=lambda s: s.schedule_id):
        sent = max(s.materialised_until, s.created_at)
        due = cron.next_after(s.cron, cron.zone(s.time_zone), sent)
        if due is None or due > now_ms - SCHEDULE_LATE_MS or (s.end_at and due > s.end_at):
            continue
        behind.append(f"{s.schedule_id} (due {_iso(due)}, sent up to {_iso(sent)})")
    return len(schedules), behind


def _iso(ms: int) -> str:
    return f"{dt.datetime.fromtimestamp(ms / 1000, dt.UTC):%Y-%m-%d %H:%M:%S} UTC"


def row_count(path: str) -> int | None:
    """Rows in a Delta table from its log's file stats (no data read); None if absent."""
    try:
        dt = DeltaTable(path)
    except TableNotFoundError:
        return None
    actions = dt.get_add_actions(flatten=True)
    column = actions.column("num_records")
    return int(sum(v.as_py() or 0 for v in column))


def kafka_end_offsets(kafka: KafkaConfig, topics: list[str]) -> dict[str, dict[str, int]]:
    """Each topic's end offset per partition; none for a topic Kafka does not show (absent,
    misspelt, or not visible to this user). The high watermark, read uncommitted: the
    records of a transaction still open count as lag, as the ingest waits for its end."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        **python_config(kafka), request_timeout_ms=5000, bootstrap_timeout_ms=3000
    )
    try:
        tps = [
            TopicPartition(t, p)
            for t in topics
            for p in sorted(consumer.partitions_for_topic(t) or [])
        ]
        ends = consumer.end_offsets(tps) if tps else {}
    finally:
        consumer.close()
    out: dict[str, dict[str, int]] = {t: {} for t in topics}
    for tp, end in ends.items():
        out[tp.topic][str(tp.partition)] = end
    return out


def ingest_lag(
    kafka: KafkaConfig, topics: list[str], checkpoint: str
) -> tuple[dict[str, int], list[str]]:
    """Records not yet ingested per `topic/partition`, and the source topics Kafka does not
    show: their lag is unknown, not 0. Raises ValueError where the checkpoint's last
    committed batch is of another layout than the ingest reads (`offsets_log.entry`)."""
    done = last_committed(checkpoint)
    ends = kafka_end_offsets(kafka, topics)
    lag = {
        f"{t}/{p}": end - done.get(t, {}).get(p, 0)
        for t, parts in ends.items()
        for p, end in sorted(parts.items(), key=lambda kv: int(kv[0]))
    }
    return lag, [t for t, parts in ends.items() if not parts]


def last_retention(buffer_path: str, look_back: int = 200) -> str:
    """The buffer's latest retention commit among its last `look_back`, in words."""
    try:
        table = DeltaTable(buffer_path)
    except TableNotFoundError:
        return "no table yet"
    for commit in table.history(look_back):
        if OPERATION in commit:
            at = dt.datetime.fromtimestamp(commit["timestamp"] / 1000, dt.UTC)
            upto = dt.datetime.fromtimestamp(watermark(table) / 1000, dt.UTC)
            return (
                f"{at:%Y-%m-%d %H:%M:%S} UTC, removed {commit[OPERATION]} settled; "
                f"everything settled before {upto:%Y-%m-%d %H:%M:%S} UTC is gone"
            )
    if (upto_ms := watermark(table)) > 0:  # every run commits it: one ran, further back
        upto = dt.datetime.fromtimestamp(upto_ms / 1000, dt.UTC)
        return (
            f"not in the last {look_back} commits; "
            f"everything settled before {upto:%Y-%m-%d %H:%M:%S} UTC is gone"
        )
    return "none yet"


class Readiness(NamedTuple):
    """A node's `/readyz` answer."""

    ready: bool
    status: str  # "ready", then any alert; or why not
    starting: bool  # its indexes load, or Raft starts: it serves nothing else yet


def readiness(url: str, verify: ssl.SSLContext | bool) -> Readiness:
    """A node's `/readyz`: whether it can serve, and its status ("ready", then any alert)
    or why not, and whether it is starting. `/v1/cluster` answers on a node that cannot
    serve, but not on one starting; `/readyz` says so, and needs no key."""
    try:
        answer = httpx.get(f"{url}/readyz", timeout=5, verify=verify)
    except httpx.HTTPError as e:
        return Readiness(False, f"/readyz unanswered ({type(e).__name__})", False)
    try:
        body = answer.json()
    except ValueError:
        body = {}
    said = body.get("status") if answer.status_code == 200 else body.get("detail")
    starting = answer.status_code == 503 and body.get("title") == NODE_STARTING
    return Readiness(
        answer.status_code == 200, str(said or f"/readyz answered {answer.status_code}"), starting
    )


def starting_line(http: str, status: str) -> str:
    """A node that loads its indexes (minutes over a large backlog), with how far."""
    return f"  {http:<22} STARTING: {status}"


def node_lines(view: Cluster, topic: str, ready: bool, status: str) -> tuple[list[str], bool]:
    """A node's lines: role, memory, readiness, and its view of `topic`; whether it is
    ready with no alert and no checkpoints failing."""
    ok = ready and status == "ready"
    line = f"  {view.node_id:<6} {view.role:<9} rss {view.resident_bytes / 2**20:,.0f} MiB"
    t = view.topics.get(topic)
    if t is not None:
        line += (
            f", index {t.indexed}, buffer rows {t.buffer_rows}, "
            f"settled awaiting retention {t.settled_rows}, "
            f"head store {t.head_store_bytes / 2**20:,.1f} MiB"
        )
        if t.last_retention is not None:
            r = t.last_retention
            line += f", last retention removed {r.removed} in {r.seconds:.2f} s"
    lines = [line]
    if not ready:
        lines.append(f"         NOT READY: {status}")
    elif status != "ready":
        lines.append(f"         READY WITH ALERTS: {status.removeprefix('ready; ')}")
    if t is not None and (lag := t.ledger_lag) is not None:
        age = 0 if lag.oldest_ms is None else max(time.time() * 1000 - lag.oldest_ms, 0)
        lines.append(
            f"         ledger behind by {lag.events} events ({age / 1000:.1f} s), "
            f"{lag.unwritten_dead_letters} dead letters unwritten, "
            f"{lag.checkpoint_failures} checkpoint failures"
        )
        if lag.failing:
            lines.append(f"         CHECKPOINTS FAILING {lag.failing}")
            ok = False
    return lines, ok


def print_nodes(
    url: str, topic: str, token: str | None, cacert: str | None, insecure_http: bool = False
) -> bool:
    """Each node's role, resident memory, readiness, index and view of the buffer;
    whether every node answered and is ready with no alert, one knows a Raft leader and
    none has checkpoints failing. The nodes the cluster lists are asked as `url` is, so
    the key goes to none of them in clear unless `insecure_http`; the node at `url` is
    shown too if the cluster does not list it (it never registered: no leader to commit
    its address)."""
    ok = True
    reach = {"token": token, "cacert": cacert, "insecure_http": insecure_http}
    verify = ssl.create_default_context(cafile=cacert) if cacert else True
    with connect(url, timeout=10, **reach) as client:
        asked_url = client.node
        asked_ready = readiness(asked_url, verify)
        if asked_ready.starting:  # it knows no other node yet
            print("nodes")
            host = asked_url.partition("://")[2]
            print(f"{starting_line(host, asked_ready.status)}; ask another node for the others")
            return False
        asked = client.cluster()
    scheme = asked_url.partition("://")[0]
    print("nodes")
    views: list[Cluster] = []
    for http in sorted(asked.nodes.values()):
        node = f"{scheme}://{http}"
        ready = readiness(node, verify)
        if ready.starting:
            print(starting_line(http, ready.status))
            ok = False
            continue
        try:
            with connect(node, timeout=5, **reach) as client:
                view = client.cluster()
        except BrokerError as e:
            print(f"  {http:<22} unreachable ({e})")
            ok = False
            continue
        except ConfigError as e:
            print(f"  {http:<22} not asked: {e}")
            ok = False
            continue
        views.append(view)
        lines, node_ok = node_lines(view, topic, ready.ready, ready.status)
        print(*lines, sep="\n")
        ok = ok and node_ok
    if asked.node_id not in {v.node_id for v in views}:
        views.append(asked)
        lines, node_ok = node_lines(asked, topic, asked_ready.ready, asked_ready.status)
        print(*lines, sep="\n")
        ok = ok and node_ok
    if not any(v.leader for v in views):
        print("  NO RAFT LEADER: no node knows of one, so none serves (Raft ports unreachable")
        print("  between the nodes, different Raft passwords, or too few nodes up)")
        ok = False
    return ok


def run(
    topic: str,
    conf_file: str | None,
    broker: str | None = None,
    token: str | None = None,
    cacert: str | None = None,
    insecure_http: bool = False,
) -> int:
    settings = load_settings(conf_file)
    export(settings)
    conf = settings.topic(topic)
    for table in (Table.BUFFER, Table.QUARANTINE):
        n = row_count(table_path(settings.warehouse, table, topic))
        print(f"{table.value:<11} {'no table yet' if n is None else n}")
    print(f"retention   {last_retention(table_path(settings.warehouse, Table.BUFFER, topic))}")
    print(f"warehouse   {describe(settings)}")
    nodes_ok = schedules_ok = True
    if conf.kind is TopicKind.CRON:
        found = schedules_behind(settings.warehouse, topic, int(time.time() * 1000))
        if found is None:
            print("schedules   none yet")
        else:
            count, behind = found
            print(f"schedules   {count}, {len(behind)} behind")
            for line in behind[:20]:
                print(f"  {line}")
            if len(behind) > 20:
                print(f"  and {len(behind) - 20} more")
            schedules_ok = not behind
    if broker:
        try:
            nodes_ok = print_nodes(broker, topic, token, cacert, insecure_http)
        except BrokerError as e:
            print(f"nodes       unknown: the broker at {broker} does not answer ({e})")
            return 1
    answers, why = kafka_answers(settings.kafka)
    if not answers:
        print(f"ingest lag  unknown: {why}")
        return 1
    try:
        lag, missing = ingest_lag(
            settings.kafka,
            conf.source,
            checkpoint_path(settings.warehouse, "ingest", topic),
        )
    except KafkaError as e:
        print(f"ingest lag  unknown: Kafka at {settings.kafka.bootstrap} does not answer ({e})")
        return 1
    except ValueError as e:  # an offsets log entry of another layout than the ingest reads
        print(f"ingest lag  unknown: {e}")
        return 1
    if missing:
        print(
            f"ingest lag  unknown: Kafka at {settings.kafka.bootstrap} has no source topic "
            f"{', '.join(missing)} (not made yet, misspelt, or not visible to this user)"
        )
    else:
        print(f"ingest lag  {sum(lag.values())}")
    for part, n in lag.items():
        print(f"  {part:<30} {n}")
    return 0 if nodes_ok and schedules_ok else 1
