"""Fault injection ("nemesis") on a 3-node broker cluster, with a checker of what it broke.

    .venv/bin/python bench/nemesis.py [--seconds S] [--messages N] [--fault-every F] [--keep]
    .venv/bin/python bench/nemesis.py --seconds 120 --messages 5000    # the CI size

The default is the long run: 600 s, 50,000 messages. Lease topics need no Kafka: the
nodes get a bootstrap nothing listens on (`--bootstrap` to give one).

Three real broker processes on 127.0.0.1 share a temporary warehouse. N messages reach
the buffer as Delta appends (as the ingest writes them) spread over the load; 6
`Worker`s (each a `Client` over all three nodes) ack most, nack some (a transient
error), reject some (a permanent one: dead-lettered) and drop some unsettled as a
crashed handler would (their leases expire; dropped every time, they die at
`max_deliveries`). Every F seconds a fault, in turn: kill -9 of the leader (restarted
on its data folder), SIGSTOP of a node for 4-6 s (the first time the leader), kill -9 of
a follower (restarted); at the end kill -9 of all three and a full restart. Then the
workers drain what is left and stop.

The checker reads what the clients recorded (every lease with its deadline and
extensions, every ack or rejection answered 2xx) and the cluster itself (peeks, the
ledger, the dead letters, the buffer, each node's stats and /metrics). Safety: `lost`
(never settled), `acked_2xx_not_acked` (an ack answered 2xx whose message did not end
acked), `leased_after_ack`, `leased_after_reject` (a dead-lettered message leased
again), `deliveries_over_max` (a lease beyond `max_deliveries`), `double_leased`
(overlapping leases of a message, each ending at its deadline, or earlier at the send
time of its settle or its consumer's leave). Liveness: the longest time without a lease
answer after each fault, the ledger holding every settled message within 30 s of the load
stopping, dead letters equal to the ledger's dead events, the buffer drained by
retention, the nodes agreeing.

`--secure` runs the same with TLS on every node's HTTP and API keys on: the workers and
the checker then go through HTTPS with a key, and every forward through its node tag.

Prints one JSON object; exit code 1 if a safety count is not 0 or the run failed. A run
that fails a check (`failed_checks`) keeps its folder, with the nodes' logs, as `folder`.
Only PIDs this run started are ever signalled; everything is stopped at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import itertools
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import write_deltalake
from deltalake.exceptions import CommitFailedError

from dejaq.broker.api.keys import ROLES, add_key
from dejaq.client import Backoff, BrokerError, Client, Conflict, Message, Worker
from dejaq.client.models import ExtendResult, Left, SettleResult
from dejaq.conf.tables import BUFFER_SCHEMA, LedgerEvent, Table, ensure_table, scan
from dejaq.jobs import cluster
from dejaq.jobs.certificates import new_authority
from dejaq.jobs.cluster import Node
from dejaq.jobs.status import row_count

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # appended: nothing on the path is shadowed
    sys.path.append(str(ROOT))

from bench.machine import machine  # noqa: E402

TOPIC = "nemesis"
APPEND_ATTEMPTS = 20
SETTLED = frozenset({"acked", "dead", "cancelled"})
LOG_PATTERNS = (
    "Traceback",
    "ArrowNotImplementedError",
    "leader duties",
    "retention of",
    "not committed",
    "cannot be leased",
    "refreshing the index",
    "possible divergence",
    "truncating already-applied",
    "the event loop ran",
)
METRICS = (
    "dejaq_ledger_lag_seconds",
    "dejaq_ledger_unwritten_events",
    "dejaq_checkpoint_failures_total",
    "dejaq_raft_log_entries",
    "dejaq_buffer_rows",
    "dejaq_buffer_settled_rows",
    "dejaq_index_messages",
    "dejaq_retention_removed_rows_total",
    "process_resident_memory_bytes",
)


def now_ms() -> int:
    """Wall-clock ms, floored: the broker stamps its commands with the same clock."""
    return time.time_ns() // 1_000_000


# --- what the clients saw --------------------------------------------------------------------


@dataclass(slots=True)
class Lease:
    """One granted lease; `end_ms` is the earliest it may have ended before its deadline."""

    mid: str
    consumer: str
    deliveries: int
    start_ms: int  # the leader's stamp: its deadline minus lease_ms
    deadline_ms: int  # the latest deadline known, extensions included
    received: float  # when the answer arrived (wall clock, s)
    end_ms: int | None = None


class Journal:
    """Every lease answer, lease, extension, settle and leave the workers' clients made."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leases: list[Lease] = []
        self.current: dict[tuple[str, str], Lease] = {}
        self.answers: list[tuple[float, int, str]] = []  # 2xx leases: received, messages, by
        self.lease_failures = 0
        self.acked: dict[str, int] = {}  # first 2xx ack received, ms (ceiling)
        self.rejected: dict[str, int] = {}
        self.nacked = 0
        self.settle_failures: Counter[str] = Counter()
        self.left: dict[str, int] = {}  # consumer: when its leave was sent, ms
        self.abandoned = 0

    def leased(self, consumer: str, messages: list[Message], lease_ms: int) -> None:
        received = time.time()
        with self.lock:
            self.answers.append((received, len(messages), consumer))
            for m in messages:
                rec = Lease(
                    m.id,
                    consumer,
                    m.deliveries,
                    m.lease_deadline - lease_ms,
                    m.lease_deadline,
                    received,
                )
                self.leases.append(rec)
                self.current[(consumer, m.id)] = rec

    def ended(self, consumer: str, ids: Iterable[str], sent_ms: int) -> None:
        """A settle of `ids` was sent at `sent_ms` and may have applied: their leases may
        have ended then (the earliest, so the checker never calls a fair lease double)."""
        with self.lock:
            for mid in ids:
                rec = self.current.get((consumer, mid))
                if rec is not None and (rec.end_ms is None or sent_ms < rec.end_ms):
                    rec.end_ms = sent_ms

    def settled(self, verb: str, ids: list[str], received_ms: int) -> None:
        with self.lock:
            if verb == "acks":
                for mid in ids:
                    self.acked.setdefault(mid, received_ms)
            elif verb == "rejections":
                for mid in ids:
                    self.rejected.setdefault(mid, received_ms)
            else:
                self.nacked += len(ids)

    def extended(self, consumer: str, ids: Iterable[str], deadline_ms: int) -> None:
        with self.lock:
            for mid in ids:
                rec = self.current.get((consumer, mid))
                if rec is not None and deadline_ms > rec.deadline_ms:
                    rec.deadline_ms = deadline_ms


@dataclass
class Access:
    """How this run reaches the nodes: plain HTTP, or (`--secure`) HTTPS verified against
    the run's own CA with an API key holding every role."""

    token: str | None = None
    ca: str | None = None

    def http(self, **kw: Any) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else None
        return httpx.Client(headers=headers, verify=self.verify(), **kw)

    def verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=self.ca) if self.ca else True

    def client(self, nodes: Sequence[str], **kw: Any) -> dict[str, Any]:
        """The `Client` arguments for `nodes`."""
        return {"nodes": nodes, "token": self.token, "verify": self.verify(), **kw}


ACCESS = Access()  # `--secure` replaces it before anything connects


class RecordingClient(Client):
    """A `Client` that tells the journal what it was granted and what it settled."""

    def __init__(self, nodes: Sequence[str], journal: Journal, **kw: Any) -> None:
        super().__init__(nodes, **kw)
        self.journal = journal
        self.receipts: dict[int, str] = {}  # the id each receipt leased names

    def lease(
        self,
        topic: str,
        consumer_id: str,
        max_messages: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = 0,
    ) -> list[Message]:
        assert lease_ms is not None, "the checker derives each lease's start from lease_ms"
        try:
            messages = super().lease(topic, consumer_id, max_messages, lease_ms, wait_ms)
        except BrokerError:
            with self.journal.lock:
                self.journal.lease_failures += 1
            raise
        self.journal.leased(consumer_id, messages, lease_ms)
        with self.journal.lock:
            self.receipts.update((m.receipt, m.id) for m in messages if m.receipt is not None)
        return messages

    def _ids(
        self, ids: Iterable[str] | None, receipts: Iterable[int] | None
    ) -> tuple[list[str], dict[str, str], dict[str, Any]]:
        """The ids a settling call names (by id or by receipt), each one's key in a 409's
        `refused`, and the call's own naming argument."""
        if receipts is not None:
            receipts = list(receipts)
            mids = [self.receipts[r] for r in receipts]
            return (
                mids,
                {str(r): m for r, m in zip(receipts, mids, strict=True)},
                {"receipts": receipts},
            )
        mids = list(ids or ())
        return mids, {m: m for m in mids}, {"ids": mids}

    def _recorded(
        self,
        verb: str,
        consumer_id: str,
        named: tuple[list[str], dict[str, str], dict[str, Any]],
        call: Callable,
    ) -> Any:
        ids, keys, argument = named
        sent = now_ms()
        try:
            out = call(**argument)
        except Conflict as e:
            refused = {keys[k]: why for k, why in e.refused.items()}
            maybe = [
                m for m in ids if e.maybe_applied or refused.get(m) in (None, "already_settled")
            ]
            self.journal.ended(consumer_id, maybe, sent)
            with self.journal.lock:
                self.journal.settle_failures[f"{verb}:409"] += 1
            raise
        except BrokerError as e:
            self.journal.ended(consumer_id, ids, sent)  # its answer was lost: maybe applied
            with self.journal.lock:
                self.journal.settle_failures[f"{verb}:{type(e).__name__}"] += 1
            raise
        self.journal.ended(consumer_id, ids, sent)
        self.journal.settled(verb, ids, now_ms() + 1)
        return out

    def ack(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> SettleResult:
        return self._recorded(
            "acks",
            consumer_id,
            self._ids(ids, receipts),
            lambda **named: Client.ack(self, topic, consumer_id, **named),
        )

    def reject(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> SettleResult:
        return self._recorded(
            "rejections",
            consumer_id,
            self._ids(ids, receipts),
            lambda **named: Client.reject(self, topic, consumer_id, **named),
        )

    def nack(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        delay_ms: int = 0,
        priority: int | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> SettleResult:
        return self._recorded(
            "nacks",
            consumer_id,
            self._ids(ids, receipts),
            lambda **named: Client.nack(
                self, topic, consumer_id, delay_ms=delay_ms, priority=priority, **named
            ),
        )

    def extend(
        self,
        topic: str,
        consumer_id: str,
        ids: Iterable[str] | None = None,
        lease_ms: int | None = None,
        *,
        receipts: Iterable[int] | None = None,
    ) -> ExtendResult:
        mids, keys, argument = self._ids(ids, receipts)
        sent = now_ms()
        try:
            out = super().extend(topic, consumer_id, lease_ms=lease_ms, **argument)
        except Conflict as e:
            # The kept ones' new deadline is not in a 409: at least the send time's.
            refused = {keys[k] for k in e.refused}
            kept = [m for m in mids if m not in refused]
            self.journal.extended(consumer_id, kept, sent + (lease_ms or 0))
            raise
        self.journal.extended(consumer_id, mids, out.lease_deadline)
        return out

    def leave(self, topic: str, consumer_id: str) -> Left:
        with self.journal.lock:
            self.journal.left[consumer_id] = now_ms()
        return super().leave(topic, consumer_id)


# --- the workload ----------------------------------------------------------------------------


class Transient(Exception):
    """A handler failure worth retrying: the worker nacks."""


class Permanent(Exception):
    """A poison message: the worker rejects it to the dead letters (`reject_on`)."""


def chance(seed: int, *parts: object) -> float:
    """A deterministic draw in [0, 1) per (seed, parts): a message's fate repeats."""
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest) / 2**64


@dataclass(frozen=True)
class Fates:
    """What the handler does with a message: fractions of all messages (the nack rate is
    per delivery)."""

    seed: int
    nack: float
    reject: float
    abandon: float  # dropped on every delivery: dies at max_deliveries by lease expiry
    abandon_first: float  # dropped on its first delivery only, acked later

    def of(self, mid: str) -> str:
        x = chance(self.seed, "fate", mid)
        for name, share in (
            ("reject", self.reject),
            ("abandon", self.abandon),
            ("abandon_first", self.abandon_first),
        ):
            if x < share:
                return name
            x -= share
        return "ok"

    def drops(self, m: Message) -> bool:
        fate = self.of(m.id)
        return fate == "abandon" or (fate == "abandon_first" and m.deliveries == 1)

    def handle(self, m: Message) -> None:
        if self.of(m.id) == "reject":
            raise Permanent(m.id)
        if chance(self.seed, "nack", m.id, m.deliveries) < self.nack:
            raise Transient(m.id)


class NemesisWorker(Worker):
    """A `Worker` whose handler sometimes loses a message, as a crashed handler would: no
    settle and no more extensions, so its lease expires. `Worker` has no hook for that;
    this override of `_handle` (and its `_held`) is the one private seam used."""

    def __init__(self, *args: Any, fates: Fates, journal: Journal, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.fates, self.journal = fates, journal

    def _handle(self, m: Message) -> None:
        if self.fates.drops(m):
            with self._lock:
                self._held.pop(m.id, None)
            with self.journal.lock:
                self.journal.abandoned += 1
            return
        super()._handle(m)


_offsets = iter(range(1 << 62))


def message_ids(seed: int, n: int) -> list[str]:
    """`<random hex>-<n>`: ids in random order, as producers' ids are, so every buffer
    file's id range (its Parquet statistics) spans the others' ids and a reader's id
    filter meets every file, those a retention run rewrote included."""
    return [f"{int(chance(seed, 'id', i) * 2**40):010x}-{i:07d}" for i in range(n)]


def buffer_rows(ids: list[str], buckets: int, rng: random.Random) -> pa.Table:
    """Buffer rows as the ingest writes them (tests/test_broker.py's `buffer_rows`)."""
    now = dt.datetime.now(dt.UTC)
    rows = []
    for mid in ids:
        priority = rng.randrange(100)
        rows.append(
            {
                "message_id": mid,
                "bucket": int(mid.rsplit("-", 1)[1]) % buckets,
                "sort_key": priority,
                "priority": priority,
                "deliver_at": None,
                "event_time": None,
                "key": mid.encode(),
                "payload": f"payload-{mid}".encode(),
                "headers": [],
                "source_topic": f"{TOPIC}-in",
                "source_partition": 0,
                "source_offset": next(_offsets),
                "produced_at": now,
                "ingested_at": now,
            }
        )
    return pa.Table.from_pylist(rows, schema=BUFFER_SCHEMA)


def fill(warehouse: str, ids: list[str], buckets: int, rng: random.Random) -> None:
    """Append to buffer/<topic> as the ingest does (delta-rs, partitioned by bucket)."""
    path = ensure_table(warehouse, Table.BUFFER, TOPIC)
    write_deltalake(path, buffer_rows(ids, buckets, rng), mode="append", partition_by=["bucket"])


# --- the cluster -----------------------------------------------------------------------------


class Cluster:
    """3 broker nodes this run started, each logging to <tmp>/<node id>.log; the only
    processes it ever signals are these (by the PID of the `Popen` it holds)."""

    def __init__(self, tmp: Path, conf: Path) -> None:
        self.tmp, self.conf = tmp, conf
        self.nodes = cluster.plan(3, tmp / "raft")
        for node in self.nodes:
            node.scheme, node.ca = ("https", ACCESS.ca) if ACCESS.ca else ("http", None)
        self.stopped: set[str] = set()  # SIGSTOPped now
        # Only the Raft password from the environment: a DEJAQ_WAREHOUSE of the caller's
        # would override the run's own configuration.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DEJAQ_")}
        self.env["DEJAQ_BROKER_RAFT_PASSWORD"] = secrets.token_hex(16)

    def log(self, node: Node) -> Path:
        return self.tmp / f"{node.node_id}.log"

    def start(self, node: Node, new_cluster: bool | None = None) -> None:
        """Start `node`; `new_cluster` as `cluster.node_command` takes it (None: a
        restart, or a node joining a cluster that has state)."""
        with self.log(node).open("a") as log:
            log.write(f"=== nemesis: {node.node_id} started at {dt.datetime.now(dt.UTC)}\n")
            log.flush()
            node.proc = subprocess.Popen(
                cluster.node_command(node, self.nodes, str(self.conf), new_cluster),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def alive(self, node: Node) -> bool:
        return node.proc is not None and node.proc.poll() is None

    def signal(self, node: Node, sig: signal.Signals) -> None:
        assert node.proc is not None and self.alive(node)
        node.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(node.node_id)
        elif sig == signal.SIGCONT:
            self.stopped.discard(node.node_id)

    def kill(self, node: Node) -> None:
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait()
        self.stopped.discard(node.node_id)

    def info(self, node: Node, http: httpx.Client) -> dict | None:
        if not self.alive(node) or node.node_id in self.stopped:
            return None
        try:
            return http.get(f"{node.url}/v1/cluster", timeout=1).json()
        except (httpx.HTTPError, ValueError):
            return None

    def leader(self, http: httpx.Client, other_than: Node | None = None) -> Node | None:
        """The node that says it leads (the highest term's, if two say so)."""
        found = []
        for node in self.nodes:
            info = self.info(node, http) if node is not other_than else None
            if info and info.get("role") == "leader":
                found.append((info["term"], node))
        return max(found, key=lambda f: f[0])[1] if found else None

    def stop_all(self) -> None:
        for node in self.nodes:
            if self.alive(node) and node.node_id in self.stopped:
                node.proc.send_signal(signal.SIGCONT)
        self.stopped.clear()
        for node in self.nodes:
            cluster.stop_node(node, timeout=15)


def poll(cond: Callable[[], Any], timeout: float, step: float = 0.2) -> tuple[Any, float]:
    """Call `cond` until it returns something truthy or `timeout` passes: (value, s)."""
    started = time.monotonic()
    while True:
        value = cond()
        if value or time.monotonic() - started >= timeout:
            return value, time.monotonic() - started
        time.sleep(step)


# --- faults ----------------------------------------------------------------------------------


@dataclass
class Fault:
    """One injected fault, what it took to recover, and (in `extra`) the lease gaps after."""

    kind: str
    at: float  # wall clock, s
    node: str | None = None
    role: str | None = None
    down_s: float | None = None  # killed: until restarted; stopped: until SIGCONT
    new_leader_s: float | None = None  # a leader other than the victim, after the fault
    ready_s: float | None = None  # the restarted node(s) ready, after the fault
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Nemesis:
    """The fault schedule, run from the main thread while the workers run."""

    def __init__(self, c: Cluster, rng: random.Random, down_s: float) -> None:
        self.c, self.rng, self.down_s = c, rng, down_s
        self.http = ACCESS.http()
        self.stalls = 0

    def _role(self, node: Node) -> str | None:
        info = self.c.info(node, self.http)
        return info.get("role") if info else None

    def _new_leader(self, victim: Node | None, started: float) -> float | None:
        led, _ = poll(lambda: self.c.leader(self.http, other_than=victim), 20, 0.05)
        return round(time.time() - started, 3) if led else None

    def _restart(self, nodes: list[Node], fault: Fault) -> None:
        for node in nodes:
            self.c.start(node)
        fault.down_s = round(time.time() - fault.at, 3)
        cluster.wait_ready(self.c.nodes, timeout=120)
        fault.ready_s = round(time.time() - fault.at, 3)

    def kill_leader(self) -> Fault:
        victim, _ = poll(lambda: self.c.leader(self.http), 10)
        if victim is None:
            return Fault("kill_leader", time.time(), error="no leader found")
        f = Fault("kill_leader", time.time(), victim.node_id, "leader")
        self.c.kill(victim)
        f.new_leader_s = self._new_leader(victim, f.at)
        time.sleep(max(0.0, self.down_s - (time.time() - f.at)))
        self._restart([victim], f)
        return f

    def kill_follower(self) -> Fault:
        leader = self.c.leader(self.http)
        followers = [n for n in self.c.nodes if n is not leader and self.c.alive(n)]
        victim = self.rng.choice(followers)
        f = Fault("kill_follower", time.time(), victim.node_id, self._role(victim))
        self.c.kill(victim)
        time.sleep(self.down_s)
        self._restart([victim], f)
        return f

    def stall(self) -> Fault:
        """SIGSTOP a node for 4-6 s: the leader the first time, then a random one."""
        self.stalls += 1
        leader = self.c.leader(self.http)
        victim = leader if self.stalls == 1 and leader else self.rng.choice(self.c.nodes)
        role = self._role(victim)
        pause = self.rng.uniform(4.0, 6.0)
        f = Fault("sigstop", time.time(), victim.node_id, role)
        self.c.signal(victim, signal.SIGSTOP)
        try:
            if role == "leader":
                f.new_leader_s = self._new_leader(victim, f.at)
            time.sleep(max(0.0, pause - (time.time() - f.at)))
        finally:
            self.c.signal(victim, signal.SIGCONT)
        f.down_s = round(time.time() - f.at, 3)
        return f

    def kill_all(self) -> Fault:
        f = Fault("kill_all", time.time(), "all")
        for node in self.c.nodes:
            self.c.kill(node)
        time.sleep(1.0)
        self._restart(self.c.nodes, f)
        return f


# --- the checker -----------------------------------------------------------------------------


def check_leases(j: Journal, max_deliveries: int) -> dict[str, Any]:
    """leased_after_ack, leased_after_reject, double_leased, and delivery counts, from
    the journal."""
    by_mid: dict[str, list[Lease]] = defaultdict(list)
    for rec in j.leases:
        by_mid[rec.mid].append(rec)
    after_ack, after_reject, double, backwards, over = [], [], [], [], []
    for mid, recs in by_mid.items():
        recs.sort(key=lambda r: (r.start_ms, r.received))
        acked, rejected = j.acked.get(mid), j.rejected.get(mid)
        held_until, holder = -1, None
        for prev, rec in zip([None, *recs], recs, strict=False):
            if acked is not None and rec.start_ms > acked:
                after_ack.append((mid, rec.consumer, rec.start_ms - acked))
            if rejected is not None and rec.start_ms > rejected:
                after_reject.append((mid, rec.consumer, rec.start_ms - rejected))
            if rec.start_ms < held_until:
                double.append((mid, holder, rec.consumer, held_until - rec.start_ms))
            if prev is not None and rec.deliveries <= prev.deliveries:
                backwards.append((mid, prev.deliveries, rec.deliveries))
            if rec.deliveries > max_deliveries:
                over.append((mid, rec.deliveries))
            end = min(
                rec.deadline_ms,
                rec.end_ms if rec.end_ms is not None else rec.deadline_ms,
                j.left.get(rec.consumer, rec.deadline_ms),
            )
            if end > held_until:
                held_until, holder = end, rec.consumer
    return {
        "leased_after_ack": len(after_ack),
        "leased_after_reject": len(after_reject),
        "double_leased": len(double),
        "deliveries_not_increasing": len(backwards),
        "deliveries_over_max": len(over),
        "examples": {
            "leased_after_ack (id, consumer, ms after the ack's answer)": after_ack[:5],
            "leased_after_reject (id, consumer, ms after the rejection's answer)": (
                after_reject[:5]
            ),
            "double_leased (id, holder, taker, overlap ms)": double[:5],
            "deliveries_not_increasing (id, before, after)": backwards[:5],
            "deliveries_over_max (id, deliveries)": over[:5],
        },
        "timelines": {
            mid: timeline(j, by_mid[mid])
            for mid in dict.fromkeys(
                e[0] for e in [*after_ack, *after_reject, *double, *over, *backwards][:20]
            )
        },
    }


def timeline(j: Journal, recs: list[Lease]) -> dict[str, Any]:
    """A message's leases and settles by wall clock, to set beside the nodes' logs."""

    def at(ms: int | None) -> str | None:
        return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat()

    mid = recs[0].mid
    return {
        "leases (consumer, deliveries, granted, deadline, ended by)": [
            (r.consumer, r.deliveries, at(r.start_ms), at(r.deadline_ms), at(r.end_ms))
            for r in recs
        ],
        "acked_2xx": at(j.acked.get(mid)),
        "rejected_2xx": at(j.rejected.get(mid)),
    }


def gaps(j: Journal, faults: list[Fault], load_end: float, every: float) -> None:
    """Per fault, until the next one (at most `every` s): the longest time without a 2xx
    lease answer (any; and with messages), and each consumer's first answer after it."""
    answers = sorted(j.answers)
    marks = [f.at for f in faults] + [load_end]
    for f, until in zip(faults, marks[1:], strict=False):
        until = min(until, f.at + every)
        for key, times in (
            ("max_no_lease_gap_s", [t for t, _, _ in answers]),
            ("max_no_grant_gap_s", [t for t, n, _ in answers if n]),
        ):
            inside = [t for t in times if f.at <= t < until]
            points = [f.at, *inside, until]
            f.extra[key] = round(max(b - a for a, b in itertools.pairwise(points)), 3)
        first: dict[str, float] = {}
        for t, _, consumer in answers:
            if t >= f.at:
                first.setdefault(consumer, round(t - f.at, 3))
        f.extra["first_answer_s"] = dict(sorted(first.items()))
        f.extra["window_s"] = round(until - f.at, 3)


def read(warehouse: str, table: Table, columns: list[str]) -> pa.Table:
    """Columns of a table in the contract's types (string views as plain strings,
    whichever engine wrote each file), each then cast to a string for the report."""
    t = scan(ensure_table(warehouse, table, TOPIC), table, columns)
    return pa.table({c: t.column(c).cast(pa.string()) for c in columns})


def settled_in_ledger(warehouse: str) -> tuple[dict[str, str], int]:
    """Each message's last ledger event (terminal ones), and the duplicate ids: messages
    settled twice (a `rescheduled` row, a pending message's new key, settles nothing)."""
    t = settling(read(warehouse, Table.LEDGER, ["message_id", "event"]))
    ids, events = t.column("message_id").to_pylist(), t.column("event").to_pylist()
    last = dict(zip(ids, events, strict=True))
    return {m: e for m, e in last.items() if e in SETTLED}, len(ids) - len(last)


def settling(t: pa.Table) -> pa.Table:
    """The ledger rows `t` but the `rescheduled` ones."""
    return t.filter(pc.not_equal(t.column("event"), LedgerEvent.RESCHEDULED.value))


def ledger_rows_of(warehouse: str, n: int) -> dict[str, list[tuple]]:
    """The ledger rows (event, deliveries, at) of the first `n` ids it holds twice."""
    t = settling(read(warehouse, Table.LEDGER, ["message_id", "event", "deliveries", "at"]))
    rows: dict[str, list[tuple]] = defaultdict(list)
    for mid, *rest in zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True):
        rows[mid].append(tuple(rest))
    return dict(itertools.islice(((m, r) for m, r in rows.items() if len(r) > 1), n))


def statuses(nodes: list[str], ids: list[str]) -> dict[str, str]:
    """Each message's status by peek (any node: the client moves on if one fails)."""
    out: dict[str, str] = {}
    with Client(**ACCESS.client(nodes, timeout=10, deadline=60)) as client:

        def peek(mid: str) -> tuple[str, str]:
            try:
                return mid, client.peek(TOPIC, mid).status
            except BrokerError as e:
                return mid, f"error: {type(e).__name__}"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            out.update(pool.map(peek, ids))
    return out


def node_views(c: Cluster, http: httpx.Client) -> dict[str, dict[str, Any]]:
    views = {}
    for node in c.nodes:
        try:
            info = http.get(f"{node.url}/v1/cluster", timeout=5).json()
            stats = http.get(f"{node.url}/v1/topics/{TOPIC}", timeout=5).json()
        except (httpx.HTTPError, ValueError) as e:
            views[node.node_id] = {"error": repr(e)}
            continue
        mine = info.get("topics", {}).get(TOPIC, {})
        views[node.node_id] = {
            "leader": info.get("leader"),
            "term": info.get("term"),
            **{k: stats.get(k) for k in ("pending", "delayed", "leased", "acked", "dead")},
            "cancelled": stats.get("cancelled"),
            **{k: mine.get(k) for k in ("indexed", "buffer_rows", "settled_rows")},
        }
    return views


def agree(views: dict[str, dict[str, Any]]) -> bool:
    return (
        all("error" not in v for v in views.values())
        and len({json.dumps(v, sort_keys=True) for v in views.values()}) == 1
    )


def metrics(c: Cluster, http: httpx.Client) -> dict[str, dict[str, float | None]]:
    """The named metrics per node, summed over labels; None where a node lacks one."""
    out = {}
    for node in c.nodes:
        try:
            text = http.get(f"{node.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            out[node.node_id] = {}
            continue
        mine: dict[str, float | None] = {}
        for name in METRICS:
            found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
            mine[name] = sum(float(v) for v in found) if found else None
        out[node.node_id] = mine
    return out


def log_findings(paths: list[Path]) -> dict[str, Any]:
    """Counts of the telling lines in the nodes' and clients' logs, with a first sample."""
    counts: Counter[str] = Counter()
    samples: dict[str, str] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            for pattern in (
                *LOG_PATTERNS,
                "not acked",
                "not nacked",
                "lease failed",
                "retrying on",
            ):
                if pattern in line:
                    counts[pattern] += 1
                    samples.setdefault(pattern, f"{path.name}: {line.strip()[:400]}")
    return {"counts": dict(counts), "first": samples}


# --- the run ---------------------------------------------------------------------------------


def write_conf(tmp: Path, args: argparse.Namespace) -> Path:
    """The run's configuration; with `--secure`, TLS and API keys on, and `ACCESS` set to
    a key of every role and the run's CA."""
    global ACCESS
    conf = tmp / "dejaq.yaml"
    secure = ""
    if args.secure:
        ca = new_authority(tmp / "pki")
        node = ca.issue(tmp / "pki", "node", ["127.0.0.1"])
        keys = tmp / "keys.json"
        ACCESS = Access(add_key(keys, "nemesis", list(ROLES), ["*"]), str(ca.cert))
        secure = f", keys_file: {keys}, tls: {{cert: {node.cert}, key: {node.key}, ca: {ca.cert}}}"
    conf.write_text(
        f"warehouse: {tmp / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{args.bootstrap}'}}\n"
        f"broker: {{heartbeat_timeout_ms: {args.heartbeat_ms}, lease_ms: {args.lease_ms},"
        f" max_deliveries: {args.max_deliveries}{secure}}}\n"
        "topics:\n"
        f"  - {{name: {TOPIC}, kind: priority, source: [{TOPIC}-in], buckets: {args.buckets},"
        f" settled_retention_ms: {args.retention_ms}}}\n"
    )
    return conf


def appender(
    warehouse: str, args: argparse.Namespace, stop: threading.Event, done: dict[str, Any]
) -> None:
    """The messages in appends every `append_every` s over the whole load, so the last
    faults hit a cluster with work in hand. An append that loses a commit race (to a
    retention run) is made again, as the ingest's next attempt would; `done` counts the
    rows appended and the conflicts."""
    rng = random.Random(args.seed)
    chunks = max(1, int(args.seconds / args.append_every))
    ids = message_ids(args.seed, args.messages)
    started = time.monotonic()
    try:
        for k in range(chunks):
            part = ids[k * len(ids) // chunks : (k + 1) * len(ids) // chunks]
            for attempt in itertools.count(1):
                try:
                    fill(warehouse, part, args.buckets, rng)
                    break
                except CommitFailedError as e:
                    done["conflicts"] += 1
                    done.setdefault("first_conflict", str(e).splitlines()[0])
                    if attempt == APPEND_ATTEMPTS:
                        raise
            done["rows"] += len(part)
            if stop.wait(max(0.0, started + (k + 1) * args.append_every - time.monotonic())):
                return
    except Exception as e:
        done["error"] = repr(e)


def sample(
    warehouse: str,
    urls: list[str],
    j: Journal,
    since: float,
    stop: threading.Event,
    out: list[dict],
) -> None:
    """Every 5 s: the ledger's and buffer's rows beside the acks answered, so a ledger
    that stops advancing shows when it stopped; and the topic's stats with each bucket's
    [owner, pending, leased, deliverable], so a lease that stops granting shows why."""
    ledger = ensure_table(warehouse, Table.LEDGER, TOPIC)
    buffer = ensure_table(warehouse, Table.BUFFER, TOPIC)
    with ACCESS.http(timeout=2) as http:
        while not stop.wait(5.0):
            point: dict[str, Any] = {"t_s": round(time.time() - since), "acked_2xx": len(j.acked)}
            with contextlib.suppress(Exception):  # a table mid-commit: the next sample
                point["ledger_rows"] = row_count(ledger)
                point["buffer_rows"] = row_count(buffer)
            if (lag := leader_ledger_lag(http, urls)) is not None:
                point["ledger_lag_s"] = lag
            s = topic_stats(http, urls)
            if s:
                point.update({k: s[k] for k in ("pending", "delayed", "leased", "deliverable_now")})
                point["consumers"] = len(s["consumers"])
                owners = {b["consumer_id"] for b in s["per_bucket"]}
                # A live consumer owning no bucket while there are enough to go round.
                if len(s["consumers"]) <= len(s["per_bucket"]):
                    point["without_buckets"] = sorted(set(s["consumers"]) - owners)
                point["buckets"] = [
                    [b["consumer_id"], b["pending"], b["leased"], b["deliverable_now"]]
                    for b in s["per_bucket"]
                ]
            out.append(point)


def leader_ledger_lag(http: httpx.Client, urls: list[str]) -> float | None:
    """`dejaq_ledger_lag_seconds` on the node that leads (a follower behind in applying
    trims would show events the leader has long checkpointed)."""
    for url in urls:
        try:
            text = http.get(f"{url}/metrics").text
        except httpx.HTTPError:
            continue
        if 'dejaq_raft_role{role="leader"} 1.0' in text:
            found = re.findall(r"^dejaq_ledger_lag_seconds(?:{[^}]*})? (\S+)$", text, re.M)
            return max((float(v) for v in found), default=None)
    return None


def ledger_lag(progress: list[dict], faults: list[Fault], since: float) -> dict[str, Any]:
    """The leader's ledger lag over the run, and per fault the lowest lag sampled in the
    30 s after it (goal: under 10 s). The lowest, not the last: with faults closer than
    30 s, a sample late in one fault's window is early in the next one's, and a stalled
    checkpoint shows as a lag that never comes down in any window."""
    lags = [(p["t_s"], p["ledger_lag_s"]) for p in progress if "ledger_lag_s" in p]
    lowest = []
    for f in faults:
        start = f.at - since
        window = [lag for t, lag in lags if start < t <= start + 30]
        if window:
            lowest.append(min(window))
    return {
        "max_s": max((lag for _, lag in lags), default=None),
        "samples": len(lags),
        "samples_over_10s": sum(1 for _, lag in lags if lag >= 10),
        "lowest_within_30s_of_fault_max_s": max(lowest, default=None),
        "faults_not_under_10s_within_30s": sum(1 for lag in lowest if lag >= 10),
    }


def lag_recovered(progress: list[dict], start_s: float) -> bool:
    """Whether a ledger lag under 10 s was sampled after `start_s` (run seconds)."""
    return any(p["t_s"] > start_s and p.get("ledger_lag_s", 10) < 10 for p in progress)


# The counts a safe run has at 0. Not `deliveries_not_increasing`: a leave's release
# hands a message on without counting a delivery.
SAFETY = (
    "lost",
    "acked_2xx_not_acked",
    "leased_after_ack",
    "leased_after_reject",
    "deliveries_over_max",
    "double_leased",
)


def failed_checks(out: dict[str, Any]) -> list[str]:
    """The checks a run failed: its errors, any safety count not 0, and the liveness ones."""
    f = out["figures"]
    checks = {
        "errors": not out["errors"],
        "safety": all(f.get(k) == 0 for k in SAFETY),
        "ledger_caught_up": f.get("ledger", {}).get("caught_up"),
        "buffer_drained": f.get("buffer", {}).get("drained"),
        "nodes_agree": f.get("nodes_agree"),
        "ledger_lag_under_10s_within_30s_of_each_fault": (
            f.get("ledger_lag", {}).get("faults_not_under_10s_within_30s") == 0
        ),
    }
    return [name for name, ok in checks.items() if not ok]


def start_cluster(tmp: Path, conf: Path, attempts: int = 3) -> Cluster:
    """Three nodes on fresh ports, ready. A node that exits at start (a port another
    process took between `plan` and the bind: a test suite beside the run) gets the
    cluster new ports, up to `attempts` times."""
    for attempt in range(1, attempts + 1):
        c = Cluster(tmp, conf)
        new = cluster.fresh(c.nodes)  # once: a node started first may have made its dir
        for node in c.nodes:
            c.start(node, new)
        try:
            cluster.wait_ready(c.nodes, timeout=120)
            return c
        except RuntimeError:
            c.stop_all()
            shutil.rmtree(tmp / "raft", ignore_errors=True)
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


class Load:
    """The workers, the appender and the progress sampler, started and stopped together."""

    def __init__(
        self, args: argparse.Namespace, urls: list[str], warehouse: str, journal: Journal
    ) -> None:
        self.args, self.journal = args, journal
        self.fates = Fates(
            args.seed, args.nack_rate, args.reject_rate, args.abandon_rate, args.abandon_first_rate
        )
        self.appended: dict[str, Any] = {"rows": 0, "conflicts": 0}
        self.progress: list[dict] = []
        self.stop_appending, self.stop_sampling = threading.Event(), threading.Event()
        self.workers = [
            NemesisWorker(
                RecordingClient(journal=journal, **ACCESS.client(urls[i % 3 :] + urls[: i % 3])),
                TOPIC,
                self.fates.handle,
                fates=self.fates,
                journal=journal,
                consumer_id=f"w{i}",
                batch=args.batch,
                lease_ms=args.lease_ms,
                wait_ms=1000,
                backoff=Backoff(base_ms=500, max_ms=4000),
                reject_on=(Permanent,),
                heartbeat_s=args.heartbeat_ms / 3000,
            )
            for i in range(args.workers)
        ]
        self.threads = [threading.Thread(target=w.run, name=w.consumer_id) for w in self.workers]
        self.appender = threading.Thread(
            target=appender,
            args=(warehouse, args, self.stop_appending, self.appended),
            name="appender",
        )
        self.sampler = threading.Thread(
            target=sample,
            args=(warehouse, urls, journal, time.time(), self.stop_sampling, self.progress),
            name="sampler",
        )

    def start(self) -> float:
        started = time.time()
        for t in (self.sampler, self.appender, *self.threads):
            t.start()
        return started

    def stop(self) -> None:
        """The workers finish the message in hand and leave; idempotent."""
        self.stop_appending.set()
        self.stop_sampling.set()
        for w in self.workers:
            w.stop()
        for t in (self.appender, *self.threads, self.sampler):
            if t.is_alive():
                t.join(60)


def schedule(nemesis: Nemesis, args: argparse.Namespace, since: float) -> list[Fault]:
    """A fault every `fault_every` s, in turn; kill -9 of all three at `seconds`. The
    pauses between faults are the workload's, not a synchronisation."""
    kinds = [nemesis.kill_leader, nemesis.stall, nemesis.kill_follower]
    faults: list[Fault] = []
    for k in itertools.count(1):
        due = since + k * args.fault_every
        last = due + args.fault_every > since + args.seconds
        time.sleep(max(0.0, (since + args.seconds if last else due) - time.time()))
        fault = nemesis.kill_all if last else kinds[(k - 1) % len(kinds)]
        try:
            faults.append(fault())
        except Exception as e:  # a node that does not come back: the faults end here
            faults.append(Fault(fault.__name__, time.time(), error=repr(e)))
            break
        print(f"nemesis: {asdict(faults[-1])}", file=sys.stderr, flush=True)
        if last:
            break
    return faults


def topic_stats(http: httpx.Client, urls: list[str]) -> dict[str, Any] | None:
    """The topic's stats from the first node that serves them (a 503 during an election
    is no answer)."""
    for url in urls:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            answer = http.get(f"{url}/v1/topics/{TOPIC}")
            if answer.is_success:
                return answer.json()
    return None


def check_tables(
    args: argparse.Namespace, warehouse: str, urls: list[str], http: httpx.Client, j: Journal
) -> dict[str, Any]:
    """Right after the load stops: the ledger catching up, every message's fate (lost:
    neither acked nor dead nor cancelled), the dead letters, the buffer emptying."""
    out: dict[str, Any] = {}
    s = topic_stats(http, urls)
    expected = s["acked"] + s["dead"] + s["cancelled"] if s else -1
    caught, took = poll(
        lambda: len(settled_in_ledger(warehouse)[0]) >= expected > 0, args.ledger_s, 1.0
    )
    in_ledger, duplicates = settled_in_ledger(warehouse)
    ids = message_ids(args.seed, args.messages)
    final = {**in_ledger, **statuses(urls, [m for m in ids if m not in in_ledger])}
    lost = [m for m, st in final.items() if st not in SETTLED]
    missing = {m for m, st in final.items() if st in SETTLED} - set(in_ledger)
    dead_ledger = sum(1 for e in in_ledger.values() if e == "dead")
    # A checkpoint writes the ledger first and the dead letters after it (retried with
    # a backoff if they fail), so they may follow the ledger's catching up by seconds.
    _, dead_took = poll(
        lambda: read(warehouse, Table.DEAD_LETTER, ["message_id"]).num_rows >= dead_ledger,
        args.ledger_s,
        1.0,
    )
    dead_rows = read(warehouse, Table.DEAD_LETTER, ["message_id", "reason"])
    out["lost"] = len(lost)
    out["lost_examples"] = [(m, final[m]) for m in lost[:5]]
    out["final_status"] = dict(Counter(final.values()))
    not_acked = [m for m in j.acked if final.get(m) != "acked"]
    out["acked_2xx_not_acked"] = len(not_acked)
    out["acked_2xx_not_acked_examples"] = [(m, final.get(m)) for m in not_acked[:5]]
    out["ledger"] = {
        "caught_up": bool(caught) and not missing,
        "seconds": round(took, 1),
        "settled_by_cluster_totals": expected,
        "settled_in_ledger": len(in_ledger),
        "missing_from_ledger": len(missing),
        "duplicate_ids": duplicates,
        "duplicate_examples": ledger_rows_of(warehouse, 5) if duplicates else {},
        "dead_events": dead_ledger,
    }
    out["dead_letter"] = {
        "rows": dead_rows.num_rows,
        "equals_ledger_dead": dead_rows.num_rows == dead_ledger,
        "seconds_after_ledger": round(dead_took, 1),
        "distinct_ids": len(set(dead_rows.column("message_id").to_pylist())),
        "reasons": dict(Counter(dead_rows.column("reason").to_pylist())),
    }
    buffer = ensure_table(warehouse, Table.BUFFER, TOPIC)
    started = time.monotonic()
    emptied, _ = poll(lambda: row_count(buffer) == 0, args.retention_ms / 1000 + 60, 1.0)
    out["buffer"] = {
        "drained": bool(emptied),
        "rows": row_count(buffer),
        "waited_s": round(time.monotonic() - started, 1),
    }
    return out


def check_cluster(c: Cluster, http: httpx.Client) -> dict[str, Any]:
    """Every node's view of the topic agreeing (polled: a follower applies a moment
    after the leader), and the metrics of interest."""

    def agreed() -> dict | None:
        views = node_views(c, http)
        return views if agree(views) else None

    views, _ = poll(agreed, 30, 1.0)
    return {
        "nodes_agree": views is not None,
        "node_views": views or node_views(c, http),
        "metrics": metrics(c, http),
    }


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The load under faults, then the checks; every node stopped whatever happens."""
    logging.basicConfig(
        filename=tmp / "clients.log",
        level=logging.WARNING,
        format="%(asctime)s %(threadName)s %(name)s %(message)s",
    )
    logging.getLogger("dejaq.client").setLevel(logging.INFO)  # each retry, and on which node
    conf = write_conf(tmp, args)
    warehouse = str(tmp / "warehouse")
    ensure_table(warehouse, Table.BUFFER, TOPIC)
    journal = Journal()
    figures: dict[str, Any] = {}
    faults: list[Fault] = []
    errors: list[str] = []
    c: Cluster | None = None
    nemesis: Nemesis | None = None
    load: Load | None = None
    since = time.time()
    http = ACCESS.http(timeout=10)
    try:
        c = start_cluster(tmp, conf)
        urls = [n.url for n in c.nodes]
        nemesis = Nemesis(c, random.Random(args.seed), args.down_s)
        load = Load(args, urls, warehouse, journal)
        since = load.start()
        faults = schedule(nemesis, args, since)
        errors += [f"{f.kind}: {f.error}" for f in faults if f.error]
        load.appender.join()

        def drained() -> bool:
            """Every message settled, by the replicated totals: a node's pending count
            alone reads 0 before its index has taken the last append."""
            s = topic_stats(http, urls)
            if not s or load.appended["rows"] != args.messages:
                return False
            settled = s["acked"] + s["dead"] + s["cancelled"]
            return settled == args.messages and s["pending"] + s["delayed"] + s["leased"] == 0

        ok, took = poll(drained, args.drain_s, 0.5)
        figures["drain"] = {"drained": bool(ok), "seconds": round(took, 1)}
        if faults:
            # Each fault's lowest ledger lag in the 30 s after it is judged: sampling goes on
            # until the last fault's window holds a lag under 10 s, or ends, so a lag taken
            # while all three nodes restart is not that window's only sample.
            last = max(f.at for f in faults)
            poll(lambda: lag_recovered(load.progress, last - since), last + 30 - time.time(), 1)
        load.stop()
        gaps(journal, faults, time.time(), args.fault_every)
        figures.update(check_tables(args, warehouse, urls, http, journal))
        figures.update(check_cluster(c, http))
        figures.update(check_leases(journal, args.max_deliveries))
    except Exception as e:
        errors.append(repr(e))
    finally:
        if load is not None:
            load.stop()
        http.close()
        if nemesis is not None:
            nemesis.http.close()
        if c is not None:
            c.stop_all()
    if load is not None:
        figures["appends"] = load.appended
        ids = message_ids(args.seed, args.messages)
        figures["fates"] = dict(Counter(load.fates.of(m) for m in ids))
        figures["progress"] = load.progress
        figures["ledger_lag"] = ledger_lag(load.progress, faults, since)
        led = [f for f in faults if f.role == "leader" and "max_no_lease_gap_s" in f.extra]
        figures["leader_faults"] = {
            "count": len(led),
            "max_no_lease_gap_s": max((f.extra["max_no_lease_gap_s"] for f in led), default=None),
            "over_3s": sum(1 for f in led if f.extra["max_no_lease_gap_s"] > 3.0),
        }
        idle = [(p["t_s"], p["without_buckets"]) for p in load.progress if p.get("without_buckets")]
        figures["consumers_without_buckets"] = {"samples": len(idle), "first": idle[:3]}
        figures["clients"] = {
            "leases": len(journal.leases),
            "lease_answers": len(journal.answers),
            "lease_failures": journal.lease_failures,
            "acked_2xx": len(journal.acked),
            "rejected_2xx": len(journal.rejected),
            "nacked_2xx": journal.nacked,
            "abandoned": journal.abandoned,
            "settle_failures": dict(journal.settle_failures),
            "worker_counts": {w.consumer_id: asdict(w.counts) for w in load.workers},
        }
    logs = [tmp / f"n{i}.log" for i in (1, 2, 3)]
    figures["logs"] = log_findings([*logs, tmp / "clients.log"])
    return {"faults": [asdict(f) for f in faults], "figures": figures, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600, help="load with faults (600)")
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--fault-every", type=float, default=12.0, help="seconds between faults")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--lease-ms", type=int, default=3000)
    p.add_argument("--heartbeat-ms", type=int, default=3000)
    p.add_argument("--max-deliveries", type=int, default=3)
    p.add_argument("--retention-ms", type=int, default=15_000)
    p.add_argument("--append-every", type=float, default=2.0)
    p.add_argument("--nack-rate", type=float, default=0.05, help="per delivery")
    p.add_argument("--reject-rate", type=float, default=0.01)
    p.add_argument("--abandon-rate", type=float, default=0.01, help="dropped every delivery")
    p.add_argument("--abandon-first-rate", type=float, default=0.02)
    p.add_argument("--down-s", type=float, default=3.0, help="a killed node's time down")
    p.add_argument("--drain-s", type=float, default=120.0)
    p.add_argument("--ledger-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bootstrap", default="127.0.0.1:9", help="Kafka (lease topics need none)")
    p.add_argument("--tmp", help="parent folder of the run's folder (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep the run's folder (logs, tables)")
    p.add_argument("--secure", action="store_true", help="TLS on every node's HTTP and API keys on")
    args = p.parse_args(argv)

    def terminated(*_: object) -> None:
        raise SystemExit(143)  # runs the finally blocks: every node is stopped

    signal.signal(signal.SIGTERM, terminated)
    tmp = Path(tempfile.mkdtemp(prefix="dejaq-nemesis-", dir=args.tmp))
    started = time.time()
    # A run that fails a check, or raises, keeps its folder: the nodes' logs say what
    # the figures cannot.
    keep = True
    try:
        out = run(args, tmp)
        failed = failed_checks(out)
        keep = args.keep or bool(failed)
    finally:
        if keep:
            print(f"nemesis: the run's folder is kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    f = out["figures"]
    safety = {k: f.get(k) for k in SAFETY}
    report = {
        "bench": "nemesis",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "safe": not {"errors", "safety"}.intersection(failed),
        "safety": safety,
        "parameters": {**vars(args), "kafka_needed": False},
        "wall_s": round(time.time() - started, 1),
        "machine": machine(),
        "failed_checks": failed,
        "folder": str(tmp) if keep else None,
        **out,
    }
    print(json.dumps(report, indent=1, default=str))
    return 0 if report["safe"] else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
