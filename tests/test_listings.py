"""Dead letters and quarantine, listed a page at a time from real Delta tables, through
the module and `dejaq dead` / `dejaq quarantine`."""

from __future__ import annotations

import base64
import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import buffer_names
from deltalake import DeltaTable, write_deltalake
from test_broker import listed, loaded_topic

from dejaq.broker.storage import listings
from dejaq.broker.storage.checkpoints import Health, checkpoint
from dejaq.broker.storage.listings import BadCursor, page
from dejaq.conf.tables import QUARANTINE_SCHEMA, Table, ensure_table, scan
from dejaq.pipelines.retention import expire_quarantine

DEJAQ = [sys.executable, "-m", "dejaq.jobs.cli"]
HOUR_MS = 3_600_000


def quarantine_rows(n: int) -> pa.Table:
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return pa.Table.from_pylist(
        [
            {
                "key": b"k",
                "value": f"bad-{i}".encode(),
                "headers": [{"key": "dejaq-priority", "value": b"high"}],
                "source_topic": "in",
                "source_partition": 0,
                "source_offset": i,
                "produced_at": at,
                "reason": "invalid_priority",
                "detail": "high",
                "quarantined_at": at + dt.timedelta(seconds=i // 2),  # ties, broken by offset
            }
            for i in range(n)
        ],
        schema=QUARANTINE_SCHEMA,
    )


def test_dead_letters_come_in_order_of_death_a_page_at_a_time(tmp_path: Path) -> None:
    warehouse, index, state = loaded_topic(tmp_path, [5, 4, 3, 2, 1])
    state.lease("c", 0, 1000, listed(index.pick(state, state.buckets_of("c"), 5, now=0)))
    for at, mid in enumerate(["m3", "m0", "m4", "m1", "m2"], start=1):
        assert state.reject("c", at, [mid]) == {}
    checkpoint(warehouse, "jobs", list(state.events), buffer_names(warehouse), Health())
    path = ensure_table(warehouse, Table.DEAD_LETTER, "jobs")
    seen, after = [], None
    while True:
        got = page(path, Table.DEAD_LETTER, 2, after)
        assert len(got.rows) <= 2
        seen += got.rows
        if got.next is None:
            break
        after = got.next
    assert [r["message_id"] for r in seen] == ["m3", "m0", "m4", "m1", "m2"]
    assert [r["dead_at"] for r in seen] == [1, 2, 3, 4, 5]
    assert base64.b64decode(seen[0]["payload"]) == b"payload-m3"
    assert seen[0]["reason"] == "rejected"
    with pytest.raises(BadCursor):
        page(path, Table.DEAD_LETTER, 2, "garbage")


@pytest.mark.parametrize(
    ("values", "why"),
    [
        (["x" * 3000, "m0"], "time"),  # a string a million times over, were it multiplied
        ([None, "m0"], "time"),
        ([1e300, "m0"], "time"),
        ([True, "m0"], "time"),
        ([-1, "m0"], "time"),
        ([1.5, 7], "message_id"),
    ],
)
def test_a_made_up_cursor_is_refused_before_it_is_used(
    tmp_path: Path, values: list, why: str
) -> None:
    """A cursor is the caller's to make up: each value is checked for its column's type,
    and the time for a range, before anything is built from it."""
    path = ensure_table(str(tmp_path / "wh"), Table.DEAD_LETTER, "jobs")
    cursor = base64.urlsafe_b64encode(json.dumps(values).encode()).decode()
    with pytest.raises(BadCursor, match=why):
        page(path, Table.DEAD_LETTER, 2, cursor)
    quarantine = ensure_table(str(tmp_path / "wh"), Table.QUARANTINE, "jobs")
    made_up = base64.urlsafe_b64encode(json.dumps([1.0, "t", "0", 1]).encode()).decode()
    with pytest.raises(BadCursor, match="source_partition"):
        page(quarantine, Table.QUARANTINE, 2, made_up)


def test_quarantine_command_pages_through_every_record(tmp_path: Path) -> None:
    warehouse = tmp_path / "wh"
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {warehouse}\ntopics:\n  - {{name: jobs, kind: priority, source: [in]}}\n"
    )
    path = ensure_table(str(warehouse), Table.QUARANTINE, "jobs")
    write_deltalake(path, quarantine_rows(5), mode="append")
    base = [*DEJAQ, "quarantine", "--topic", "jobs", "--limit", "2", "--conf-file", str(conf)]
    offsets, command, pages = [], base, 0
    while True:  # each next page by the command the last one printed, as printed
        cli = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        pages += 1
        rows = [json.loads(line) for line in cli.stdout.splitlines()]
        assert 0 < len(rows) <= 2 and all(r["reason"] == "invalid_priority" for r in rows)
        offsets += [r["source_offset"] for r in rows]
        if not cli.stderr:
            break
        more = cli.stderr.strip()
        assert more.startswith(
            f"more: dejaq quarantine --topic jobs --limit 2 --conf-file {conf} --after "
        )
        command = [*DEJAQ, *shlex.split(more.removeprefix("more: dejaq "))]
    assert (offsets, pages) == ([0, 1, 2, 3, 4], 3)
    bad = subprocess.run([*base, "--after", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--after" in bad.stderr
    ensure_table(str(warehouse), Table.DEAD_LETTER, "jobs")
    empty = subprocess.run(
        [*DEJAQ, "dead", "--topic", "jobs", "--conf-file", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (empty.returncode, empty.stdout, empty.stderr) == (0, "", "")


def test_a_listing_of_a_wrong_warehouse_fails_naming_the_table_and_makes_nothing(
    tmp_path: Path,
) -> None:
    """An empty answer would read as "nothing died"; a table made there, as a warehouse."""
    warehouse = tmp_path / "misspelt"
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {warehouse}\ntopics:\n  - {{name: jobs, kind: priority, source: [in]}}\n"
    )
    for command, table in (("dead", "dead_letter"), ("quarantine", "quarantine")):
        cli = subprocess.run(
            [*DEJAQ, command, "--topic", "jobs", "--conf-file", str(conf)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (cli.returncode, cli.stdout) == (1, ""), cli.stderr
        assert f"error: no {table} table at {warehouse}/{table}/jobs" in cli.stderr
    assert not warehouse.exists()


def test_quarantined_records_past_their_retention_are_deleted_and_the_rest_kept(
    tmp_path: Path,
) -> None:
    """The quarantine takes every record that could not be buffered; the ingest deletes
    those past `quarantine_retention_ms` at its compactions, committing nothing when no
    file's statistics reach back that far."""
    path = ensure_table(str(tmp_path), Table.QUARANTINE, "jobs")
    write_deltalake(path, quarantine_rows(10), mode="append")  # 0..4 s past `at`
    at_ms = int(dt.datetime(2026, 1, 1, tzinfo=dt.UTC).timestamp() * 1000)
    version = DeltaTable(path).version()
    assert expire_quarantine(path, HOUR_MS, at_ms + HOUR_MS) == 0
    assert DeltaTable(path).version() == version, "nothing past it: no commit"
    assert expire_quarantine(path, HOUR_MS, at_ms + HOUR_MS + 2_500) == 6
    kept = scan(path, Table.QUARANTINE, ["source_offset"]).column("source_offset").to_pylist()
    assert sorted(kept) == [6, 7, 8, 9], "quarantined 3 s after `at` and later"


def test_a_page_reads_the_rows_near_its_cursor_not_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quarantine holding two days of records, a minute apart: each page reads the
    sort columns of a span of time from its cursor (an hour, widened as needed), not the
    table's whole history, and the pages still hold every record once, in order."""
    path = ensure_table(str(tmp_path), Table.QUARANTINE, "jobs")
    rows = quarantine_rows(2880)
    at = rows.column("quarantined_at")[0].as_py()
    minutes = [at + dt.timedelta(minutes=i) for i in range(rows.num_rows)]
    rows = rows.set_column(9, "quarantined_at", pa.array(minutes, rows.schema.field(9).type))
    for part in range(0, rows.num_rows, 480):  # six files, each eight hours
        write_deltalake(path, rows.slice(part, 480), mode="append")
    read: list[int] = []
    original = listings.scan

    def counted(*args: object, **kwargs: object) -> pa.Table:
        got = original(*args, **kwargs)
        read.append(got.num_rows)
        return got

    monkeypatch.setattr(listings, "scan", counted)
    offsets: list[int] = []
    after = None
    for _ in range(300):
        got = page(path, Table.QUARANTINE, 100, after)
        offsets += [r["source_offset"] for r in got.rows]
        if got.next is None:
            break
        after = got.next
    assert offsets == list(range(2880)), "every record once, in order"
    assert max(read) < 2 * 480, "no page read the whole table"
