"""Small-file compaction of the tables the ingest appends to (the buffer, the
quarantine), with delta-rs; the log tables (ledger, dead letters) have their own
(`pipelines.log_compaction`), and share the maintenance round here.

No Spark here: the broker compacts with it too.

Every micro-batch adds a file per bucket it touches, so a steady stream leaves
thousands of small files an hour, and each reader pays per file: the broker's index at
start and on every refresh, the release job, the dedup seed read. Compaction rewrites
them into a few per bucket in a commit that changes no data (`dataChange=false`), whose
files the readers that follow a table (the broker's index, the release job's follower)
do not read: every row in them was read before (`pipelines.retention.commits`).
Vacuum then deletes the replaced files once they are older than the table's file
retention (two hours, `conf.tables.TABLE_PROPERTIES`), so a reader still on an older
version keeps its files. Those are the files the log names since its last checkpoint;
a file no commit ever named (a writer that died between writing it and committing, a
Spark task retried) is found only by listing the whole table, which a process does at
its first vacuum of a table and then every `FULL_VACUUM_EVERY_S`: such files are
deleted once past the same retention, as a writer still about to commit one is younger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from deltalake import DeltaTable

from dejaq.conf.table_features import has_deletion_vectors
from dejaq.conf.tables import with_table_properties

log = logging.getLogger("dejaq.compaction")

FULL_VACUUM_EVERY_S = 24 * 3600
# Table path -> when this process last listed it whole (`time.monotonic`).
_listed: dict[str, float] = {}
_listed_lock = threading.Lock()


@dataclass(frozen=True)
class Compacted:
    files_removed: int
    files_added: int
    files_vacuumed: int


def compact(path: str, target_size: int | None = None) -> Compacted:
    """Compact the table at `path` into files of about `target_size` bytes (delta-rs's
    default if None), then vacuum what is past retention.

    Run by the table's only appender between its own appends: delta-rs compaction
    fails if any other operation than an append commits meanwhile.
    """
    table = DeltaTable(path)
    metrics = table.optimize.compact(target_size=target_size)
    vacuumed = table.vacuum(dry_run=False, full=_lists_whole(table, path))
    return Compacted(metrics["numFilesRemoved"], metrics["numFilesAdded"], len(vacuumed))


def maintain(path: str, target_size: int | None = None) -> Compacted | None:
    """`compact` as maintenance, not data: a failure is logged, not raised (the caller's
    next round tries again), and the caller's own appends go on."""
    return maintained(path, lambda: compact(path, target_size))


def maintained(path: str, rewrite: Callable[[], Compacted]) -> Compacted | None:
    """`rewrite` of the table at `path` as maintenance (`maintain`). A table made before
    `TABLE_PROPERTIES` gets them first, by the writer that compacts it."""
    try:
        with_table_properties(path)
    except Exception:
        log.warning(
            "setting %s's properties failed; the next round tries again", path, exc_info=True
        )
    try:
        done = rewrite()
    except Exception:
        log.warning("compacting %s failed; the next round tries again", path, exc_info=True)
        return None
    if done.files_removed:
        log.info(
            "compacted %s: %d files into %d, %d old files vacuumed",
            path,
            done.files_removed,
            done.files_added,
            done.files_vacuumed,
        )
    return done


def vacuum(path: str) -> int:
    """Delete the files replaced more than the table's file retention ago, and now and
    then those no commit named (`_lists_whole`); how many.

    Maintenance: a failure is logged, not raised."""
    try:
        table = DeltaTable(path)
        return len(table.vacuum(dry_run=False, full=_lists_whole(table, path)))
    except Exception:
        log.warning("vacuuming %s failed; the next round tries again", path, exc_info=True)
        return 0


def _lists_whole(table: DeltaTable, path: str) -> bool:
    """Whether this vacuum of `table` (at `path`) lists the whole table: the process's
    first, then one each `FULL_VACUUM_EVERY_S`. A listing's cost follows the table's
    files, so it is not paid every round; a failed one is not tried again before the
    next is due. Never on a table with deletion vectors (refused at a start, but one
    can be altered meanwhile): a full vacuum knows no deletion vector file from an
    orphan, and would delete those past the retention that the table still reads."""
    if has_deletion_vectors(table):
        return False
    now = time.monotonic()
    with _listed_lock:
        last = _listed.get(path)
        if last is not None and now - last < FULL_VACUUM_EVERY_S:
            return False
        _listed[path] = now
        return True
