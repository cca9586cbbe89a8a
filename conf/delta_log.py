"""A Delta table's log, read directly for what delta-rs has no call for: one version's
own actions (`pipelines.retention.commits`), the latest Delta checkpoint's version
(`conf.table_watch`), every app transaction (`conf.tables.app_transactions`), from a
classic checkpoint or a v2 one. The log's layout is known here only.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq


def entry_key(root: str, version: int) -> str:
    """The key of `version`'s log entry, under the table's `root` (a file system path)."""
    return f"{root}/_delta_log/{version:020d}.json"


def actions(fs: pafs.FileSystem, root: str, version: int) -> list[dict[str, Any]] | None:
    """The actions of `version`'s log entry, in its order; None if the log holds none
    (not committed yet, or expired from the log)."""
    try:
        entry = fs.open_input_stream(entry_key(root, version))
    except FileNotFoundError:
        return None
    with entry:
        return [json.loads(line) for line in entry.read().decode().splitlines() if line]


def last_checkpoint(fs: pafs.FileSystem, root: str) -> dict[str, Any] | None:
    """The table's `_last_checkpoint` (`version`, and `parts` for a checkpoint in
    parts); None if the table has no Delta checkpoint."""
    try:
        with fs.open_input_stream(f"{root}/_delta_log/_last_checkpoint") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def checkpointed(fs: pafs.FileSystem, root: str) -> int:
    """The version of the table's latest Delta checkpoint (-1: none)."""
    last = last_checkpoint(fs, root)
    return -1 if last is None else int(last["version"])


def checkpoint_column(
    fs: pafs.FileSystem, root: str, last: dict[str, Any], column: str
) -> list[dict[str, Any]]:
    """The actions of one kind (`column`: "txn", "add"...) the checkpoint `last` (read
    by `last_checkpoint`) holds, from each of its parts.

    A v2 checkpoint (`last` names its file, `<version>.checkpoint.<uuid>.json` or
    `.parquet`) holds every action but the files' in that file; the files' (add, remove)
    are in sidecars, which no reader here needs."""
    log = f"{root}/_delta_log"
    if v2 := last.get("v2Checkpoint"):
        if column in ("add", "remove"):
            raise ValueError(f"a v2 checkpoint keeps its {column} actions in sidecars")
        top = _checkpoint_file(fs, f"{log}/{v2['path']}", [column])
        return [a[column] for a in top if a.get(column) is not None]
    version, parts = int(last["version"]), int(last.get("parts") or 0)
    stem = f"{log}/{version:020d}.checkpoint"
    files = [f"{stem}.{i:010d}.{parts:010d}.parquet" for i in range(1, parts + 1)]
    found = []
    for file in files or [f"{stem}.parquet"]:
        table = pq.read_table(file, columns=[column], filesystem=fs)
        found.extend(table.column(column).drop_null().to_pylist())
    return found


def _checkpoint_file(fs: pafs.FileSystem, key: str, columns: list[str]) -> list[dict[str, Any]]:
    """The actions of a checkpoint file, JSON lines or Parquet, as dicts of `columns`."""
    if key.endswith(".json"):
        with fs.open_input_stream(key) as f:
            lines = f.read().decode().splitlines()
        return [{c: a.get(c) for c in columns} for a in map(json.loads, filter(None, lines))]
    present = [c for c in columns if c in pq.read_schema(key, filesystem=fs).names]
    return pq.read_table(key, columns=present, filesystem=fs).to_pylist()
