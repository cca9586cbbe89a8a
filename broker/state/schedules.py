"""A cron topic's schedules in the Delta table `schedules/<topic>`, one row each.

The leader writes it (HTTP creates and deletes are forwarded there, and it alone
materialises); any node reads it. A deletion deletes the row with delta-rs rather than
appending a tombstone: the table then holds the live schedules only, and grows with them,
not with every schedule ever made. Progress (`materialised_until`) is updated in place
for the schedule row it was computed from (same id and creation time), so a progress
update racing a deletion, or a deletion and re-creation under the same id, changes
nothing it should not.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from dejaq.conf.table_features import refused_commit
from dejaq.conf.tables import SCHEDULES_SCHEMA, TIMESTAMP, Table, ensure_table, scan
from dejaq.pipelines.compaction import maintain

COMMIT_TRIES = 5  # a deposed leader's late write can conflict once or twice, not more
MAINTAIN_EVERY = 100  # progress commits between compactions (each rewrites the row's file)
T = TypeVar("T")


@dataclass(frozen=True)
class Schedule:
    schedule_id: str
    cron: str
    time_zone: str
    key: bytes | None
    payload: bytes
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    end_at: int | None = None  # epoch ms; nothing after it
    created_at: int = 0  # epoch ms; occurrences strictly after it
    materialised_until: int = 0  # epoch ms; every occurrence up to it has been sent

    def definition(self) -> tuple:
        """What the client chose: two creates with equal definitions are one schedule."""
        return (self.cron, self.time_zone, self.key, self.payload, self.headers, self.end_at)


def _ts(ms: int | None) -> dt.datetime | None:
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


def _ms(at: dt.datetime | None) -> int | None:
    return None if at is None else int(at.timestamp() * 1000)


def _to_arrow(schedules: list[Schedule]) -> pa.Table:
    rows = []
    for s in schedules:
        row = asdict(s)
        row["headers"] = [{"key": k, "value": v} for k, v in s.headers]
        for name in ("end_at", "created_at", "materialised_until"):
            row[name] = _ts(row[name])
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=SCHEDULES_SCHEMA)


def _from_row(row: dict) -> Schedule:
    return Schedule(
        schedule_id=row["schedule_id"],
        cron=row["cron"],
        time_zone=row["time_zone"],
        key=row["key"],
        payload=row["payload"],
        headers=[(h["key"], h["value"]) for h in row["headers"] or []],
        end_at=_ms(row["end_at"]),
        created_at=_ms(row["created_at"]) or 0,
        materialised_until=_ms(row["materialised_until"]) or 0,
    )


# A MERGE's match of a source row (`_rows`) to the schedule row it was made from: one
# deleted and created again under its id since is another row.
_SAME_ROW = "t.schedule_id = s.schedule_id AND t.created_at = s.created_at"


def _rows(keys: Iterable[tuple[str, int]]) -> pa.Table:
    """(schedule id, created at) pairs as a MERGE's source."""
    ids, created = zip(*keys, strict=True)
    return pa.table(
        {
            "schedule_id": pa.array(ids, pa.string()),
            "created_at": pa.array([_ts(c) for c in created], TIMESTAMP),
        }
    )


def _retrying(path: str, commit: Callable[[], T]) -> T:
    """Run a delta-rs commit to the table at `path` again when a concurrent one beat it
    (not when delta-rs refused the table's features: `refused_commit`)."""
    for _ in range(COMMIT_TRIES - 1):
        try:
            return commit()
        except CommitFailedError as e:
            refused_commit(path, e)
    return commit()


class ScheduleStore:
    """One cron topic's schedules: read from the latest table version, written under a
    lock (one writer per node; the leader is the only writing node)."""

    def __init__(self, warehouse: str, topic: str) -> None:
        self.path = ensure_table(warehouse, Table.SCHEDULES, topic)
        self._lock = threading.Lock()
        # (table version, its schedules by id), replaced whole: threads reading at once
        # (the materialiser's, the HTTP routes') may leave either's, never one version's
        # rows under another's number, stale until the next write.
        self._cache: tuple[int, dict[str, Schedule]] = (-1, {})
        self._progress_commits = 0

    def all(self) -> dict[str, Schedule]:
        """Every schedule by id, as of the table's latest version."""
        table = DeltaTable(self.path)
        version = table.version()
        cached, schedules = self._cache
        if cached != version:
            rows = scan(table, Table.SCHEDULES).to_pylist()
            schedules = {r["schedule_id"]: _from_row(r) for r in rows}
            self._cache = (version, schedules)
        return dict(schedules)

    def get(self, schedule_id: str) -> Schedule | None:
        return self.all().get(schedule_id)

    def add(self, schedule: Schedule) -> tuple[Schedule, bool]:
        """Store `schedule` unless its id exists: (the stored one, whether it is new).

        A MERGE inserting only where no row has the id, not an append: a deposed leader
        that still takes itself for one, creating the same id at once, conflicts with
        it (two appends would not), and the one that commits second finds the first's
        row. Two rows of one id would leave either definition to win a read."""
        source = _to_arrow([schedule])

        def commit() -> dict:
            return (
                DeltaTable(self.path)
                .merge(source, "t.schedule_id = s.schedule_id", "s", "t")
                .when_not_matched_insert_all()
                .execute()
            )

        with self._lock:
            for _ in range(COMMIT_TRIES):
                existing = self.get(schedule.schedule_id)
                if existing is not None:
                    return existing, False
                if _retrying(self.path, commit)["num_target_rows_inserted"]:
                    return schedule, True
        raise CommitFailedError(f"schedule {schedule.schedule_id!r} created and deleted meanwhile")

    def delete(self, schedule_id: str) -> bool:
        """Delete the schedule; False if there was none."""
        source = pa.table({"schedule_id": [schedule_id]})

        def commit() -> dict:
            return (
                DeltaTable(self.path)
                .merge(source, "t.schedule_id = s.schedule_id", "s", "t")
                .when_matched_delete()
                .execute()
            )

        with self._lock:
            return _retrying(self.path, commit)["num_target_rows_deleted"] > 0

    def remove_ended(self, ended: list[tuple[str, int]]) -> int:
        """Delete the schedules (id, created at) past their end with every occurrence
        sent: the table, and each round's work, follow the live schedules, not every one
        ever made. One re-created under the same id since is a new row, left alone."""
        if not ended:
            return 0
        source = _rows(ended)

        def commit() -> dict:
            return (
                DeltaTable(self.path)
                .merge(source, _SAME_ROW, "s", "t")
                .when_matched_delete()
                .execute()
            )

        with self._lock:
            return _retrying(self.path, commit)["num_target_rows_deleted"]

    def advance(self, progress: dict[tuple[str, int], int]) -> None:
        """Record (schedule id, created at) → materialised until; never moves one back."""
        if not progress:
            return
        until = pa.array([_ts(u) for u in progress.values()], TIMESTAMP)
        source = _rows(progress).append_column("until", until)

        def commit() -> dict:
            return (
                DeltaTable(self.path)
                .merge(source, _SAME_ROW, "s", "t")
                .when_matched_update(
                    {"materialised_until": "s.until"}, "s.until > t.materialised_until"
                )
                .execute()
            )

        with self._lock:
            _retrying(self.path, commit)
            self._progress_commits += 1
            if self._progress_commits % MAINTAIN_EVERY == 0:
                maintain(self.path)
