"""Rendered heads of pending messages (`message_json.head`), on local disk.

A node holds every pending message of its topics; in memory, their payloads were most of
it (a 1 KB payload's head is ~1.4 KB of JSON, a million of them gigabytes per node). The
index keeps only what ordering needs and where a message's head is; a lease reads the
heads it grants, a peek the one it shows.

Why a local store and not the buffer table: the buffer's files are in ingestion order, so
the lowest sort keys of a bucket lie scattered over whole Parquet row groups, and reading
one message means reading its row group. Here the heads of a bucket are written in its
sort order, so the picks of a lease, mostly consecutive, come in a few `pread`s from the
page cache. The store is a cache: written as the node indexes buffer rows, in unlinked
temporary files (gone with the process, however it ends), and rebuilt from the buffer at
start. A segment the disk fails is retired, and the heads it lost are read again from
the buffer (`TopicIndex.repair_heads`).

Heads are appended to segments of up to SEGMENT_BYTES; a segment is freed once every
message written to it is settled and forgotten. A few long-pending messages would keep
whole segments of settled ones: the index moves the live heads of a segment that has
stayed mostly settled (`sparse`) to the current one, so the disk follows what is pending.
"""

from __future__ import annotations

import errno
import heapq
import os
import tempfile
import threading
import time
from array import array
from collections.abc import Iterable
from typing import IO

import numpy as np
from dejaq_core import read_heads

SEGMENT_BYTES = 64 * 1024 * 1024
END_MAX = (1 << 32) - 1  # the largest offset `Segment.ends` holds
SPAN_PER_HEAD = 4  # wanted heads this close are read as one range, through the others
SPARSE = 4  # a segment no longer written with under 1/SPARSE of its heads live is compacted
# A sparse segment is compacted once it has been sparse this long. A backlog drained in
# sort order takes every segment through sparse to empty: moving their last heads copies
# what is about to settle (a third of such a backlog's heads; at batch 100, 14% of a
# follower's CPU). A segment still sparse after this holds long-pending messages.
SETTLE_S = 10.0
# A compaction's reads: the heads it moves are under 1/SPARSE of their segments', so most
# lie a few apart: read through the gaps, a `pread` (a system call) takes many.
COMPACT_SPAN = 4 * SPARSE
WRITE_MAX = 1 << 30  # bytes a `pwrite` is given at once
SEP = b"\0"  # after each head: JSON escapes every control character, so never inside one


class Numbers:
    """Segments' numbers, each held by one open segment and given back once no cache
    holds a block of it (`HeadStore.recycle`), to be taken again lowest first: the row
    store keeps them in an int32 column, and a node opens a scratch segment for each
    bucket it reads out of order, so a counter would pass 2**31 within weeks at
    thousands of buckets."""

    def __init__(self) -> None:
        self._next = 0
        self._free: list[int] = []
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if self._free:
                return heapq.heappop(self._free)
            self._next += 1
            return self._next - 1

    def give(self, number: int) -> None:
        with self._lock:
            heapq.heappush(self._free, number)


_numbers = Numbers()


class Segment:
    """One temporary file of heads, each followed by SEP; `ends[i]` is where head i's
    separator ends (4 bytes a head: a segment stops taking writes at SEGMENT_BYTES, and
    one that a write would take past 4 GB is not written to)."""

    __slots__ = ("ends", "fd", "file", "live", "number", "size", "sparse_since")

    def __init__(self, folder: str | None) -> None:
        self.number = _numbers.take()
        # Closed when the store frees the segment (`HeadStore._free`), not by a block.
        self.file: IO[bytes] = tempfile.TemporaryFile(  # noqa: SIM115
            dir=folder, prefix="dejaq-heads-"
        )
        self.fd = self.file.fileno()  # what the core's reads take, without a call a lease
        self.ends = array("I")
        self.live = 0  # heads written here whose message is still indexed
        self.size = 0
        self.sparse_since: float | None = None  # monotonic, when first seen sparse

    def __lt__(self, other: Segment) -> bool:
        """Ordered as written: two index entries of one message (its row moved, or read
        again) may compare down to their rows' segments."""
        return self.number < other.number


class ReserveReached(OSError):
    """New heads would leave less free space than the node keeps (`reserve`)."""

    def __init__(self, folder: str, free: int, reserve: int) -> None:
        super().__init__(
            errno.ENOSPC,
            f"{folder} has {free} bytes free, within the {reserve} kept for the Raft journal "
            "(broker.disk_reserve_bytes): new messages wait in the buffer until space is "
            "freed there",
        )


class HeadStore:
    """Append heads, free empty segments; `RowStore.heads` reads them back.

    One thread writes (the one following the tables); reads and releases come from the
    event loop, under the index's lock, for messages still indexed: their segments are
    live. The store's own lock guards only the counts and the segment list.
    """

    def __init__(self, folder: str | None = None, reserve: int = 0) -> None:
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.reserve = reserve  # bytes `write` leaves free on the folder's disk
        self.current: Segment | None = None
        self.segments: set[Segment] = set()
        # Numbers of segments freed since the pick's cache of blocks by number was last
        # emptied (`recycle`): given back before, one could name another segment there.
        self._freed: list[int] = []
        self._lock = threading.Lock()

    def write(self, heads: list[str]) -> tuple[Segment, int]:
        """Append `heads` (ASCII JSON) to one segment; returns it and the first position.

        Each head written counts as live until `release`d. Raises `ReserveReached` if
        the write would leave less than `reserve` bytes free on the folder's disk (a
        compaction's `write_joined`, which frees more than it takes, does not look).
        """
        self.check_room(sum(map(len, heads)) + len(heads))
        return self.write_joined("\0".join(heads).encode("ascii") + SEP, ends(heads))

    def check_room(self, size: int = 0) -> None:
        """`ReserveReached` unless `size` more bytes leave `reserve` free on the disk."""
        if self.folder is not None and self.reserve:
            stat = os.statvfs(self.folder)
            free = stat.f_bavail * stat.f_frsize
            if free - size < self.reserve:
                raise ReserveReached(self.folder, free, self.reserve)

    def write_joined(self, data: bytes, placed: np.ndarray) -> tuple[Segment, int]:
        """`write` for heads already joined, each followed by SEP, `placed[i]` where head
        i's SEP ends in `data` (a compaction's, `RowStore.separated_heads`).

        The heads are counted only once every byte is on disk: a write that fails
        (a full disk, a file size limit) raises, the segment as it was, rather than
        leave heads a lease would read as NULs or past the file's end.
        """
        if len(data) > END_MAX:
            raise ValueError(f"{len(data)} bytes of heads in one write: over {END_MAX}")
        with self._lock:
            seg = self.current
            if seg is None or seg.size >= SEGMENT_BYTES or seg.size + len(data) > END_MAX:
                if seg is not None and seg.live <= 0:
                    self._free(seg)
                seg = self.current = Segment(self.folder)
                self.segments.add(seg)
            start = seg.size
        # Outside the lock, which releases take from the event loop. One thread writes,
        # so the current segment is neither written nor freed meanwhile.
        _write_all(seg.fd, data, start)
        with self._lock:
            first = len(seg.ends)
            seg.ends.frombytes((placed + start).astype(np.uint32).tobytes())
            seg.live += len(placed)
            seg.size = start + int(placed[-1]) if len(placed) else start
        return seg, first

    def release(self, counts: dict[Segment, int]) -> None:
        """Messages settled and forgotten (or never indexed), by segment."""
        with self._lock:
            for seg, n in counts.items():
                seg.live -= n
                if seg.live <= 0 and seg is not self.current:
                    self._free(seg)

    def retire(self, segments: Iterable[Segment]) -> None:
        """Segments whose file the disk fails: written to no more (the next write opens
        a segment), and freed once their live heads are moved or settled."""
        with self._lock:
            for seg in segments:
                if seg is self.current:
                    self.current = None
                if seg.live <= 0:
                    self._free(seg)

    def sparse(self, now: float | None = None) -> list[Segment]:
        """Full segments that have held fewer than 1/SPARSE live heads for SETTLE_S
        (since the first call that saw them so; `now` is `time.monotonic()`'s): worth
        moving them. Their live heads only go, so a sparse segment stays sparse."""
        now = time.monotonic() if now is None else now
        found = []
        with self._lock:
            for s in self.segments:
                if s is self.current or not 0 < s.live * SPARSE < len(s.ends):
                    continue
                if s.sparse_since is None:
                    s.sparse_since = now
                if now - s.sparse_since >= SETTLE_S:
                    found.append(s)
        return found

    def disk_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self.segments)

    def close(self) -> None:
        with self._lock:
            for seg in list(self.segments):
                self._free(seg)
            self.current = None
        self.recycle()

    def recycle(self) -> None:
        """Give back the numbers of the segments freed: call once no cache holds a block
        read from them (the index's `release_columns` empties the pick's)."""
        with self._lock:
            freed, self._freed = self._freed, []
        for number in freed:
            _numbers.give(number)

    def _free(self, seg: Segment) -> None:
        if seg in self.segments:
            self.segments.discard(seg)
            seg.file.close()
            self._freed.append(seg.number)


def _write_all(fd: int, data: bytes, at: int) -> None:
    """Write all of `data` at `at`, WRITE_MAX at a time: a `pwrite` may write less than
    it was given (a disk filling up, at most 2,147,479,552 bytes on Linux), and raises
    only when it writes nothing."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done : done + WRITE_MAX], at + done)
        if n <= 0:
            raise OSError(errno.EIO, f"a head write stopped after {done} of {len(view)} bytes")
        done += n


def ends(heads: list[str]) -> np.ndarray:
    """Where each head's separator ends, the heads written one after another (int64):
    one C-level pass."""
    lengths = np.fromiter(map(len, heads), np.int64, len(heads)) + 1
    return np.cumsum(lengths)


def read(numbers: np.ndarray, positions: np.ndarray, segments: dict[int, Segment]) -> list[bytes]:
    """The heads at these places (segment numbers, positions in them), in this order:
    what `RowStore.heads` reads by row, read by place (a copy between stores)."""
    rows = np.arange(len(numbers), dtype=np.int64)
    unkeyed = np.zeros(len(numbers), np.int64)
    places = positions.astype(np.int32)
    numbers = numbers.astype(np.int32, copy=False)
    return [h for _, h in read_heads(rows, unkeyed, numbers, places, segments, SPAN_PER_HEAD)]
