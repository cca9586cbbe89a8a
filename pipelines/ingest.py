"""Kafka → `buffer/<topic>` and `quarantine/<topic>`, one micro-batch at a time.

Each micro-batch is read, parsed and written in one Spark stage, its records split
between the two tables' files (`pipelines.batch_files`); the driver then judges the
explicit ids and commits each table's files. Both Delta commits carry the
(app id, batch version) pair, so a batch replayed after a crash is skipped by the table
that already has it. A record thus lands exactly once in exactly one of the tables.
The quarantine is appended first, so a batch the buffer has is done: its replay is
not judged again (the dedup seed has learnt its ids since, see `process_batch`). Both
commits (the quarantine's where it has rows) also record where the batch left each Kafka
partition, as Spark planned it in the checkpoint's offsets log: a query whose checkpoint
was lost resumes from the buffer's (`pipelines.ingest_resume`), and a batch a table has
from other positions is another driver's, or a checkpoint's older than the tables.

Both tables are written by delta-rs only, whichever connectors read: executors write
the files, the driver commits them (`pipelines.delta_source`). Retention and compaction
rewrite the buffer with delta-rs too, so on S3 every commit is a conditional create
that the store refuses to a second writer of the same version, which then retries;
delta-spark's S3 log store has no such guard beside another writer.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from dejaq.conf.kafka_clients import jvm_options, python_source_options
from dejaq.conf.settings import Settings, TopicConfig
from dejaq.conf.tables import (
    KIND_PROPERTY,
    KindChanged,
    Table,
    checkpoint_path,
    column,
    ensure_buffer,
    ensure_table,
    matching,
    scan,
    table_path,
)
from dejaq.pipelines.batch_files import RESULT_SPARK_SCHEMA, VALID, BatchFiles, task
from dejaq.pipelines.compaction import maintain
from dejaq.pipelines.dedup import Coordinates, SeenIds, Verdict, default_id_pattern
from dejaq.pipelines.delta_source import SecondWriter, TableChanged, WriteTarget, commit
from dejaq.pipelines.envelope import COORDINATES, Parser, explicit_id
from dejaq.pipelines.ingest_resume import (
    Partition,
    Resume,
    offset_app_id,
    planned,
    positions,
    resume,
    since_app_id,
    version,
)
from dejaq.pipelines.retention import expire_quarantine, ledger_tail
from dejaq.pipelines.session import Connectors, shaded_kafka

log = logging.getLogger("dejaq.ingest")

DEFAULT_MAX_OFFSETS_PER_TRIGGER = 250_000
# How often all ids past the dedup window are looked for in the buffer, to be freed
# once their rows left it (`SeenIds.prune`): memory, as a batch looks for those it reuses.
PRUNE_EVERY_S = 600.0
STATS_KEPT = 1000  # the last batches' stats, for their log lines


class CheckpointBehind(RuntimeError):
    """The checkpoint plans a batch the buffer has, over other Kafka positions than the
    buffer's commit of it: a copy older than the tables, or another driver's. Skipped
    as a replay, its records would land in neither table."""


@dataclass
class BatchStats:
    batch_id: int
    rows_in: int
    buffered: int
    quarantined: int
    millis: int
    reasons: dict[str, int] = field(default_factory=dict)
    phases_ms: dict[str, int] = field(default_factory=dict)
    replay: bool = False  # a batch the buffer already had: skipped


@dataclass
class IngestTotals:
    """Every batch since the job started, for its summary at exit: `IngestJob.stats`
    keeps only the last STATS_KEPT."""

    batches: int = 0
    rows_in: int = 0
    buffered: int = 0
    quarantined: int = 0

    def add(self, stats: BatchStats) -> None:
        self.batches += 1
        self.rows_in += stats.rows_in
        self.buffered += stats.buffered
        self.quarantined += stats.quarantined


class _Phases:
    """Milliseconds per phase of a batch: where an ingest's time goes."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()
        self.laps: dict[str, int] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = int((now - self.last) * 1000)
        self.last = now

    def total_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)


def _still_buffered(buffer_path: str, ids: dict[str, Coordinates]) -> list[str]:
    """Which of `ids` still have their rows (at the given coordinates) in the buffer.

    Filtered by the rows' Kafka coordinates too: each file's statistics bound its
    partitions and offsets, so only the files that may hold one of these rows are read,
    not every file's ids. The filter is weighed against every file's bounds: for the few
    ids a batch reuses.
    """
    topics, partitions, offsets = (set(c) for c in zip(*ids.values(), strict=True))
    where = matching(
        Table.BUFFER,
        source_topic=topics,
        source_partition=partitions,
        source_offset=offsets,
        message_id=list(ids),
    )
    return scan(buffer_path, Table.BUFFER, ["message_id"], where).column("message_id").to_pylist()


@dataclass
class IngestJob:
    """The ingest of one configured topic."""

    spark: SparkSession
    settings: Settings
    topic: TopicConfig
    connectors: Connectors
    max_offsets_per_trigger: int = DEFAULT_MAX_OFFSETS_PER_TRIGGER
    stats: deque[BatchStats] = field(default_factory=lambda: deque(maxlen=STATS_KEPT))
    totals: IngestTotals = field(default_factory=IngestTotals)
    _reported: int = -1
    _seen: SeenIds | None = None
    _pruned_at: float = 0.0  # time.monotonic() of the last `_prune_seen`
    # Where the query starts; its batch b is the tables' version `base + b`.
    _resume: Resume = field(default_factory=Resume)
    _stored: int = -1  # the last batch version the buffer had when this job started
    # The last batch version the quarantine had when this job started: one past
    # `_stored` is a batch cut between its two commits.
    _quarantined: int = -1
    # The first batch version that recorded Kafka positions (-1: none yet; this job's
    # next commit records it, `ingest_resume.since_app_id`).
    _positions_since: int = -1
    _parse: Parser | None = None
    # The two tables as their writers need them (schema, partitioning), read once: the
    # contract fixes both, and on an object store each read is requests.
    _targets: tuple[WriteTarget, WriteTarget] | None = None

    @property
    def app_id(self) -> str:
        return f"dejaq-ingest-{self.topic.name}"

    @property
    def checkpoint(self) -> str:
        return checkpoint_path(self.settings.warehouse, "ingest", self.topic.name)

    @property
    def _cut_app_id(self) -> str:
        """The quarantine's txn for the records a batch done again after its cut finds
        bad that the first try did not: that batch's own txn is committed already."""
        return f"{self.app_id}:after-cut"

    @property
    def _way_out(self) -> str:
        return (
            f"Stop every ingest of topic {self.topic.name}, delete its checkpoint "
            f"{self.checkpoint}, then start one: it reads Kafka on from where the "
            "buffer's last batch left it"
        )

    def source(self) -> DataFrame:
        kafka = self.settings.kafka
        if self.connectors.jvm_kafka:
            security = jvm_options(kafka, shaded=shaded_kafka(self.spark))
        else:
            security = python_source_options(kafka)
        return (
            self.spark.readStream.format(self.connectors.kafka)
            .options(**security)
            .option("kafka.isolation.level", kafka.isolation_level)
            .option("subscribe", ",".join(self.topic.source))
            .option("startingOffsets", self._resume.starting_offsets)
            .option("includeHeaders", "true")
            .option("failOnDataLoss", "false")
            .option("maxOffsetsPerTrigger", str(self.max_offsets_per_trigger))
            .load()
        )

    def _load_seen(self) -> SeenIds:
        """The explicit ids taken (one read per start): the buffer's rows, and the ids
        the ledger settled within the dedup window, whose rows retention may have
        removed from the buffer since."""
        seen = SeenIds(self.topic.dedup_window_ms)
        path = table_path(self.settings.warehouse, Table.BUFFER, self.topic.name)
        stored = (
            self.spark.read.format(self.connectors.delta)
            .option("columns", "message_id,source_topic,source_partition,source_offset,ingested_at")
            .load(path)
            .where(explicit_id())
            .select("message_id", *COORDINATES, F.unix_millis("ingested_at"))
            .toArrow()
        )
        buffered = zip(*(c.to_pylist() for c in stored.columns), strict=True)
        since_ms = int(time.time() * 1000) - self.topic.dedup_window_ms
        seen.load(itertools.chain(buffered, self._settled_ids(since_ms)))
        return seen

    def _settled_ids(self, since_ms: int) -> list[tuple[str, None, None, None, int]]:
        """The explicit ids with a settling ledger event at or after `since_ms`, and its
        time: (id, no coordinates, at ms).

        Reads only the ledger files whose largest `at` reaches `since_ms`: the ledger's
        last dedup window, not its history. Default ids (`<source topic>-<partition>-
        <offset>`) cannot repeat and are left out.
        """
        path = table_path(self.settings.warehouse, Table.LEDGER, self.topic.name)
        if not DeltaTable.is_deltatable(path):
            return []
        tail = ledger_tail(path, since_ms, ["message_id", "at"])
        default = pc.match_substring_regex(
            tail.column("message_id"), default_id_pattern(self.topic.source)
        )
        tail = tail.filter(pc.invert(default))
        ids = tail.column("message_id").to_pylist()
        at_ms = pc.divide(tail.column("at").cast(pa.int64()), 1000).to_pylist()
        return [(mid, None, None, None, at) for mid, at in zip(ids, at_ms, strict=True)]

    def _prune_seen(self, buffer_path: str) -> None:
        """Free the ids past the dedup window whose rows left the buffer, every
        `PRUNE_EVERY_S`, for memory (a batch that reuses one looks for it itself): a read
        of the buffer's ids, as big as what is pending. A failure is logged; the next
        round tries."""
        assert self._seen is not None
        if not self._seen.lingering or time.monotonic() < self._pruned_at + PRUNE_EVERY_S:
            return
        self._pruned_at = time.monotonic()
        lingering = list(self._seen.lingering)
        try:
            ids = column(Table.BUFFER, "message_id").isin(lingering)
            still = scan(buffer_path, Table.BUFFER, ["message_id"], ids).column("message_id")
        except Exception:
            log.warning("reading %s's ids failed; the next round tries", buffer_path, exc_info=True)
            return
        gone = self._seen.prune(still.to_pylist())
        log.info("%s: %d ids past the dedup window left the buffer", self.topic.name, gone)

    def _free_reused(self, buffer_path: str, judged: pa.Table) -> None:
        """Free the ids a batch reuses past their dedup window whose rows left the
        buffer, before it is judged: a message that reuses one is stored, not held a
        duplicate until the next `_prune_seen`. A failed read fails the batch, as a
        failed commit does: judged without it, such a message would be quarantined."""
        assert self._seen is not None
        if not self._seen.lingering:  # the usual case: no batch's ids to list
            return
        reused = self._seen.lingering_among(judged.column("message_id").to_pylist())
        if reused:
            self._seen.prune(_still_buffered(buffer_path, reused), among=reused)

    def _expire_quarantine(self, path: str) -> None:
        """Maintenance, as compaction is: a failure is logged, and the next round tries."""
        try:
            gone = expire_quarantine(
                path, self.topic.quarantine_retention_ms, int(time.time() * 1000)
            )
        except Exception:
            log.warning("expiring %s failed; the next round tries again", path, exc_info=True)
            return
        if gone:
            log.info("%s: %d records past quarantine_retention_ms deleted", path, gone)

    def process_batch(self, records: DataFrame, batch_id: int) -> None:
        """Parse and write, dedup, commit to both tables; both commits are idempotent
        per batch.

        A batch the buffer already has (Spark replays the last batch after a crash) is
        skipped whole: the quarantine was appended before it, and judging it again
        would find its own ids in the dedup seed, from the ledger without coordinates
        once they are settled, and quarantine its own rows. Only the buffer's last batch
        can be replayed, planned to the positions its commit recorded: any other is
        refused (`CheckpointBehind`). The tables know a batch by its version: its id past
        the base of a checkpoint made anew (`pipelines.ingest_resume`).
        """
        clock = _Phases()
        buffer_path = table_path(self.settings.warehouse, Table.BUFFER, self.topic.name)
        quarantine_path = table_path(self.settings.warehouse, Table.QUARANTINE, self.topic.name)
        if self._seen is None:
            self._stored = version(buffer_path, self.app_id)
            self._quarantined = version(quarantine_path, self.app_id)
            self._positions_since = version(buffer_path, since_app_id(self.app_id))
            self._seen = self._load_seen()
        if self._targets is None:
            self._targets = WriteTarget.of(buffer_path), WriteTarget.of(quarantine_path)
        buffer, quarantine = self._targets
        batch = self._resume.base + batch_id
        ends = planned(self.checkpoint, batch_id)
        if batch <= self._stored:
            self._check_replay(ends, buffer, batch_id, batch)
            log.warning("ingest %s batch %d is in the buffer: a replay", self.topic.name, batch_id)
            self._note(BatchStats(batch_id, 0, 0, 0, clock.total_ms(), replay=True))
            return
        if self._parse is None:
            self._parse = Parser(self.topic)
        # No more tasks than cores (fewer stay as they are): each writes a file per
        # bucket, and tasks beyond those that run at once only make more, smaller files.
        records = records.coalesce(self.spark.sparkContext.defaultParallelism)
        write = task(buffer, quarantine, dt.datetime.now(dt.UTC))
        results = self._parse(records).mapInArrow(write, RESULT_SPARK_SCHEMA).toArrow()
        files = BatchFiles.read(results)
        clock.lap("read_parse_write")
        # One time for the verdict and the commit: a clock stepping back between two
        # reads could leave an id judged free unstored, free again for the next batch.
        judged_at = int(time.time() * 1000)
        cut = batch <= self._quarantined
        if cut:
            verdict = self._finish_cut(files, ends, buffer_path, quarantine_path)
        else:
            self._seen.expire(judged_at)
            self._prune_seen(buffer_path)
            self._free_reused(buffer_path, files.judged)
            verdict = self._seen.check(files.judged, judged_at)
        if verdict.duplicates:
            files.move_duplicates(buffer, quarantine, verdict.duplicates)
        clock.lap("dedup")
        counts = dict(files.counts)
        buffered = counts.pop(VALID, 0)
        txn = (self.app_id, batch)
        # With no files too: the buffer's last batch is where a new checkpoint resumes.
        since = batch if self._positions_since < 0 else None
        try:
            # Positions with the quarantine's rows too, so a second driver fails at its
            # first commit, before its rows of the batch are skipped for the other's. A
            # batch that quarantines none commits nothing here: no commit a batch.
            quarantined = [] if cut else files.quarantine
            at = positions(self.app_id, ends) if quarantined or cut else ()
            commit(quarantine, quarantined, "append", txn, at)
            if cut:
                commit(quarantine, files.quarantine, "append", (self._cut_app_id, batch))
            clock.lap("commit_quarantine")
            commit(
                buffer,
                files.buffer,
                "append",
                txn,
                positions(self.app_id, ends, since),
                {KIND_PROPERTY: self.topic.kind.value},
            )
        except TableChanged as e:
            raise KindChanged(
                f"topic {self.topic.name!r}: its buffer was recorded as kind "
                f"{e.found[KIND_PROPERTY]} (by a broker or release started since with that "
                f"configuration) while this ingest writes kind {self.topic.kind.value}: its "
                "batch is not committed; start the ingest with the topic's new configuration, "
                "or give the brokers and release the old one back"
            ) from e
        except SecondWriter as e:
            # The checkpoint may hold either driver's offsets now; the buffer holds the
            # positions of its last whole batch, where a new checkpoint resumes.
            raise SecondWriter(f"{e}. {self._way_out}") from e
        if since is not None:  # as the table has it: a replay's commit is skipped
            self._positions_since = version(buffer_path, since_app_id(self.app_id))
        clock.lap("commit_buffer")
        self._seen.commit(verdict, judged_at)
        every = self.topic.compact_every_batches
        if every and (batch_id + 1) % every == 0:
            self._expire_quarantine(quarantine_path)
            for path in (buffer_path, quarantine_path):
                maintain(path)
            clock.lap("compact")
        stats = BatchStats(
            batch_id=batch_id,
            rows_in=buffered + sum(counts.values()),
            buffered=buffered,
            quarantined=sum(counts.values()),
            millis=clock.total_ms(),
            reasons=counts,
            phases_ms=clock.laps,
        )
        self._note(stats)

    def _note(self, stats: BatchStats) -> None:
        self.stats.append(stats)
        self.totals.add(stats)

    def _check_replay(
        self, ends: dict[Partition, int], buffer: WriteTarget, batch_id: int, batch: int
    ) -> None:
        """Raise CheckpointBehind unless batch `batch` is the buffer's last, planned to
        the positions its commit recorded (`ends`, every partition of the plan): Spark
        replays only the last batch it planned, so an earlier one, or one over other
        positions, is a checkpoint behind the tables (an older copy, another driver's),
        and skipping it loses its records. The plan, not the records read: a replay
        reads Kafka as it is then, which may have compacted the batch's last records
        away, and a partition it reads nothing of is compared too."""
        behind = (
            f"ingest {self.topic.name} batch {batch_id} (version {batch}) is one the buffer "
            f"has (up to version {self._stored})"
        )
        if batch < self._stored:
            raise CheckpointBehind(
                f"{behind}: the checkpoint {self.checkpoint} is behind the buffer (an older "
                "copy, or another driver's), and skipping its batches would lose the records "
                f"they read. {self._way_out}"
            )
        try:
            commit(buffer, [], "append", (self.app_id, batch), positions(self.app_id, ends))
        except SecondWriter as e:
            raise CheckpointBehind(
                f"{behind}, from other Kafka positions: the checkpoint {self.checkpoint} is "
                f"not the one that wrote it (an older copy, or another driver's). {e}. "
                f"{self._way_out}"
            ) from e

    def _finish_cut(
        self,
        files: BatchFiles,
        ends: dict[Partition, int],
        buffer_path: str,
        quarantine_path: str,
    ) -> Verdict:
        """The verdict on a batch cut between its two commits, done again: the rows the
        quarantine holds from the batch's Kafka range (from the buffer's positions to
        `ends`) stay its only rows there, whatever put them there (a parse under another
        configuration, a dedup seed since grown), and leave the files of this try; every
        other record is kept, or quarantined if it is bad now (`_cut_app_id`). Judged
        again, a record the first try kept could be found bad or a duplicate, for a
        quarantine whose commit is done: it would land nowhere, and one the first
        quarantined could land in both tables."""
        started = DeltaTable(buffer_path)  # where the batch before left each partition
        where = None
        for (topic, partition), end in ends.items():
            at = offset_app_id(self.app_id, (topic, partition))
            start = started.transaction_version(at) or 0
            if start >= end:
                continue  # no offset of it in the batch
            offset = column(Table.QUARANTINE, "source_offset")
            read = matching(Table.QUARANTINE, source_topic=[topic], source_partition=[partition])
            read &= (offset >= start) & (offset < end)
            where = read if where is None else where | read
        if where is None:
            return Verdict()
        held = scan(quarantine_path, Table.QUARANTINE, [*COORDINATES, "reason"], where)
        done = set(zip(*(held.column(c).to_pylist() for c in COORDINATES), strict=True))
        assert self._targets is not None
        files.drop(*self._targets, done)
        for reason in held.column("reason").to_pylist():
            files.counts[reason] = files.counts.get(reason, 0) + 1
        verdict = Verdict()
        names = ["message_id", *COORDINATES]
        for mid, *coordinates in zip(
            *(files.judged.column(c).to_pylist() for c in names), strict=True
        ):
            if tuple(coordinates) not in done:
                verdict.kept[mid] = tuple(coordinates)  # type: ignore[assignment]
        return verdict

    def report(self, query: StreamingQuery) -> None:
        """Log one line per micro-batch finished since the last call.

        Read from the query's own progress on the caller's thread, so the line is there
        before the job exits (a listener's events arrive asynchronously, possibly never).
        An idle trigger reports progress under the id of the batch that has not run yet
        and took milliseconds; only a trigger that ran its batch (`addBatch`) times it,
        so a batch is logged once that progress has come.
        """
        by_id = {s.batch_id: s for s in self.stats}
        for p in query.recentProgress:
            stats = by_id.get(p.batchId)
            if stats is None or p.batchId <= self._reported or "addBatch" not in p.durationMs:
                continue
            self._reported = p.batchId
            if stats.replay:
                continue  # logged when skipped
            source = p.sources[0] if p.sources else None
            lag = partition_lag(source.endOffset, source.latestOffset) if source else {}
            lag_text = " ".join(f"{k}={v}" for k, v in sorted(lag.items())) or "-"
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats.reasons.items()))
            log.info(
                "ingest %s batch %d: in %d, buffered %d, quarantined %d%s, %d ms, lag %s",
                self.topic.name,
                stats.batch_id,
                stats.rows_in,
                stats.buffered,
                stats.quarantined,
                f" ({reasons})" if reasons else "",
                p.batchDuration,
                lag_text,
            )

    def start(self, once: bool) -> StreamingQuery:
        """Start the query: `once` reads what is there now and stops (availableNow).

        The tables are created here, once, so every batch can simply append to them.
        Raises KindChanged when the buffer holds rows of another kind than the topic's
        (`conf.tables.ensure_buffer`), and CannotResume when the checkpoint is new and
        the tables cannot say where the last one had got to (`pipelines.ingest_resume`).
        """
        buffer = ensure_buffer(self.settings.warehouse, self.topic)
        quarantine = ensure_table(self.settings.warehouse, Table.QUARANTINE, self.topic.name)
        self._resume = resume(
            self.checkpoint, buffer, quarantine, self.app_id, self.settings.kafka, self.topic.source
        )
        writer = (
            self.source()
            .writeStream.queryName(self.app_id)
            .foreachBatch(self.process_batch)
            .option("checkpointLocation", self.checkpoint)
        )
        writer = (
            writer.trigger(availableNow=True) if once else writer.trigger(processingTime="1 second")
        )
        return writer.start()


def partition_lag(end_offset: str | None, latest_offset: str | None) -> dict[str, int]:
    """`topic/partition → latest - end` from a query progress's source offsets (JSON)."""
    end = _offsets(end_offset)
    latest = _offsets(latest_offset)
    return {
        f"{topic}/{part}": max(0, latest_off - end.get(topic, {}).get(part, 0))
        for topic, parts in latest.items()
        for part, latest_off in parts.items()
    }


def _offsets(value: str | None) -> dict[str, dict[str, int]]:
    parsed = json.loads(value) if value else None
    return parsed if isinstance(parsed, dict) else {}
