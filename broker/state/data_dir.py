"""A broker node's data dir: one process at a time, one node's identity and member set,
and Raft files that either load whole or end the node at start.

Raft's safety rests on each node's disk: its journal, and the term and vote it gave. A
node that goes on without them (PySyncObj logs the error and carries on) can stall the
cluster for good, or vote twice in a term; one that starts on another node's files, or
on a member set the others do not share, can let two leaders commit, each what the
other then overwrites. Each is refused here, with the way out (README, Operations,
"Membership and disks").
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

JOURNAL, META, DUMP = "raft.journal", "raft.journal.meta", "raft.dump"
RAFT_FILES = (JOURNAL, META, DUMP)
IDENTITY = "node.json"
LOCK = ".lock"
PROCEDURES = "README, Operations, 'Membership and disks'"
RECOVERY = (
    "this node's Raft state is damaged: do not edit or delete single files, replace the "
    f"node's data dir as for a lost disk ({PROCEDURES})"
)


class DataDirError(Exception):
    """The data dir cannot be used as it is: the node exits at start, saying why."""


def lock(data_dir: Path) -> IO[str]:
    """Hold `data_dir` for this process's life (the open file holds the lock): two nodes
    on one dir would write one journal and vote twice."""
    data_dir.mkdir(parents=True, exist_ok=True)
    held = (data_dir / LOCK).open("a+")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.seek(0)
        pid = held.read().strip() or "unknown"
        held.close()
        raise DataDirError(
            f"data dir {data_dir} in use by PID {pid}: each node needs a data dir of its own "
            "(--data-dir, or a --node-id of its own)"
        ) from None
    held.truncate(0)
    held.write(f"{os.getpid()}\n")
    held.flush()
    # A forked child (the one writing a snapshot) shares the lock while it lives: it
    # would hold the dir past this process's end, and a restart would find it in use.
    os.register_at_fork(after_in_child=held.close)
    return held


def holds_data(data_dir: Path) -> bool:
    """Whether `data_dir` holds a node's Raft state or identity (an empty dir holds none)."""
    return any((data_dir / name).exists() for name in (*RAFT_FILES, IDENTITY))


@dataclass
class Identity:
    """What `node.json` records: the Raft address this dir's state belongs to, the member
    set it was made with, and whether the node may vote and stand for election
    (`joined`: it started a new cluster, or a leader has brought it up to date)."""

    raft: str
    members: list[str]
    joined: bool = True


def _write(path: Path, identity: Identity) -> None:
    """Durably, before the node acts on it: a joined node votes."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(asdict(identity), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_joined(data_dir: Path, identity: Identity) -> None:
    identity.joined = True
    _write(data_dir / IDENTITY, identity)


def admit(
    data_dir: Path, raft: str, peers: list[str], new_cluster: bool, reconfigure: bool
) -> Identity:
    """This node's identity, checked against its flags (recorded at its first start;
    a dir with Raft files and no identity, made before nodes recorded one, takes these
    flags' as it stands). `reconfigure` records the new address and members.

    An empty dir with peers has not joined unless `new_cluster`: it may be a lost disk's
    replacement, whose node voted before in terms it no longer knows, or a node added
    beside others that hold the cluster's history. Voting as if empty, it could elect a
    node that lacks committed entries; standing, it could win with another empty node's
    vote and have the entries they lack truncated everywhere."""
    members = sorted({raft, *peers})
    path = data_dir / IDENTITY
    identity = _read(path)
    # A node that has waited for a leader who never came (each node of a new cluster
    # started without the flag) has heard of no term: nobody stood, nothing to lose.
    bootstrap_late = (
        new_cluster and identity is not None and not identity.joined and _term(data_dir) == 0
    )
    if new_cluster and holds_data(data_dir) and not bootstrap_late:
        raise DataDirError(
            f"--new-cluster: data dir {data_dir} already holds this node's state; the "
            "flag is only for each node's first start in a new cluster: start it "
            "without"
        )
    if identity is None:
        raft_files = any((data_dir / name).exists() for name in RAFT_FILES)
        identity = Identity(raft, members, joined=raft_files or new_cluster or not peers)
        _write(path, identity)
        return identity
    if identity.raft != raft and not reconfigure:
        raise DataDirError(
            f"data dir {data_dir} belongs to the node at Raft address {identity.raft}, not "
            f"--raft {raft}: a data dir copied from another node, or a node moved. Start "
            "each node on its own data dir; a node's new address is a membership change: "
            f"stop every node and start them all with --reconfigure ({PROCEDURES})"
        )
    if identity.members != members and not reconfigure:
        raise DataDirError(
            f"the members {', '.join(members)} (--raft and --peers) are not those data dir "
            f"{data_dir} was made with: {', '.join(identity.members)}. Members must not be "
            "changed by restarting nodes one at a time with other --peers: old and new "
            "members can then each elect a leader, and both commit. Pause the topics until "
            "every node's /v1/cluster shows the same commit_index, stop every node, then "
            f"start them all with the new --peers and --reconfigure ({PROCEDURES})"
        )
    if reconfigure and (identity.raft, identity.members) != (raft, members):
        identity.raft, identity.members = raft, members
        _write(path, identity)
    if bootstrap_late:
        mark_joined(data_dir, identity)
    return identity


def _read(path: Path) -> Identity | None:
    """The identity at `path`; None if the dir has none yet."""
    if not path.exists():
        return None
    try:
        return Identity(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise DataDirError(f"{path} cannot be read ({e}): {RECOVERY}") from None


def _term(data_dir: Path) -> int:
    """The Raft term the node's term-and-vote file holds (0: it has heard of none)."""
    from pysyncobj.pickle import loads

    meta = data_dir / META
    try:
        return int(loads(meta.read_bytes()).get("currentTerm", 0)) if meta.exists() else 0
    except Exception:
        return -1  # unreadable: `check_raft_files` says why at start


def check_raft_files(data_dir: Path) -> None:
    """Refuse a term-and-vote file or a journal that does not read whole. PySyncObj
    takes an unreadable meta file for no vote in no term (a node that can vote twice in
    a term), and a torn journal record for a traceback or for garbage entries."""
    meta = data_dir / META
    if meta.exists():
        from pysyncobj.pickle import loads

        try:
            if not isinstance(loads(meta.read_bytes()), dict):
                raise ValueError("not a dict")
        except Exception as e:
            raise DataDirError(f"{meta} cannot be read ({e!r}): {RECOVERY}") from None
    journal = data_dir / JOURNAL
    if journal.exists():
        why = _journal_damage(journal)
        if why is not None:
            raise DataDirError(f"{journal} cannot be read ({why}): {RECOVERY}")


def _journal_damage(path: Path) -> str | None:
    """What is wrong with PySyncObj's journal file, if anything. Each record is its size,
    its index and term, the command and its size again: a torn or zeroed record shows as
    sizes that disagree or run past the end, or indexes that do not follow each other."""
    from pysyncobj.journal import APP_NAME, FIRST_RECORD_OFFSET, LAST_RECORD_OFFSET_OFFSET

    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < FIRST_RECORD_OFFSET:
            return f"{size} bytes, shorter than its header"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[: len(APP_NAME)] != APP_NAME:
                return "not a PySyncObj journal"
            (end,) = struct.unpack_from("<I", data, LAST_RECORD_OFFSET_OFFSET)
            if not FIRST_RECORD_OFFSET <= end <= size:
                return f"its records end at byte {end}, beyond its {size} bytes"
            offset, last = FIRST_RECORD_OFFSET, None
            while offset < end:
                if offset + 4 > end:
                    return f"a record at byte {offset} cut short"
                (length,) = struct.unpack_from("<I", data, offset)
                if length < 16 or offset + 8 + length > end:
                    return f"the record at byte {offset} has a size of {length} bytes"
                (again,) = struct.unpack_from("<I", data, offset + 4 + length)
                if again != length:
                    return f"the record at byte {offset} is torn (sizes {length} and {again})"
                index, term = struct.unpack_from("<QQ", data, offset + 4)
                if last is not None and (index != last[0] + 1 or term < last[1]):
                    return (
                        f"the record at byte {offset} (index {index}, term {term}) does not "
                        f"follow index {last[0]}, term {last[1]}"
                    )
                last = index, term
                offset += length + 8
    return None
