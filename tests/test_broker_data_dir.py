"""A broker node's data dir as real `dejaq broker` processes meet it: damaged Raft files."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import pytest
from pysyncobj.journal import FileJournal
from test_broker_cluster import exit_at_start, write_conf


def truncated_dump(data_dir: Path) -> Path:
    """A snapshot cut short, as a crash mid-write leaves one."""
    path = data_dir / "raft.dump"
    whole = gzip.compress(pickle.dumps(({"x": list(range(10_000))}, (b"", 3, 1), (b"", 2, 1))))
    path.write_bytes(whole[: len(whole) // 2])
    return path


def zeroed_journal_record(data_dir: Path) -> Path:
    """A journal of three records, PySyncObj's, whose last record is zeros."""
    path = data_dir / "raft.journal"
    journal = FileJournal(str(path))
    for idx in (1, 2, 3):
        journal.add(b"\x00" + bytes(20), idx, 1)
    journal._destroy()
    raw = bytearray(path.read_bytes())
    (end,) = struct.unpack_from("<I", raw, 36)
    size = 16 + 21 + 8
    raw[end - size : end] = bytes(size)
    path.write_bytes(raw)
    return path


def truncated_meta(data_dir: Path) -> Path:
    """The term-and-vote file empty, as a crash before its write reached the disk."""
    path = data_dir / "raft.journal.meta"
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("damage", [truncated_dump, zeroed_journal_record, truncated_meta])
def test_a_node_whose_raft_files_do_not_read_exits_at_start_naming_the_file(
    tmp_path, damage
) -> None:
    """A snapshot, journal or term-and-vote file that cannot be read ends the node at
    start, naming the file and the way out: not a traceback, nor a node that carries on
    without it (one that never applies again, or forgets the vote it gave)."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    (tmp_path / "a").mkdir()
    path = damage(tmp_path / "a")
    code, said = exit_at_start(tmp_path, conf)
    assert code == 1, said
    assert f"{path} cannot be read" in said, said
    assert "Membership and disks" in said and "Traceback" not in said, said
