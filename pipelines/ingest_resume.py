"""Where an ingest resumes when its Spark checkpoint is new (deleted, lost, made again).

The checkpoint holds the Kafka offsets the query has read and numbers its batches from
0. The buffer's commits record both as Delta app transactions, which outlive the
checkpoint: (`<app id>`, the batch's version) and, per Kafka partition of the topics,
(`<app id>:<topic>:<partition>`, the offset where Spark planned the batch to end, the
next to read: `planned`). Every batch commits the buffer, with no files if all went to
the quarantine, so the buffer has the positions of the last whole batch.

A query on a new checkpoint reads Kafka from those positions, as a consumer group
resumes from its committed offsets, and gives its batches versions past the last the
tables hold (a base kept in the checkpoint's folder): none is skipped as a replay, no
record is read twice.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.transaction import Transaction

from dejaq.conf.kafka_clients import python_config
from dejaq.conf.settings import KafkaConfig
from dejaq.conf.storage import has_folders
from dejaq.pipelines import offsets_log

log = logging.getLogger("dejaq.ingest")

BASE_FILE = "dejaq-version-base"  # in the checkpoint's folder: deleted with it
EARLIEST = -2  # both Kafka connectors' marker in a startingOffsets JSON

Partition = tuple[str, int]  # (Kafka topic, partition)
# How long a new checkpoint waits for Kafka to list every partition of its topics (a
# leader election, metadata not loaded yet) before it refuses to start.
PARTITIONS_WAIT_S = 30.0


class CannotResume(RuntimeError):
    """The checkpoint is new and the tables do not say where the last one had got to."""


@dataclass(frozen=True)
class Resume:
    """How a query starts: its batch `b` commits version `base + b`; `starting_offsets`
    is Kafka's, used by Spark only when the checkpoint has no batch yet."""

    base: int = 0
    starting_offsets: str = "earliest"


def offset_app_id(app_id: str, partition: Partition) -> str:
    topic, number = partition
    return f"{app_id}:{topic}:{number}"


def since_app_id(app_id: str) -> str:
    """The app transaction whose version is the first batch that recorded positions:
    every batch from it on did, so a partition none recorded was never read since."""
    return f"{app_id}:positions-since"


def positions(
    app_id: str, ends: dict[Partition, int], since: int | None = None
) -> list[Transaction]:
    """The app transactions recording where a batch leaves each partition (`planned`),
    and `since` (`since_app_id`) if given."""
    found = [Transaction(offset_app_id(app_id, p), o) for p, o in sorted(ends.items())]
    return found if since is None else [*found, Transaction(since_app_id(app_id), since)]


def planned(checkpoint: str, batch_id: int) -> dict[Partition, int]:
    """Where Spark planned batch `batch_id` of the query to end in each Kafka partition
    of its topics: the entry of the checkpoint's offsets log it writes before it runs
    the batch, and reads again to replay it. The batch's own range, which the offsets
    of its records cannot give: gaps no record fills (transaction markers, aborted
    records, a compacted topic's removed records) can end it, and a replay reads the
    log as it is then."""
    offsets = offsets_log.entry(*offsets_log.folder(checkpoint), batch_id)
    return {(topic, int(p)): end for topic, parts in offsets.items() for p, end in parts.items()}


def version(path: str, app_id: str) -> int:
    """The last version `app_id` committed to the table (-1: none, or no table)."""
    if not DeltaTable.is_deltatable(path):
        return -1
    found = DeltaTable(path).transaction_version(app_id)
    return -1 if found is None else found


def resume(
    checkpoint: str,
    buffer_path: str,
    quarantine_path: str,
    app_id: str,
    kafka: KafkaConfig,
    topics: list[str],
) -> Resume:
    """Where the query starts: on a checkpoint with batches, where Spark says, its base
    as kept; on a new one, where the buffer's last batch left Kafka (Kafka's start only
    for tables with no batch, or partitions none recorded since `since_app_id`).

    Raises CannotResume when the tables hold batches of `app_id` but not where they
    left some partition (their commits carry no positions), when the last batch is in
    the quarantine only (cut between its commits), or when Kafka does not list every
    partition of the topics in time: reading from Kafka's start would ingest its records
    again, and reading past them would lose some."""
    fs, root = offsets_log.folder(checkpoint)
    if offsets_log.batches(fs, root):  # Spark planned a batch: it reads on from its offsets
        return Resume(_read_base(fs, root))
    buffered, quarantined = version(buffer_path, app_id), version(quarantine_path, app_id)
    if max(buffered, quarantined) < 0:
        _write_base(fs, root, 0)
        return Resume()
    restore = (
        f"Put back the checkpoint {checkpoint} as the stopped ingest left it, and start the "
        "ingest again (an older copy plans batches the buffer has, from other Kafka "
        "positions, and is refused): starting over would ingest again every record Kafka "
        "still holds"
    )
    if quarantined > buffered:
        raise CannotResume(
            f"the ingest's checkpoint is new, and its last batch ({app_id} version "
            f"{quarantined}) is in {quarantine_path} but not in {buffer_path}: a batch cut "
            f"between its two commits, which only its checkpoint can finish. {restore}"
        )
    partitions = _listed(kafka, topics, buffer_path, app_id)
    table = DeltaTable(buffer_path)
    recorded = {
        p: offset
        for p in partitions
        if (offset := table.transaction_version(offset_app_id(app_id, p))) is not None
    }
    since = table.transaction_version(since_app_id(app_id))
    unknown = [f"{t}/{p}" for t, p in partitions if (t, p) not in recorded]
    if since is None or (since > 0 and unknown):
        # Batches before `since` carry no positions: a partition none recorded since
        # may have been read by them.
        raise CannotResume(
            f"the ingest's checkpoint is new, and {buffer_path} holds batches of {app_id} "
            f"(up to version {buffered}) whose commits do not say where they left Kafka "
            f"partitions {', '.join(unknown)}. {restore}"
        )
    base = buffered + 1
    _write_base(fs, root, base)
    log.warning(
        "ingest %s: the checkpoint %s is new; the buffer has batches up to version %d: "
        "reading Kafka from where they left it (%s), new batches committed from version %d",
        app_id,
        checkpoint,
        buffered,
        ", ".join(f"{t}/{p}@{o}" for (t, p), o in sorted(recorded.items())),
        base,
    )
    return Resume(base, _starting_offsets(partitions, recorded))


def _starting_offsets(partitions: list[Partition], recorded: dict[Partition, int]) -> str:
    """Both Kafka connectors want every partition of the topics: those not recorded
    (added since) from their start."""
    offsets: dict[str, dict[str, int]] = {}
    for topic, number in partitions:
        offsets.setdefault(topic, {})[str(number)] = recorded.get((topic, number), EARLIEST)
    return json.dumps(offsets)


def _listed(
    kafka: KafkaConfig, topics: list[str], buffer_path: str, app_id: str
) -> list[Partition]:
    """Every partition of `topics`, once Kafka lists them all, waiting PARTITIONS_WAIT_S
    at most. A topic listed with no partitions (an election, metadata not loaded yet, no
    Describe permission), or with a gap among them, would read from its start what the
    buffer has: CannotResume instead. The job starts once every topic exists, so none
    is missing for good."""
    deadline = time.monotonic() + PARTITIONS_WAIT_S
    while True:
        found = _partitions(kafka, topics)
        numbers = {t: sorted(p for topic, p in found if topic == t) for t in topics}
        short = [t for t, ns in numbers.items() if not ns or ns != list(range(len(ns)))]
        if not short:
            return found
        if time.monotonic() >= deadline:
            raise CannotResume(
                f"the ingest's checkpoint is new, and {buffer_path} holds batches of {app_id}, "
                f"but Kafka did not list every partition of {', '.join(short)} within "
                f"{PARTITIONS_WAIT_S:g} s (a leader election, metadata not loaded yet, or no "
                "Describe permission on the topic): reading them from their start would "
                "ingest again what the buffer has. Start the ingest again once Kafka lists them"
            )
        log.info("ingest %s: Kafka lists no partitions of %s yet; asking again", app_id, short)
        time.sleep(1.0)


def _partitions(kafka: KafkaConfig, topics: list[str]) -> list[Partition]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(**python_config(kafka))
    try:
        return sorted(
            (topic, number)
            for topic in topics
            for number in consumer.partitions_for_topic(topic) or []
        )
    finally:
        consumer.close()


def _read_base(fs: pafs.FileSystem, root: str) -> int:
    """A checkpoint without a base file numbers from 0, as the tables do."""
    info = fs.get_file_info(f"{root}/{BASE_FILE}")
    if info.type != pafs.FileType.File:
        return 0
    with fs.open_input_stream(f"{root}/{BASE_FILE}") as f:
        return int(f.read().decode())


def _write_base(fs: pafs.FileSystem, root: str, base: int) -> None:
    """Kept before Spark plans a batch, so a restart on this checkpoint finds it."""
    if has_folders(fs):
        fs.create_dir(root, recursive=True)
    with fs.open_output_stream(f"{root}/{BASE_FILE}") as f:
        f.write(str(base).encode())
