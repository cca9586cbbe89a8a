"""Pages of a topic's dead letters and quarantine, for an operator looking for ids to
redrive or records to fix: read from the Delta tables (no Spark), oldest first.

A page is read in two steps: the sort columns of the rows from the cursor's time on,
over a span of time that widens until it holds more than a page (files whose statistics
lie outside it are not read), then the page's rows alone. So a page costs the rows near
it, not the table's history. A cursor is the last row's sort values, so a page holds
still while new rows are appended after it.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from dejaq.conf.tables import TIMESTAMP, Table, column, scan

MAX_PAGE = 1000
FIRST_SPAN_US = 3_600_000_000  # an hour: the span first read, then four times wider


@dataclass(frozen=True)
class Page:
    rows: list[dict[str, Any]]
    next: str | None  # the cursor of the next page; None at the end


# Per table: the columns a page is ordered by (time first), and a row's identity.
ORDER: dict[Table, list[str]] = {
    Table.DEAD_LETTER: ["dead_at", "message_id"],
    Table.QUARANTINE: ["quarantined_at", "source_topic", "source_partition", "source_offset"],
}


# The types of a cursor's values after its time (epoch seconds), by column: a cursor is
# the caller's to make up, so each is checked before it reaches a comparison.
CURSOR_TYPES: dict[str, type] = {
    "message_id": str,
    "source_topic": str,
    "source_partition": int,
    "source_offset": int,
}
LATEST_CURSOR_S = 1e11  # past the year 5000: no row's time, and far from int64's µs


class BadCursor(ValueError):
    pass


def page(path: str, table: Table, limit: int, after: str | None = None) -> Page:
    """Up to `limit` rows of `table` after the cursor `after`, in time order."""
    order = ORDER[table]
    cursor = None if after is None else _decode(after, order)
    keys = _keys_after(path, table, order, cursor, limit)
    chosen = keys.slice(0, limit)
    if chosen.num_rows == 0:
        return Page([], None)
    wanted = None
    for name in order:
        values = column(table, name).isin(pc.unique(chosen.column(name)).to_pylist())
        wanted = values if wanted is None else wanted & values
    found = scan(path, table, where=wanted).sort_by([(c, "ascending") for c in order])
    on_page = set(_tuples(chosen, order))  # the isin sets also match rows off the page
    rows = [
        r for r, k in zip(found.to_pylist(), _tuples(found, order), strict=True) if k in on_page
    ]
    more = chosen.num_rows < keys.num_rows
    last = {c: rows[-1][c] for c in order}
    return Page([_json_row(r) for r in rows], _encode(last, order) if more else None)


def _keys_after(
    path: str, table: Table, order: list[str], last: list[Any] | None, limit: int
) -> pa.Table:
    """The sort columns of the rows after `last` (from the first, if None), sorted: more
    than `limit` of them, or all there are. Read over a span of time from the cursor's,
    widened fourfold until it holds them or reaches the table's latest time."""
    time = order[0]
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True))
    stats = (f"min.{time}", f"max.{time}")
    if not adds.num_rows or not set(stats) <= set(adds.column_names):
        return _after(scan(path, table, order), order, last)
    lows, highs = (adds.column(name).cast(TIMESTAMP) for name in stats)
    if lows.null_count or highs.null_count:  # a file without statistics: read them all
        return _after(scan(path, table, order), order, last)
    earliest, latest = pc.min(lows).value, pc.max(highs).value
    # A microsecond early: the cursor's time went through a float, and rows tied with
    # its row come after it.
    start = earliest if last is None else max(earliest, int(last[0] * 1_000_000) - 1)
    span = FIRST_SPAN_US
    while True:
        end = start + span
        within = (column(table, time) >= pa.scalar(start, TIMESTAMP)) & (
            column(table, time) <= pa.scalar(end, TIMESTAMP)
        )
        keys = _after(scan(path, table, order, within), order, last)
        if keys.num_rows > limit or end >= latest:
            return keys
        span *= 4


def _after(keys: pa.Table, order: list[str], last: list[Any] | None) -> pa.Table:
    """`keys` sorted, without those at or before `last`."""
    keys = keys.sort_by([(c, "ascending") for c in order])
    if last is None:
        return keys
    target = tuple(last)
    at_or_before = 0  # they come first, sorted: stop at the first after
    for r in _tuples(keys, order):
        if tuple(map(_comparable, r)) > target:
            break
        at_or_before += 1
    return keys.slice(at_or_before)


def _tuples(t: pa.Table, order: list[str]) -> list[tuple]:
    return list(zip(*(t.column(c).to_pylist() for c in order), strict=True))


def _comparable(value: Any) -> Any:
    return value.timestamp() if hasattr(value, "timestamp") else value


def _encode(last: dict[str, Any], order: list[str]) -> str:
    values = [_comparable(last[c]) for c in order]
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode()


def _decode(cursor: str, order: list[str]) -> list[Any]:
    """The sort values a cursor names, each of its column's type, the time a finite
    number of seconds in range: anything else is not a cursor a page gave."""
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (ValueError, RecursionError) as e:  # nested past what json reads
        raise BadCursor("not a cursor this listing gave") from e
    if not isinstance(values, list) or len(values) != len(order):
        raise BadCursor("not a cursor this listing gave")
    at, *rest = values
    if not _is_number(at) or not (math.isfinite(at) and 0 <= at <= LATEST_CURSOR_S):
        raise BadCursor("not a cursor this listing gave: its time is out of range")
    for name, value in zip(order[1:], rest, strict=True):
        kind = CURSOR_TYPES[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise BadCursor(f"not a cursor this listing gave: its {name} is not a {kind.__name__}")
    return values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json_row(row: dict[str, Any]) -> dict[str, Any]:
    """Bytes as base64 (keys also as UTF-8 where they are), times as epoch ms."""
    out: dict[str, Any] = {}
    for name, value in row.items():
        if isinstance(value, bytes):
            out[name] = base64.b64encode(value).decode()
        elif hasattr(value, "timestamp"):
            out[name] = int(value.timestamp() * 1000)
        elif name == "headers" and value is not None:
            out[name] = [
                {
                    "key": h["key"],
                    "value": None if h["value"] is None else base64.b64encode(h["value"]).decode(),
                }
                for h in value
            ]
        else:
            out[name] = value
    return out
