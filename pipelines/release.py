"""`buffer/<topic>` → the topic's Kafka output, in order, recorded in `ledger/<topic>`.

A Structured Streaming query supplies the trigger and the batch ids: a `rate-micro-batch`
tick runs `foreachBatch` every `release_interval_ms` whether or not rows arrived, since
timeline messages fall due with time. The batch itself runs on the driver (Releaser):
the pending set lives in memory and follows new Delta files, so a trigger costs
milliseconds instead of a Spark job's seconds, and timeline messages due within the next
trigger are each produced at their own deliver_at (never before) rather than at the
next tick.

Per batch: follow buffer and ledger, take what is deliverable in order, produce it with
an idempotent producer, wait for the acks, then append `released` rows to the ledger
tagged (app id, batch id). A batch the ledger already has (Spark replays the last batch
after a crash) releases nothing; a batch killed between the Kafka acks and the ledger
commit is written again on restart: the only duplicates, and they carry `dejaq-id`.

The job is its topic's one deliverer and the one writer of its ledger, so between
batches it also runs retention on the buffer (`pipelines.retention`) and compacts the
ledger. Its costs then follow what is pending: a start reads the buffer (pending rows
plus the settled retention's tail) and the ledger from the buffer's retention watermark
on, and the pending set keeps no id of a message once it has left.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties, Transaction
from kafka import KafkaProducer
from kafka.errors import InvalidRecordError, MessageSizeTooLargeError, RecordListTooLargeError
from kafka.producer.future import FutureRecordMetadata
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from dejaq.conf.kafka_clients import close_producer, python_source_options
from dejaq.conf.settings import ConfigError, Delivery, Settings, TopicConfig, TopicKind
from dejaq.conf.tables import (
    APPEND_PROPERTIES,
    BROKER_APP_ID,
    BUFFER_SCHEMA,
    DEAD_LETTER_SCHEMA,
    LEDGER_SCHEMA,
    LedgerEvent,
    Table,
    app_transactions,
    checkpoint_path,
    ensure_buffer,
    ensure_table,
    is_broker_app_id,
    matching,
    scan,
)
from dejaq.pipelines.delta_follower import DeltaFollower
from dejaq.pipelines.envelope import (
    HEADER_DELIVER_AT,
    HEADER_EVENT_TIME,
    HEADER_ID,
    HEADER_PRIORITY,
)
from dejaq.pipelines.kafka_options import client_kwargs
from dejaq.pipelines.kafka_sink import in_partition_order, producer_config, wait_sent
from dejaq.pipelines.log_compaction import maintain_log
from dejaq.pipelines.pending import ROWS_AT_A_TIME, Message, PendingSet
from dejaq.pipelines.retention import LogGap, RetentionRun, period_s, retain, watermark
from dejaq.pipelines.timed_sender import Record, TimedSender

log = logging.getLogger("dejaq.release")

HEADER_SOURCE = "dejaq-source"
# The header that carries the sort key in force, per kind.
SORT_KEY_HEADER = {
    TopicKind.PRIORITY: HEADER_PRIORITY,
    TopicKind.TIMELINE: HEADER_DELIVER_AT,
    TopicKind.EVENT_TIME: HEADER_EVENT_TIME,
}
# The input's headers a released record does not keep: the envelope's, which it carries
# as released instead, and the one the release adds.
REPLACED_HEADERS = frozenset(
    {HEADER_ID, HEADER_PRIORITY, HEADER_DELIVER_AT, HEADER_EVENT_TIME, HEADER_SOURCE}
)
# How far ahead, in triggers, a timeline batch takes messages to produce at their time:
# more than one, so a message due just after the next tick is not late by a tick's overhead.
HORIZON_TRIGGERS = 2
# Ledger appends (one per releasing batch) between compactions of the ledger, into files
# of LOG_FILE_BYTES: the ledger's tail, which a start of this job and the ingest's
# dedup seed read, is then a few files, not one per batch.
LEDGER_COMPACT_EVERY = 100
# Batches whose stats a job keeps for its log lines (`ReleaseJob.report`) and the demo.
STATS_KEPT = 1000
# A released record's request size beyond its payload: its key, its headers (the input's
# and DejaQ's three) and the request's framing.
REQUEST_HEADROOM_BYTES = 64 * 1024
# The producer's timeouts (kafka-python's defaults, set here because the job's waits
# follow from them): a request Kafka does not answer within REQUEST_TIMEOUT_MS is sent
# again, and a record not acknowledged DELIVERY_TIMEOUT_MS after its send has failed.
DELIVERY_TIMEOUT_MS = 120_000
REQUEST_TIMEOUT_MS = 30_000
# How long closing the producer may take: every wait before a close has had its answers
# (or given up on them), so a close only stops its I/O thread, forced past this.
CLOSE_TIMEOUT_S = 10.0


def send_wait_s() -> float:
    """The longest the job waits for its producer's answers. Each record has one by the
    delivery timeout, unless the producer is stuck: kafka-python's idempotent producer
    can leave a flush unfinished for good after Kafka was unreachable past that timeout.
    The job then fails, and its restart sends what Kafka had not acknowledged."""
    return (DELIVERY_TIMEOUT_MS + REQUEST_TIMEOUT_MS) / 1000


@dataclass
class ReleaseStats:
    """One batch. `started_ms` (wall clock) and `buffer_version` (read up to) say when
    the job first held a buffer row: a timeline message first held after it fell due is
    released on arrival, late, and possibly after messages due later."""

    batch_id: int
    released: int
    late: int
    pending: int
    millis: int
    started_ms: int
    buffer_version: int
    replay: bool = False
    retention: RetentionRun | None = None  # the retention run after this batch, if any


@dataclass
class ReleaseTotals:
    """Every batch since the job started, for its summary at exit: `Releaser.stats`
    keeps only the last STATS_KEPT, minutes of a job that triggers every 250 ms."""

    batches: int = 0
    released: int = 0
    late: int = 0
    removed: int = 0  # settled messages retention removed from the buffer

    def add(self, stats: ReleaseStats, batch: bool = True) -> None:
        """Count one batch's stats; `batch` False for what `finish` records after the last."""
        self.batches += int(batch)
        self.released += stats.released
        self.late += stats.late
        self.removed += stats.retention.removed if stats.retention is not None else 0


class PartlySent(RuntimeError):
    """A batch's send failed; `acked`: its messages Kafka acknowledged all the same, in
    order (`in_partition_order`), `failed`: the others, in order."""

    def __init__(self, output: str, acked: list[Message], failed: list[Message]) -> None:
        of = len(acked) + len(failed)
        super().__init__(
            f"sending to Kafka topic {output} failed: {len(acked)} of {of} messages sent"
        )
        self.acked, self.failed = acked, failed


# A message Kafka refused for good, with why (`refusal`).
Refused = tuple[Message, str]
# Errors of one record that sending it again cannot mend: larger than the output topic
# (or the producer) takes, or invalid to the broker.
_REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError, InvalidRecordError)


def refusal(error: BaseException | None) -> str | None:
    """Why Kafka refused a record for good (its dead letter's reason), or None for an
    error that sending it again may get past."""
    if isinstance(error, _REFUSALS):
        return f"kafka_refused: {type(error).__name__}"
    return None


def require_release(topic: TopicConfig) -> None:
    """A topic is delivered by the broker or by this job, never both."""
    if topic.delivery is not Delivery.RELEASE:
        raise ConfigError(
            f"topic {topic.name!r} has delivery: {topic.delivery.value}: the lease broker "
            "delivers it, and releasing it too would deliver its messages twice. Set "
            "delivery: release and an output topic to release it to Kafka instead."
        )


def release_app_id(topic: str) -> str:
    """The ledger's app transaction of a topic's release, its version the batch id."""
    return f"dejaq-release-{topic}"


def taken_over_app_id(topic: str, brokers: str = BROKER_APP_ID) -> str:
    """The ledger's app transaction a take-over writes for the brokers' app transaction
    `brokers` (one per Raft history), its version that one's then."""
    history = brokers.removeprefix(BROKER_APP_ID).removeprefix(":")
    taken = f"{release_app_id(topic)}:taken-over"
    return f"{taken}:{history}" if history else taken


# What a take-over cannot carry, said where it is asked for and where it happens.
TAKE_OVER_LEFT = (
    "Nack delays and retry backoffs live in the brokers' Raft state only: the release "
    "takes a message they held back as soon as its key is due. Reschedules and "
    "priorities given with a nack are carried: the brokers' checkpoints write them to "
    "the ledger (rescheduled rows), so wait until it has caught up before they stop."
)


def require_owner(settings: Settings, topic: TopicConfig, take_over: bool) -> None:
    """Refuse a topic the lease broker delivered since the last take-over, unless
    `take_over` says its brokers are stopped and its workers drained: the brokers' Raft
    state holds what the ledger does not yet (leases in flight, events not yet
    checkpointed) and what it never holds (nack delays, retry backoffs:
    `TAKE_OVER_LEFT`), which this job cannot see. Reschedules and priorities given with
    a nack reach the ledger as `rescheduled` rows, which the pending set applies.
    A take-over notes each brokers' tag as it found it, one per Raft history that
    checkpointed the topic: a topic handed back to the brokers since, whose checkpoints
    moved a tag on or began one under a new history, needs another."""
    path = ensure_table(settings.warehouse, Table.LEDGER, topic.name)
    transactions = app_transactions(path)
    behind = [
        Transaction(taken_over_app_id(topic.name, app), tag)
        for app, tag in transactions.items()
        if is_broker_app_id(app) and transactions.get(taken_over_app_id(topic.name, app), -1) < tag
    ]
    if not behind:
        return
    if take_over:
        ledger = DeltaTable(path)
        marker = CommitProperties(app_transactions=behind)
        ledger.create_write_transaction(
            [], mode="append", schema=ledger.schema(), commit_properties=marker
        )
        log.warning("release %s: taken over from the lease broker; %s", topic.name, TAKE_OVER_LEFT)
        return
    raise ConfigError(
        f"topic {topic.name!r} was delivered by the lease broker (its ledger holds the "
        "brokers' checkpoints since this job last took it over): messages leased or "
        "delayed there, and acks not yet checkpointed, would be released while the "
        "brokers still hold them. Pause the topic, let the workers drain it, stop the "
        f"brokers, then start the release with --take-over. {TAKE_OVER_LEFT}"
    )


def output_headers(m: Message, kind: TopicKind) -> list[tuple[str, bytes]]:
    """The input's own headers, in order, then the envelope as released (sort key after
    reschedules) in place of the input's (`REPLACED_HEADERS`).

    A header whose value is null (Kafka allows it) leaves with an empty value: the
    producer sends none null, and refused, it would stop the release at that message."""
    own = [
        (key, b"" if value is None else value)
        for key, value in m.headers
        if key not in REPLACED_HEADERS
    ]
    return [
        *own,
        (HEADER_ID, m.message_id.encode()),
        (SORT_KEY_HEADER[kind], str(m.sort_key).encode()),
        (HEADER_SOURCE, f"{m.source_topic}/{m.source_partition}/{m.source_offset}".encode()),
    ]


def output_record(m: Message, kind: TopicKind) -> Record:
    """The record a message leaves as: key, value and headers (`output_headers`).

    A record with neither key nor value (headers only, which Kafka allows) leaves with
    an empty value, as the broker leases it: the producer sends none without both, and
    refused, it would stop the release at that message."""
    value = b"" if m.key is None and m.payload is None else m.payload
    return m.key, value, output_headers(m, kind)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _monotonic_ms() -> int:
    """The clock an idle timeout runs on: a wall clock stepped back would hold it."""
    return int(time.monotonic() * 1000)


@dataclass
class EventWatermark:
    """An event-time topic's watermark: the largest event time read (`top`) minus the
    allowed lateness, or `top` itself once `idle_timeout_ms` (None: never) has passed by
    this job's clock without a read moving `top`. Never lower than it has been, so an
    event idleness let pass stays passed when newer ones lower the bound again. The idle
    state lives in this process: a start runs the clock from its first read again."""

    lateness_ms: int
    idle_timeout_ms: int | None = None
    top: int | None = None
    _moved_ms: int = 0
    _floor: int | None = None  # the highest `top` an idle timeout released up to

    def follow(self, top: int | None, now_ms: int) -> None:
        """After a read: note a moved `top`, or let it pass once idle long enough."""
        if top != self.top:
            self.top, self._moved_ms = top, now_ms
        elif (
            top is not None
            and self.idle_timeout_ms is not None
            and now_ms - self._moved_ms >= self.idle_timeout_ms
        ):
            self._floor = top

    @property
    def value(self) -> int | None:
        if self.top is None:
            return None
        mark = self.top - self.lateness_ms
        return mark if self._floor is None else max(mark, self._floor)


class Releaser:
    """One topic's release, batch by batch, on the driver."""

    def __init__(self, settings: Settings, topic: TopicConfig, take_over: bool = False) -> None:
        require_release(topic)
        require_owner(settings, topic, take_over)
        self.settings = settings
        self.topic = topic
        self.output: str = topic.output or ""
        self.kind = topic.kind.sorted_as
        self.buffer_path = ensure_buffer(settings.warehouse, topic)
        self.ledger_path = ensure_table(settings.warehouse, Table.LEDGER, topic.name)
        self.buffer, self.ledger = self._followers()
        self.pending = PendingSet()
        self.event_watermark = EventWatermark(topic.allowed_lateness_ms, topic.idle_timeout_ms)
        self.stats: deque[ReleaseStats] = deque(maxlen=STATS_KEPT)
        self.totals = ReleaseTotals()
        self.idle = False
        self._producer: KafkaProducer | None = None
        self._sender: TimedSender | None = None
        self._last_batch: int | None = None
        self._committed: int | None = None
        self._tokens = max(topic.max_rate or 0.0, 1.0)  # a full bucket to start
        self._refilled = time.monotonic()
        self._retained: float | None = None  # monotonic time of the last retention run
        self._appends = 0  # ledger appends since this job started

    @property
    def app_id(self) -> str:
        return release_app_id(self.topic.name)

    def producer(self) -> KafkaProducer:
        if self._producer is None:
            config = producer_config(python_source_options(self.settings.kafka))
            # Room for the largest payload the ingest admits, with its key and headers:
            # the producer refuses a record past its request size, and one refused
            # would stop the release at that message.
            room = self.topic.max_payload_bytes + REQUEST_HEADROOM_BYTES
            config["max_request_size"] = max(config.get("max_request_size", 0), room)
            config.update(
                delivery_timeout_ms=DELIVERY_TIMEOUT_MS, request_timeout_ms=REQUEST_TIMEOUT_MS
            )
            self._producer = KafkaProducer(**client_kwargs(config), linger_ms=0)
        return self._producer

    def close(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            close_producer(producer, CLOSE_TIMEOUT_S)

    def watermark(self) -> int | None:
        """Event time: max event time seen minus the allowed lateness, or that max once the
        input was idle `idle_timeout_ms` (`EventWatermark`). Only event times at most
        `max_event_time_ahead_ms` ahead of this job's clock when read count (see
        `_refresh`)."""
        return self.event_watermark.value

    def refresh(self) -> int:
        """`_refresh`; a follower further behind than a table keeps its log (`LogGap`:
        the job was frozen for hours) reads the tables afresh, as a start does, keeping
        what this job has released and not yet read back."""
        try:
            return self._refresh()
        except LogGap as gap:
            log.warning("release %s: %s; reading the tables afresh", self.topic.name, gap)
            self.buffer, self.ledger = self._followers()
            held, self.pending = self.pending, self.pending.afresh()
            return self._refresh(held)

    def _followers(self) -> tuple[DeltaFollower, DeltaFollower]:
        """Followers of the buffer and the ledger that start from their latest versions."""
        return (
            DeltaFollower(self.buffer_path, BUFFER_SCHEMA),
            DeltaFollower(self.ledger_path, LEDGER_SCHEMA, time_column="at"),
        )

    def _refresh(self, held: PendingSet | None = None) -> int:
        """Take in new buffer rows, then the ledger; return how many new rows are late.

        The ledger is read after the buffer, so a cancel committed before this call is
        honoured even for a message whose buffer row arrives in the same call. It is
        read from the retention watermark of the buffer version read: the buffer holds
        nothing settled before it, so the first call (a start) reads the ledger's
        tail, not its history.

        A row is late when it is still pending after the ledger: a re-read after a gap
        adds the rows of messages released before it too, which the ledger then
        settles. Those `held` pending before the re-read were new at an earlier call.
        """
        events = self.kind is TopicKind.EVENT_TIME
        before = self.watermark() if events else None
        # The ingest quarantines an event time far ahead of its record's Kafka timestamp;
        # the clock bounds the rest (a producer's clock ahead, rows the ingest did not
        # judge), so that no one event holds the watermark in the future.
        mark_up_to = _now_ms() + self.topic.max_event_time_ahead_ms if events else None
        starting = self.buffer.version < 0
        if starting:
            log.info("release %s: reading the buffer's pending rows", self.topic.name)
        read_from = time.monotonic()
        rows = self.buffer.poll()
        progress = self._read_progress(rows.num_rows, read_from) if starting else None
        added = self.pending.add_buffer_rows(rows, mark_up_to, progress)
        if rows.num_rows >= ROWS_AT_A_TIME:
            # Arrow's allocator keeps what a read freed for reuse: after a start's read of
            # a large buffer, the job would hold about twice its pending set for its life.
            del rows
            pa.default_memory_pool().release_unused()
        if events:
            self.event_watermark.follow(self.pending.max_sort_key, _monotonic_ms())
        since = watermark(self.buffer.table) if self.buffer.table is not None else 0
        self.pending.forget_before(since)
        self.pending.apply_ledger_rows(self.ledger.poll(since_ms=since))
        if before is None:
            return 0
        return sum(
            1
            for m in added
            if m.sort_key <= before
            and m.message_id in self.pending
            and (held is None or m.message_id not in held)
        )

    def _read_progress(self, total: int, since: float) -> Callable[[int], None]:
        """A start's progress line per slice of rows taken in: a large buffer takes
        seconds a hundred thousand rows, and the job releases nothing until it is read."""

        said = [0]

        def say(done: int) -> None:
            if done - said[0] < ROWS_AT_A_TIME and done < total:
                return
            said[0] = done
            log.info(
                "release %s: %d of %d buffer rows read, %.1f s",
                self.topic.name,
                done,
                total,
                time.monotonic() - since,
            )

        return say

    def _cap(self) -> int:
        """max_per_trigger, and with max_rate a token bucket holding at most 1 s of tokens."""
        rate = self.topic.max_rate
        if rate is None:
            return self.topic.max_per_trigger
        now = time.monotonic()
        self._tokens = min(self._tokens + (now - self._refilled) * rate, max(rate, 1.0))
        self._refilled = now
        return min(self.topic.max_per_trigger, int(self._tokens))

    def select(self) -> list[Message]:
        """What this trigger writes, in order, per the topic's kind."""
        cap = self._cap()
        if self.kind is TopicKind.PRIORITY:
            taken = self.pending.take(cap)
        elif self.kind is TopicKind.TIMELINE:
            horizon = HORIZON_TRIGGERS * self.topic.release_interval_ms
            taken = self.pending.take(cap, up_to=_now_ms() + horizon)
        else:
            watermark = self.watermark()
            taken = [] if watermark is None else self.pending.take(cap, up_to=watermark)
        self._tokens -= len(taken)
        return taken

    def _due(self) -> bool:
        """Whether a pending message is deliverable now: a trigger whose rate let it
        take none is not idle then, or `--once` would exit leaving it pending."""
        if self.kind is TopicKind.PRIORITY:
            return len(self.pending) > 0
        bound = _now_ms() if self.kind is TopicKind.TIMELINE else self.watermark()
        first = self.pending.next_sort_key()
        return first is not None and bound is not None and first <= bound

    def _produce(self, messages: list[Message]) -> None:
        """Send in order and wait for every ack, `send_wait_s` at most in all; `PartlySent`
        if any send failed or was not answered in that time."""
        producer = self.producer()
        futures: list[FutureRecordMetadata] = []
        deadline = time.monotonic() + send_wait_s()
        try:
            for m in messages:
                key, value, headers = output_record(m, self.kind)
                futures.append(producer.send(self.output, key=key, value=value, headers=headers))
            wait_sent(producer, futures, max(deadline - time.monotonic(), 0.0))
        except Exception as e:
            # A send that raised left the earlier ones in flight: their outcome first.
            with contextlib.suppress(Exception):
                producer.flush(timeout=max(deadline - time.monotonic(), 0.0))
            # A message the producer never took comes after every one it did: none
            # acknowledged follows it in any partition.
            partitions = [f._produce_future.topic_partition for f in futures]
            sent = in_partition_order(partitions, [f.succeeded() for f in futures])
            sent += [False] * (len(messages) - len(futures))
            acked = [m for m, ok in zip(messages, sent, strict=True) if ok]
            failed = [m for m, ok in zip(messages, sent, strict=True) if not ok]
            raise PartlySent(self.output, acked, failed) from e

    def _sort_out(
        self, failed: list[Message], error: BaseException | None
    ) -> tuple[list[Message], list[Refused], list[Message], BaseException | None]:
        """After a send failed: (acked, refused, not sent, the error that stopped it).

        The producer is idempotent: a record Kafka refuses for good fails every record
        it held with it, and every one after. So when the error is such a refusal, each
        failed message is sent alone, in order, on a new producer after each refusal:
        the ones refused alone are told apart from the others. Any other error stops
        the sorting: what is left is sent again later, as after a failed batch."""
        if refusal(error) is None:
            return [], [], failed, error
        acked: list[Message] = []
        refused: list[Refused] = []
        self.close()  # a refusal leaves the producer refusing every later send
        for i, m in enumerate(failed):
            try:
                self._produce([m])
            except PartlySent as e:
                why = refusal(e.__cause__)
                if why is None:
                    return acked, refused, failed[i:], e.__cause__
                refused.append((m, why))
                self.close()
                continue
            acked.append(m)
        return acked, refused, [], None

    def sender(self) -> TimedSender:
        if self._sender is None:
            self._sender = TimedSender(
                self.producer(),
                self.output,
                lambda m: output_record(m, self.kind),
                send_wait_s(),
            )
        return self._sender

    def _record(
        self, messages: list[Message], batch_id: int, refused: list[Refused] | None = None
    ) -> None:
        """Append `released` ledger rows, and `dead` ones for the messages Kafka refused
        (their dead letters first); the pending set knows them all as written."""
        at = dt.datetime.now(dt.UTC)
        dead = [m for m, _ in refused or ()]
        if refused:
            self._dead_letters(refused, at)
        every = [*messages, *dead]
        events = [LedgerEvent.RELEASED.value] * len(messages) + [LedgerEvent.DEAD.value] * len(dead)
        rows = pa.table(
            {
                "message_id": [m.message_id for m in every],
                "bucket": [m.bucket for m in every],
                "event": events,
                "sort_key": [m.sort_key for m in every],
                "deliveries": [1] * len(every),
                "at": [at] * len(every),
            },
            schema=LEDGER_SCHEMA,
        )
        self.pending.settle(every)
        # `at` is the time of recording. A retention cutoff is its run's clock minus
        # settled_retention_ms, and runs come between batches, so every event recorded
        # after a run is at or after its cutoff: `retain` needs no bound on unwritten
        # events here. That holds on a timeline too: the timed sender's acknowledged
        # messages are recorded at the next batch, stamped with that batch's time.
        write_deltalake(
            self.ledger_path,
            rows,
            mode="append",
            writer_properties=APPEND_PROPERTIES,
            commit_properties=CommitProperties(
                app_transactions=[Transaction(self.app_id, batch_id)],
                custom_metadata={"dejaq.appId": self.app_id, "dejaq.batchId": str(batch_id)},
            ),
        )
        self._committed = batch_id
        self._appends += 1
        if self._appends % LEDGER_COMPACT_EVERY == 0:
            maintain_log(self.ledger_path, "at", self.topic.settled_retention_ms)

    def _dead_letters(self, refused: list[Refused], at: dt.datetime) -> None:
        """The dead letters of messages Kafka refused: their buffer rows, with the reason.
        Those the table holds already (a batch done again) are not added twice."""
        path = ensure_table(self.settings.warehouse, Table.DEAD_LETTER, self.topic.name)
        why = {m.message_id: reason for m, reason in refused}
        held = scan(
            path, Table.DEAD_LETTER, ["message_id"], matching(Table.DEAD_LETTER, message_id=why)
        )
        new = set(why) - set(held.column("message_id").to_pylist())
        if not new:
            return
        found = scan(self.buffer_path, Table.BUFFER, where=matching(Table.BUFFER, message_id=new))
        letters = []
        for row in found.to_pylist():
            if row["message_id"] in new:
                new.discard(row["message_id"])
                row.pop("ingested_at", None)
                reason = why[row["message_id"]]
                letters.append(row | {"deliveries": 1, "reason": reason, "dead_at": at})
        if new:
            log.warning(
                "release %s: no buffer row of %s, refused by Kafka: no dead letter holds them",
                self.topic.name,
                sorted(new)[:10],
            )
        if not letters:
            return
        log.warning(
            "release %s: Kafka refused %d messages for good, now dead letters: %s",
            self.topic.name,
            len(letters),
            [(r["message_id"], r["reason"]) for r in letters[:10]],
        )
        table = pa.Table.from_pylist(letters, schema=DEAD_LETTER_SCHEMA)
        write_deltalake(path, table, mode="append", writer_properties=APPEND_PROPERTIES)

    def run_retention(self) -> RetentionRun | None:
        """Remove the messages settled more than `settled_retention_ms` ago from the
        buffer, at most once a retention period; None when not due or nothing moved.

        Maintenance, not data: a failure is logged, not raised, and the next period
        tries again.
        """
        retention_ms = self.topic.settled_retention_ms
        now = time.monotonic()
        if self._retained is not None and now - self._retained < period_s(retention_ms):
            return None
        self._retained = now
        try:
            return retain(self.buffer_path, self.ledger_path, retention_ms, _now_ms())
        except Exception:
            log.warning(
                "retention of %s failed; the next round tries again", self.topic.name, exc_info=True
            )
            return None

    def run_batch(self, batch_id: int) -> ReleaseStats:
        """One trigger: refresh, select, produce, record.

        Priority and event-time batches produce and wait for the acks before recording.
        Timeline batches hand what falls due before the next trigger to the timed sender
        and record what it has had acknowledged since the previous batch.
        """
        started, started_ms = time.monotonic(), _now_ms()
        self._last_batch = batch_id
        if self._committed is None:
            self._committed = DeltaTable(self.ledger_path).transaction_version(self.app_id)
        if self._committed is not None and batch_id < self._committed:
            # Spark replays at most the last batch: one below it comes from a checkpoint
            # made anew (deleted by hand, say). Its batches release as any: what the
            # ledger says was released is known from the ledger, not the batch ids.
            log.warning(
                "release %s: batch %d is below the ledger's last, %d: the job's checkpoint "
                "was made anew; releasing on",
                self.topic.name,
                batch_id,
                self._committed,
            )
            self._committed = -1
        if self._committed is not None and batch_id == self._committed:
            log.warning("release %s batch %d is in the ledger: a replay", self.topic.name, batch_id)
            stats = ReleaseStats(
                batch_id, 0, 0, len(self.pending), 0, started_ms, self.buffer.version, replay=True
            )
            self._note(stats)
            return stats
        late = self.refresh()
        taken = self.select()
        refused: list[Refused] = []
        error: BaseException | None = None
        if self.kind is TopicKind.TIMELINE:
            self.pending.settle(taken)  # the sender has them: a re-read must not add them back
            sender = self.sender()
            sender.schedule(taken)
            released = sender.take_acked()
            if sender.error is not None:
                released, refused, error = self._timed_failure(sender, released)
        else:
            try:
                self._produce(taken)
                released = taken
            except PartlySent as e:
                more, refused, left, error = self._sort_out(e.failed, e.__cause__)
                released = e.acked + more
                self.pending.put_back(left)
            except BaseException:
                self.pending.put_back(taken)
                raise
        # What Kafka acknowledged is released, and what it refused for good is dead: the
        # ledger says so before an error ends the job, or its restart would send them
        # again (and stop at the refused one each time).
        if released or refused:
            self._record(released, batch_id, refused)
        if error is not None:
            raise RuntimeError(f"sending to Kafka topic {self.output} failed") from error
        busy = bool(self._sender and self._sender.busy)
        self.idle = not taken and not released and not busy and not self._due()
        run = self.run_retention()
        stats = ReleaseStats(
            batch_id=batch_id,
            released=len(released),
            late=late,
            pending=len(self.pending),
            millis=int((time.monotonic() - started) * 1000),
            started_ms=started_ms,
            buffer_version=self.buffer.version,
            retention=run,
        )
        self._note(stats)
        return stats

    def _note(self, stats: ReleaseStats, batch: bool = True) -> None:
        self.stats.append(stats)
        self.totals.add(stats, batch)

    def _timed_failure(
        self, sender: TimedSender, acked: list[Message]
    ) -> tuple[list[Message], list[Refused], BaseException | None]:
        """The timed sender stopped at a send error: (acked, refused, the error that
        stops the job, if any). Its failed messages are sorted out (`_sort_out`), and the
        ones it had not sent yet go to a new sender, unless the error stands."""
        unsent = sender.stop()
        acked = acked + sender.take_acked()
        self._sender = None
        more, refused, _, error = self._sort_out(sender.failed, sender.error)
        if error is None:
            self.sender().schedule(unsent)
        return acked + more, refused, error

    def finish(self) -> None:
        """After the last batch: record what the timed sender got acknowledged, then close.

        Tagged with the last batch's id, which Spark will not run again with new work, so
        a clean stop leaves nothing to write twice. Unsent messages stay pending.
        """
        try:
            if self._sender is not None:
                self._sender.stop()
                released = self._sender.take_acked()
                failed = self._sender.failed
                if failed:
                    log.warning(
                        "release %s: %d messages sent and not acknowledged (%s): sent at "
                        "the next start",
                        self.topic.name,
                        len(failed),
                        self._sender.error or f"no answer within {send_wait_s():.0f} s",
                    )
                if released and self._last_batch is not None:
                    batch_id = max(self._last_batch, self._committed or 0)
                    self._record(released, batch_id)
                    stats = ReleaseStats(
                        batch_id, len(released), 0, 0, 0, _now_ms(), self.buffer.version
                    )
                    self._note(stats, batch=False)
        finally:
            self._sender = None
            self.close()


@dataclass
class ReleaseJob:
    """The streaming query that drives a Releaser: one foreachBatch call per tick."""

    spark: SparkSession
    settings: Settings
    topic: TopicConfig
    take_over: bool = False  # `require_owner`
    releaser: Releaser = field(init=False)
    _reported: int = -1

    def __post_init__(self) -> None:
        self.releaser = Releaser(self.settings, self.topic, self.take_over)

    @property
    def checkpoint(self) -> str:
        return checkpoint_path(self.settings.warehouse, "release", self.topic.name)

    def _batch(self, ticks: DataFrame, batch_id: int) -> None:
        self.releaser.run_batch(batch_id)

    def start(self) -> StreamingQuery:
        return (
            self.spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", 1)
            .load()
            .writeStream.queryName(self.releaser.app_id)
            .foreachBatch(self._batch)
            .option("checkpointLocation", self.checkpoint)
            .trigger(processingTime=f"{self.topic.release_interval_ms} milliseconds")
            .start()
        )

    def report(self) -> None:
        """Log one line per batch that released something, or was a replay."""
        for s in list(self.releaser.stats):
            if s.batch_id <= self._reported:
                continue
            self._reported = s.batch_id
            if s.released or s.replay or s.late:
                log.info(
                    "release %s batch %d: released %d%s, late %d, pending %d, %d ms",
                    self.topic.name,
                    s.batch_id,
                    s.released,
                    " (replay skipped)" if s.replay else "",
                    s.late,
                    s.pending,
                    s.millis,
                )
