"""The log tables' compaction and sealing: their files become fewer, in time order, with
the same rows, in commits that add no row and of which two from one snapshot never both
land; recent files are left to the tails read from them."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_retention import now_ms

from dejaq.broker.storage.ledger_writer import compact_ledger
from dejaq.conf.tables import (
    DEAD_LETTER_SCHEMA,
    LEDGER_SCHEMA,
    TIMESTAMP,
    Table,
    ensure_table,
    iso_ms,
    scan,
    table_path,
)
from dejaq.pipelines import compaction, log_compaction
from dejaq.pipelines.delta_follower import DeltaFollower
from dejaq.pipelines.log_compaction import (
    COMPACTED,
    SEAL_MIN_FILES,
    SEALED,
    compact_log,
    maintain_log,
    seal,
)
from dejaq.pipelines.retention import commits, ledger_tail

HOUR = 3600 * 1000
NOW = 1_796_000_000_000


def events(first: int, n: int, at_ms: int, step_ms: int = 1000) -> pa.Table:
    """`n` acked events of ids m<first>.., the first at `at_ms`, `step_ms` apart."""
    ids = range(first, first + n)
    return pa.table(
        {
            "message_id": [f"m{i}" for i in ids],
            "bucket": pa.array([i % 4 for i in ids], pa.int32()),
            "event": ["acked"] * n,
            "sort_key": pa.array(list(ids), pa.int64()),
            "deliveries": pa.array([1] * n, pa.int32()),
            "at": pa.array([(at_ms + k * step_ms) * 1000 for k in range(n)]).cast(TIMESTAMP),
        },
        schema=LEDGER_SCHEMA,
    )


def ledger_of(path: str, starts_ms: list[int], per_file: int = 50) -> None:
    """A file of `per_file` events for each of `starts_ms`, one append each."""
    for k, at in enumerate(starts_ms):
        write_deltalake(path, events(k * per_file, per_file, at), mode="append")


def rows(path: str, table: Table = Table.LEDGER) -> list[dict]:
    return sorted(scan(path, table).to_pylist(), key=lambda r: r["message_id"])


def last_commit(path: str) -> list[dict]:
    version = DeltaTable(path).version()
    entry = Path(path, "_delta_log", f"{version:020d}.json").read_text()
    return [json.loads(line) for line in entry.splitlines()]


def test_old_files_become_one_with_the_same_rows_in_a_commit_that_changes_no_data(
    warehouse: str,
) -> None:
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    old = [NOW - 72 * HOUR + k * HOUR for k in range(20)]
    recent = [NOW - 2 * HOUR + k * 60_000 for k in range(10)]
    ledger_of(path, old + recent)
    before = rows(path)
    assert len(DeltaTable(path).file_uris()) == 30

    done = seal(path, "at", NOW - 25 * HOUR)

    assert done is not None and done.files_removed == 20 and done.rows == 20 * 50
    assert rows(path) == before, "the same rows, none lost, none twice"
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True))
    assert adds.num_rows == 11, "the 20 old files are one; the 10 recent ones stay"
    actions = last_commit(path)
    info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    assert info[SEALED] == "20"
    changes = [a.get("add") or a.get("remove") for a in actions if "add" in a or "remove" in a]
    assert len(changes) == 21 and not any(c["dataChange"] for c in changes)
    sealed = next(a["add"] for a in actions if "add" in a)
    stats = json.loads(sealed["stats"])
    assert stats["numRecords"] == 1000 and stats["nullCount"]["at"] == 0
    assert stats["minValues"]["at"] == iso_ms(old[0])
    assert stats["maxValues"]["sort_key"] == 999
    version = DeltaTable(path).version()
    assert commits(path, range(version, version + 1))[0].rewrite, "followers skip it"
    # A tail read by the file statistics finds the same rows as before.
    since, until = old[3], old[7]
    tail = ledger_tail(path, since, ["message_id"], until_ms=until).column(0).to_pylist()
    assert sorted(tail) == sorted(
        r["message_id"] for r in before if since * 1000 <= _us(r["at"]) < until * 1000
    )
    assert len(tail) == 4 * 50
    assert seal(path, "at", NOW - 25 * HOUR) is None, "nothing is left to seal"


def _us(at: object) -> int:
    return int(at.timestamp() * 1_000_000)  # type: ignore[attr-defined]


def test_a_seal_waits_for_enough_files_and_leaves_the_recent_ones(warehouse: str) -> None:
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [NOW - 48 * HOUR + k * HOUR for k in range(SEAL_MIN_FILES - 1)])
    ledger_of(path, [NOW - 3 * HOUR + k * 60_000 for k in range(5)])
    version = DeltaTable(path).version()

    assert seal(path, "at", NOW - 25 * HOUR) is None
    assert DeltaTable(path).version() == version, "no commit"


def test_a_seal_stops_at_its_file_size(warehouse: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [NOW - 72 * HOUR + k * HOUR for k in range(24)])
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True)).sort_by("min.at")
    sizes = adds.column("size_bytes").to_pylist()
    cap = 10 * max(sizes)  # room for ten files' bytes a seal
    monkeypatch.setattr(log_compaction, "SEALED_FILE_BYTES", cap)
    fit = max(k for k in range(len(sizes) + 1) if sum(sizes[:k]) <= cap)
    before = rows(path)

    done = seal(path, "at", NOW)

    assert done is not None and done.files_removed == fit >= SEAL_MIN_FILES
    assert rows(path) == before
    after = pa.table(DeltaTable(path).get_add_actions(flatten=True)).sort_by("min.at")
    assert after.num_rows == 24 - fit + 1
    oldest = after.slice(0, 1).to_pylist()[0]
    assert oldest["num_records"] == done.rows == fit * 50, "the oldest files went first"
    assert after.column("path").to_pylist()[1:] == adds.column("path").to_pylist()[fit:]


def test_a_ledger_partitioned_by_bucket_seals_within_a_bucket(warehouse: str) -> None:
    """A ledger created partitioned stays so; a seal keeps each file in its partition."""
    path = table_path(warehouse, Table.LEDGER, "old")
    for k in range(12):
        write_deltalake(
            path,
            events(k * 40, 40, NOW - 60 * HOUR + k * HOUR),
            mode="append",
            partition_by="bucket",
        )
    before = rows(path)
    assert len(DeltaTable(path).file_uris()) == 48

    done = seal(path, "at", NOW - 25 * HOUR)

    assert done is not None and done.files_removed == 12
    assert rows(path) == before
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True))
    assert adds.num_rows == 37
    sealed = [a for a in adds.to_pylist() if a["num_records"] == 12 * 10]
    assert len(sealed) == 1 and sealed[0]["path"].startswith("bucket=")


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ages_h=st.lists(st.integers(min_value=0, max_value=200), min_size=1, max_size=24),
    per_file=st.integers(min_value=1, max_value=30),
)
def test_seals_keep_every_row_and_leave_no_due_file_behind(
    tmp_path_factory: pytest.TempPathFactory, ages_h: list[int], per_file: int
) -> None:
    """Whatever the files' ages and order, seals to the end lose and repeat no row, and
    only files too recent or too few stay apart."""
    warehouse = str(tmp_path_factory.mktemp("warehouse"))
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [NOW - h * HOUR for h in ages_h], per_file)
    before = rows(path)
    cutoff = NOW - 25 * HOUR

    while seal(path, "at", cutoff) is not None:
        pass

    assert rows(path) == before
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True))
    due = [a for a in adds.to_pylist() if a["max.at"].timestamp() * 1000 < cutoff]
    sealed_files = [a for a in due if a["path"].endswith(".sealed.snappy.parquet")]
    assert len(due) - len(sealed_files) < SEAL_MIN_FILES
    assert len(sealed_files) <= 1


def test_the_leader_seals_its_ledger_as_it_compacts_and_a_follower_reads_no_row_again(
    warehouse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each file as large as compaction makes them, so compaction leaves them be.
    monkeypatch.setattr(log_compaction, "LOG_FILE_BYTES", 1)
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    follower = DeltaFollower(path, LEDGER_SCHEMA, time_column="at")
    now = now_ms()
    ledger_of(path, [now - 50 * HOUR + k * HOUR for k in range(10)])
    first = follower.poll()
    assert first.num_rows == 500

    compact_ledger(warehouse, "jobs", HOUR)

    actions = last_commit(path)
    assert any(SEALED in a.get("commitInfo", {}) for a in actions)
    assert len(DeltaTable(path).file_uris()) == 1
    write_deltalake(path, events(10_000, 3, now), mode="append")
    assert follower.poll().column("message_id").to_pylist() == ["m10000", "m10001", "m10002"]


def test_spark_reads_a_sealed_ledger_whole(warehouse: str, spark: object) -> None:
    """Delta Spark accepts the seal's hand-made actions and statistics."""
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [NOW - 72 * HOUR + k * HOUR for k in range(10)])
    assert seal(path, "at", NOW - 25 * HOUR) is not None

    frame = spark.read.format("delta").load(path)  # type: ignore[attr-defined]
    assert frame.count() == 500
    assert frame.where("sort_key >= 450").count() == 50
    assert frame.where("at < timestamp'2020-01-01'").count() == 0


def test_dead_letters_seal_by_their_time_of_death_with_their_payloads(warehouse: str) -> None:
    path = ensure_table(warehouse, Table.DEAD_LETTER, "jobs")
    for k in range(SEAL_MIN_FILES):
        died = dt.datetime.fromtimestamp((NOW - (40 - k) * HOUR) / 1000, dt.UTC)
        row = {
            "message_id": f"m{k}",
            "bucket": k % 4,
            "sort_key": k,
            "payload": bytes([k]) * 100,
            "headers": [{"key": "trace", "value": b"t%d" % k}] if k % 2 else None,
            "source_topic": "in",
            "source_partition": 0,
            "source_offset": k,
            "deliveries": 5,
            "reason": "max deliveries",
            "dead_at": died,
        }
        write_deltalake(path, pa.Table.from_pylist([row], schema=DEAD_LETTER_SCHEMA), mode="append")
    before = rows(path, Table.DEAD_LETTER)

    done = seal(path, "dead_at", NOW - 25 * HOUR)

    assert done is not None and done.files_removed == SEAL_MIN_FILES
    assert rows(path, Table.DEAD_LETTER) == before, "payloads and headers as they were"
    stats = json.loads(next(a["add"] for a in last_commit(path) if "add" in a)["stats"])
    assert stats["minValues"]["dead_at"] == iso_ms(NOW - 40 * HOUR)
    assert stats["nullCount"]["deliver_at"] == SEAL_MIN_FILES
    assert "payload" not in stats["minValues"] and "headers" not in stats["nullCount"]


def rewrite(how: str, path: str) -> int:
    """Files replaced by a seal, or by the compaction tier's rewrites."""
    if how == "seal":
        done = seal(path, "at", NOW)
        return 0 if done is None else done.files_removed
    return sum(r.files_removed for r in compact_log(path, "at"))


@pytest.mark.parametrize(
    ("first", "second"), [("seal", "seal"), ("compaction", "seal"), ("seal", "compaction")]
)
def test_of_two_rewrites_from_one_snapshot_the_second_is_refused(
    warehouse: str, monkeypatch: pytest.MonkeyPatch, first: str, second: str
) -> None:
    """A deposed leader's round beside its successor's: the rewrite that commits second,
    from the snapshot both read, would add the rows of files already replaced. It is
    refused, and its file deleted."""
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [NOW - 72 * HOUR + k * HOUR for k in range(10)])
    before = rows(path)
    stale = DeltaTable(path)
    assert rewrite(first, path) == 10
    written = set(Path(path).glob("*.parquet"))
    monkeypatch.setattr(log_compaction, "DeltaTable", lambda _path: stale)

    with pytest.raises(CommitFailedError, match="Concurrent transaction"):
        rewrite(second, path)

    assert rows(path) == before, "no row twice"
    assert set(Path(path).glob("*.parquet")) == written, "the refused rewrite's file is gone"


def test_the_compaction_tier_merges_small_files_in_time_order_and_leaves_big_ones(
    warehouse: str,
) -> None:
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    # Appended out of time order: the rewrite orders files by their earliest event.
    ledger_of(path, [NOW - k * 60_000 for k in range(12)])
    before = rows(path)

    done = compact_log(path, "at")

    assert [r.files_removed for r in done] == [12]
    assert rows(path) == before
    info = next(a["commitInfo"] for a in last_commit(path) if "commitInfo" in a)
    assert info[COMPACTED] == "12"
    table = DeltaTable(path)
    ats = scan(table, Table.LEDGER, ["at"]).column("at").to_pylist()
    starts = [ats[k * 50] for k in range(12)]
    assert starts == sorted(starts), "the files' rows follow each other in time"
    version = table.version()
    assert commits(path, range(version, version + 1))[0].rewrite
    assert compact_log(path, "at") == [], "one file: nothing to merge it with"


@given(
    sizes=st.lists(st.integers(min_value=1, max_value=49), max_size=30),
    min_files=st.integers(min_value=1, max_value=8),
)
def test_a_run_is_the_earliest_that_fits_enough_files(sizes: list[int], min_files: int) -> None:
    """Against every start tried in turn: no due file is passed over for good because
    the files after it are big."""
    tier = log_compaction._Tier(SEALED, 100, min_files)

    def greedy(start: int) -> int:
        end, total = start, 0
        while end < len(sizes) and (end == start or total + sizes[end] <= 100):
            total += sizes[end]
            end += 1
        return end

    starts = [s for s in range(len(sizes)) if greedy(s) - s >= min_files]
    expected = slice(starts[0], greedy(starts[0])) if starts else None
    assert log_compaction._first_run(sizes, tier) == expected


def test_a_partition_with_too_few_files_due_does_not_hold_back_the_others(
    warehouse: str,
) -> None:
    path = table_path(warehouse, Table.LEDGER, "old")
    # Bucket 0 has the oldest file but too few; bucket 1 has enough.
    for k in range(3):
        rows0 = events(k * 10, 10, NOW - 90 * HOUR + k * HOUR).set_column(
            1, "bucket", pa.array([0] * 10, pa.int32())
        )
        write_deltalake(path, rows0, mode="append", partition_by="bucket")
    for k in range(SEAL_MIN_FILES):
        rows1 = events(100 + k * 10, 10, NOW - 80 * HOUR + k * HOUR).set_column(
            1, "bucket", pa.array([1] * 10, pa.int32())
        )
        write_deltalake(path, rows1, mode="append", partition_by="bucket")
    before = rows(path)

    done = seal(path, "at", NOW - 25 * HOUR)

    assert done is not None and done.files_removed == SEAL_MIN_FILES
    assert rows(path) == before
    assert seal(path, "at", NOW - 25 * HOUR) is None


def test_a_round_seals_once_so_the_writers_next_append_waits_one_seal_at_most(
    warehouse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(log_compaction, "LOG_FILE_BYTES", 1)  # no compaction
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [now_ms() - 72 * HOUR + k * HOUR for k in range(3 * SEAL_MIN_FILES)])
    sizes = pa.table(DeltaTable(path).get_add_actions(flatten=True)).column("size_bytes")
    monkeypatch.setattr(
        log_compaction, "SEALED_FILE_BYTES", SEAL_MIN_FILES * max(sizes.to_pylist())
    )

    done = maintain_log(path, "at", HOUR)

    assert done is not None and done.files_added == 1
    seals = [c for c in DeltaTable(path).history() if SEALED in c]
    assert len(seals) == 1, "three seals were due; one a round"


def test_a_rewrite_whose_commit_landed_keeps_its_file_whatever_fails_after(
    warehouse: str,
) -> None:
    """The Delta checkpoint after each tenth commit is written inside the commit's call:
    if it fails, the commit has landed and its file is the table's (deleting it would
    leave the rows of the files it replaced nowhere)."""
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [NOW - 72 * HOUR + k * HOUR for k in range(18)])
    version = DeltaTable(path).version()
    assert (version + 2) % 10 == 0, "the seal's commit is the tenth's, a checkpoint follows"
    before = rows(path)
    # A real failure of the store where the checkpoint goes: a folder in its place.
    Path(path, "_delta_log", f"{version + 1:020d}.checkpoint.parquet", "x").mkdir(parents=True)

    with pytest.raises(Exception):  # noqa: B017 (whatever delta-rs raises for it)
        seal(path, "at", NOW)

    assert DeltaTable(path).version() == version + 1, "the commit landed"
    assert rows(path) == before, "every row still read, none twice"


def test_a_file_whose_rewrite_died_before_its_commit_is_vacuumed_past_retention(
    warehouse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a listing of the whole table finds a file no commit named: the process's
    first vacuum of the table lists it, then one a day; a file younger than the table's
    file retention may be a rewrite about to commit, and stays."""
    monkeypatch.setattr(compaction, "_listed", {})
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    ledger_of(path, [NOW - 72 * HOUR + k * HOUR for k in range(SEAL_MIN_FILES)])
    before = rows(path)

    def dies(*args: object, **kwargs: object) -> None:
        raise SystemExit("the process died before its commit")  # a crash, in-process

    with monkeypatch.context() as m:
        m.setattr(DeltaTable, "create_write_transaction", dies)
        with pytest.raises(SystemExit):
            seal(path, "at", NOW)
    stray = [p for p in Path(path).glob("*.sealed.snappy.parquet")]
    assert len(stray) == 1 and rows(path) == before, "written, never committed"
    old = (now_ms() - 3 * HOUR) / 1000  # past the table's two hours of file retention
    os.utime(stray[0], (old, old))
    young = stray[0].with_name("part-00000-young-c000.sealed.snappy.parquet")
    young.write_bytes(stray[0].read_bytes())

    maintain_log(path, "at", 10 * 24 * HOUR)  # the process's first round lists the table

    assert not stray[0].exists() and young.exists()
    assert rows(path) == before
    os.utime(young, (old, old))
    maintain_log(path, "at", 10 * 24 * HOUR)
    assert young.exists(), "listed once a day, not every round"
    monkeypatch.setattr(compaction, "FULL_VACUUM_EVERY_S", 0)
    maintain_log(path, "at", 10 * 24 * HOUR)
    assert not young.exists() and rows(path) == before
