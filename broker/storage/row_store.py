"""The index's rows in columns: what ordering and the head store need of each pending
message, in NumPy arrays by handle.

A row as a Python object cost ~370 bytes (a tuple, its ints, an entry tuple in its
bucket's run), a node over a million pending messages ~700 MB. Here a message costs 38
bytes of columns, and its id's width and 5 to 16 bytes of slots in the id table
(`IdTable`). A head's segment is a column of numbers too, not a list of references:
`segments` maps the numbers in use to their segments. Handles of settled messages are
reused; a token carries its handle and the batch that stored it, so an entry naming a
handle since reused is told from the handle's new message: `batch[handle] == token >>
HANDLE_BITS` says an entry is still its message's. The column holds the batch alone (0:
the handle is free), 4 bytes a message where the token would take 8.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress
from typing import NamedTuple, TypeVar, overload

import numpy as np
from dejaq_core import read_heads, read_joined_heads

from dejaq.broker.state.handles import handles_in
from dejaq.broker.storage.head_store import COMPACT_SPAN, SEP, SPAN_PER_HEAD, Segment
from dejaq.broker.storage.id_table import ABSENT, Encoded, IdTable

_T = TypeVar("_T")
HANDLE_BITS = 32
HANDLE_MASK = (1 << HANDLE_BITS) - 1
# Batch numbers run 1..BATCH_MAX and wrap: a token is a signed 64-bit integer, and a
# node stores a batch per bucket and refresh, 2**31 of them in days at thousands of
# buckets. A number comes round again after 2**31 batches, long after any entry naming
# a handle of its first use has surfaced and been dropped.
BATCH_MAX = (1 << 31) - 1
MIN_HANDLES = 1024  # the columns' least capacity
# Handles a shrink must save to be worth renumbering the stored rows: at least this
# many, and at least half the columns (`RowStore.shrink`).
SHRINK_MIN = 1 << 16
# The most rows a shrink renumbers: it holds the index lock, and so the event loop, for
# ~0.3 s with 500,000 left (2 cores, beside a test run), and a leader silent for 0.5 s
# may be replaced (`broker.state.raft.ELECTION_TIMEOUT_S`).
SHRINK_MAX_ROWS = 500_000


Taken = tuple[int, bytes]  # a row's sort key and head, for a leased message's JSON


class Heads(Sequence[Taken]):
    """A lease's heads as read for its JSON (`Order.pick_heads`): joined, where each
    ends (uint32) and their rows' sort keys (int64), both little-endian. Three objects
    whatever the lease's size, not a tuple and a bytes per pick: the usual lease is
    rendered from them whole (`dejaq_core.render_leased`), and a pick is cut out as its
    `Taken` only where one is rendered apart."""

    __slots__ = ("ends", "joined", "row_keys")

    def __init__(self, joined: bytes, ends: bytes, row_keys: bytes) -> None:
        self.joined, self.ends, self.row_keys = joined, ends, row_keys

    @classmethod
    def of(cls, taken: Iterable[Taken]) -> Heads:
        """Heads from (row sort key, head) pairs, as `RowStore.heads` reads them."""
        pairs = list(taken)
        ends = np.cumsum([len(head) for _, head in pairs], dtype="<u4")
        keys = np.array([key for key, _ in pairs], "<i8")
        return cls(b"".join(head for _, head in pairs), ends.tobytes(), keys.tobytes())

    def __len__(self) -> int:
        return len(self.ends) // 4

    @overload
    def __getitem__(self, i: int) -> Taken: ...
    @overload
    def __getitem__(self, i: slice) -> list[Taken]: ...
    def __getitem__(self, i: int | slice) -> Taken | list[Taken]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("head index out of range")
        i %= n
        ends = np.frombuffer(self.ends, "<u4")
        start = int(ends[i - 1]) if i else 0
        key = int.from_bytes(self.row_keys[8 * i : 8 * i + 8], "little", signed=True)
        return key, self.joined[start : int(ends[i])]


def _where(names: list[_T], mask: np.ndarray) -> list[_T]:
    """The names where the mask is true (none, without a walk, where it is false)."""
    return list(compress(names, mask.tolist())) if mask.any() else []


def current(batch: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Which of `tokens` are still their messages' in `batch` (a store's batch column):
    not those of handles freed or reused since."""
    return batch[tokens & HANDLE_MASK] == tokens >> HANDLE_BITS


class Row(NamedTuple):
    """One indexed message's fields, as a peek, a cancel or a reschedule asks them."""

    bucket: int
    sort_key: int  # the row's own: a nack or a reschedule overrides it in the Raft state
    partition: int
    offset: int
    ingested_at: int  # epoch ms, to the second


class Batch(NamedTuple):
    """Buffer rows of one bucket, in sort order, with their heads written: not yet stored."""

    mids: list[str]
    sort_key: np.ndarray  # int64
    partition: np.ndarray  # int32
    offset: np.ndarray  # int64
    ingested_at: np.ndarray  # epoch seconds
    segment: np.ndarray  # int32: where each row's head is, the segment's number
    position: np.ndarray  # int64: and its place there
    written: dict[int, Segment]  # the segments the heads were written to, by number

    def mids_at(self, keep: np.ndarray) -> list[str]:
        """The ids of the rows `keep`: the batch's own list when they are all of them."""
        if len(keep) == len(self.mids):
            return self.mids
        return list(map(self.mids.__getitem__, keep.tolist()))

    def by_segment(self, numbers: np.ndarray) -> Counter[Segment]:
        """How many of `numbers` (some of the rows' `segment`) name each segment. A pass
        over them per segment: a batch's heads fill a few of them."""
        counts: Counter[Segment] = Counter()
        for number, segment in self.written.items():
            if n := int(np.count_nonzero(numbers == number)):
                counts[segment] = n
        return counts


_COLUMNS = {
    "batch": np.uint32,  # that stored the handle's message (its token's high bits); 0: free
    "bucket": np.int16,  # a topic has at most 4096
    "sort_key": np.int64,
    "partition": np.int32,
    "offset": np.int64,
    "ingested_at": np.uint32,  # epoch seconds: an age in metrics needs no finer
    "position": np.int32,  # a head's place in its segment, of at most 64 MB
    "segment": np.int32,  # its head's segment's number (`Segment.number`)
}


class RowStore:
    """Handles, their columns and the id table. The caller (`TopicIndex`) holds its lock
    around every call that changes them."""

    def __init__(self) -> None:
        self.size = 0  # handles made, free or not
        self.table = IdTable()
        # The segments the `segment` column names, and how many stored rows name each.
        self.segments: dict[int, Segment] = {}
        self._rows_in: Counter[int] = Counter()
        self.batch = np.zeros(0, _COLUMNS["batch"])
        self.bucket = np.zeros(0, _COLUMNS["bucket"])
        self.sort_key = np.zeros(0, _COLUMNS["sort_key"])
        self.partition = np.zeros(0, _COLUMNS["partition"])
        self.offset = np.zeros(0, _COLUMNS["offset"])
        self.ingested_at = np.zeros(0, _COLUMNS["ingested_at"])
        self.position = np.zeros(0, _COLUMNS["position"])
        self.segment = np.zeros(0, _COLUMNS["segment"])
        self._free = array("q")
        self._batches = 0

    def add(
        self, bucket: int, batch: Batch, keep: np.ndarray, encoded: Encoded | None = None
    ) -> np.ndarray:
        """Store the rows `keep` (positions in `batch`) of `bucket`; returns their tokens.

        The caller has checked that no id in `keep` is stored already (`tokens`), and
        may have encoded those ids (`IdTable.encode`) before taking the lock.
        """
        n = len(keep)
        reused = min(n, len(self._free))
        handles = np.empty(n, np.int64)
        handles[:reused] = self._free[len(self._free) - reused :]
        del self._free[len(self._free) - reused :]
        size = self.size
        handles[reused:] = np.arange(size, size + n - reused)
        self._grow(size + n - reused)
        self.size = size + n - reused
        self.bucket[handles] = bucket
        for name in ("sort_key", "partition", "offset", "ingested_at", "position"):
            getattr(self, name)[handles] = getattr(batch, name)[keep]
        whole = n == len(batch.mids)  # the usual case: every row is new
        numbers = batch.segment if whole else batch.segment[keep]
        self.segment[handles] = numbers
        for seg, count in batch.by_segment(numbers).items():
            self._moved_in(seg, count)
        if encoded is None:
            encoded = self.table.encode(batch.mids_at(keep))
        self._batches = self._batches % BATCH_MAX + 1
        self.batch[handles] = self._batches
        self.table.insert(handles, encoded)
        return handles + (self._batches << HANDLE_BITS)

    def get(self, mid: str) -> int | None:
        """The token of a stored message."""
        h = self.table.get(mid)
        return None if h is None else h | int(self.batch[h]) << HANDLE_BITS

    def tokens(self, mids: list[str], mhs: bytes | None = None) -> np.ndarray:
        """The token of each message, 0 for one not stored. `mhs`: their message handles
        packed, if hashed already (`Encoded.mhs`)."""
        return self._tokens_found(self.table.find(mids, mhs)[0])

    def tokens_mh(self, mhs: bytes) -> np.ndarray:
        """The token of each message whose message handle `mhs` packs (16 bytes each),
        0 for one not stored: the Raft state names pending messages by handle."""
        return self._tokens_found(self.table.find_mh(mhs)[0])

    def _tokens_found(self, handles: np.ndarray) -> np.ndarray:
        """The tokens at `handles`, 0 where one is -1 (not stored: the store may hold
        no row at all)."""
        tokens = np.zeros(len(handles), np.int64)
        found = handles >= 0
        tokens[found] = self.tokens_at(handles[found])
        return tokens

    def tokens_at(self, handles: np.ndarray) -> np.ndarray:
        """The tokens of the messages at `handles`, 0 at a free one."""
        batch = self.batch[handles].astype(np.int64)
        return np.where(batch != 0, handles | (batch << HANDLE_BITS), 0)

    def stored(self) -> np.ndarray:
        """The handles of every stored message."""
        return np.flatnonzero(self.batch[: self.size])

    def forget(self, mids: list[str]) -> tuple[Counter[Segment], list[str]]:
        """Messages no longer indexed: their handles are free for reuse. Returns their
        heads to release, by segment, and the ids of `mids` that were not stored (one
        named twice is forgotten once)."""
        codes = self.table.take(mids)
        return self._forgotten(codes), _where(mids, codes == ABSENT)

    def forget_mh(self, mhs: bytes) -> tuple[Counter[Segment], list[int]]:
        """`forget` of the messages whose message handles `mhs` packs (16 bytes each), as
        a trim names them; the handles of those not stored, as ints."""
        codes = self.table.take_mh(mhs)
        absent = codes == ABSENT
        missing = _where(handles_in(mhs), absent) if absent.any() else []
        return self._forgotten(codes), missing

    def _forgotten(self, codes: np.ndarray) -> Counter[Segment]:
        """Free the handles `IdTable.take` found (`codes`, negative where none was);
        their heads to release, by segment."""
        handles = codes[codes >= 0]
        self.batch[handles] = 0
        released = self._leave(handles)
        self._free.frombytes(handles.tobytes())
        return released

    def move(
        self, handles: np.ndarray, segment: Segment, positions: np.ndarray
    ) -> Counter[Segment]:
        """Stored rows' heads, copied to `segment` at `positions`. Returns the segments
        the rows left, by rows, for the caller to release their heads there."""
        left = self._leave(handles)
        self.segment[handles] = segment.number
        self.position[handles] = positions
        if len(handles):
            self._moved_in(segment, len(handles))
        return left

    def _leave(self, handles: np.ndarray) -> Counter[Segment]:
        """The segments `handles`' rows name, by rows, which no longer count them.
        Counted in NumPy, a few segments: no Python object per message."""
        numbers = self.segment[handles]
        if not len(numbers):
            return Counter()
        low = int(numbers.min())
        counts = np.bincount(numbers - low)
        named = np.flatnonzero(counts)
        left = Counter(
            {
                self.segments[low + n]: c
                for n, c in zip(named.tolist(), counts[named].tolist(), strict=True)
            }
        )
        for seg, count in left.items():
            self._moved_out(seg.number, count)
        return left

    def _moved_in(self, segment: Segment, count: int) -> None:
        """`count` more rows name `segment`."""
        self.segments[segment.number] = segment
        self._rows_in[segment.number] += count

    def _moved_out(self, number: int, count: int) -> None:
        """`count` rows no longer name segment `number`."""
        self._rows_in[number] -= count
        if self._rows_in[number] <= 0:
            del self._rows_in[number], self.segments[number]

    def reserve(self, n: int) -> None:
        """Room for `n` more rows, before adding them a bucket at a time: a first load's
        columns are then sized for the whole buffer, with nothing idle."""
        self._grow(self.size + max(0, n - len(self._free)))

    def _grow(self, size: int) -> None:
        """Columns for `size` handles: capacity grows by a quarter, so a load's appends
        copy each column a few times, not once per batch, and at most a fifth of it is
        unused (doubling would leave up to half of a large index's columns idle)."""
        capacity = len(self.sort_key)
        if size <= capacity:
            return
        capacity = max(size, capacity + capacity // 4, MIN_HANDLES)
        for name, dtype in _COLUMNS.items():
            column = np.zeros(capacity, dtype)
            old = getattr(self, name)
            column[: len(old)] = old
            setattr(self, name, column)
        self.table.grow(capacity)

    def shrink(self) -> np.ndarray | None:
        """Renumber the stored rows' handles from 0 and cut the columns and the id table
        to them, once that saves half the columns and SHRINK_MIN handles at least, with
        at most SHRINK_MAX_ROWS left: after a backlog drains, a node holds what is
        pending, not the most it ever held.

        Returns each old handle's new one (-1 if it was free), for the caller to move
        the tokens it holds (`TopicIndex.shrink`): a token keeps its batch and takes its
        row's new handle. None if not worth it.
        """
        n = len(self.table)
        capacity = max(n + n // 4, MIN_HANDLES)  # as `_grow` would leave them
        saved = len(self.batch) - capacity
        if n > SHRINK_MAX_ROWS or saved < SHRINK_MIN or 2 * capacity > len(self.batch):
            return None
        handles = self.stored()
        new = np.full(self.size, -1, np.int64)
        new[handles] = np.arange(n)
        for name, dtype in _COLUMNS.items():
            column = np.zeros(capacity, dtype)
            column[:n] = getattr(self, name)[handles]
            setattr(self, name, column)
        self.table.renumber(handles, capacity)
        self.size = n
        self._free = array("q")
        return new

    def row(self, token: int) -> Row:
        h = token & HANDLE_MASK
        return Row(
            int(self.bucket[h]),
            int(self.sort_key[h]),
            int(self.partition[h]),
            int(self.offset[h]),
            int(self.ingested_at[h]) * 1000,
        )

    def heads(self, tokens: np.ndarray, span: int = SPAN_PER_HEAD) -> list[Taken]:
        """The row sort key and head of each token's row (int64 tokens), in order
        (`dejaq_core.read_heads`: a `pread` per run of heads at most `span` apart, and no
        Python object but the heads).

        The caller holds the index's lock: the rows stay, so their segments stay open."""
        return read_heads(tokens, self.sort_key, self.segment, self.position, self.segments, span)

    def separated_heads(self, tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
        """The heads of `tokens` as a segment holds them, each followed by SEP, and where
        each one's SEP ends (uint32): a compaction's, read through the gaps between them
        (COMPACT_SPAN), to be written whole (`HeadStore.write_joined`)."""
        joined, ends, _ = read_joined_heads(
            tokens.astype(np.int64).tobytes(),
            self.sort_key,
            self.segment,
            self.position,
            self.segments,
            COMPACT_SPAN,
            SEP[0],
        )
        return joined, np.frombuffer(ends, "<u4")

    def order(self, tokens: np.ndarray) -> np.ndarray:
        """`tokens` sorted as their rows are ordered: (sort key, partition, offset), the
        token last (the order among duplicates of one message's coordinates)."""
        h = tokens & HANDLE_MASK
        return tokens[np.lexsort((tokens, self.offset[h], self.partition[h], self.sort_key[h]))]


class StoredIds(Mapping[str, int]):
    """The store's id -> token map as a Mapping, for reads that want one (tests, the
    node's status): each call probes the id table."""

    def __init__(self, store: RowStore) -> None:
        self.store = store

    def __getitem__(self, mid: str) -> int:
        token = self.store.get(mid)
        if token is None:
            raise KeyError(mid)
        return token

    def __contains__(self, mid: object) -> bool:
        return isinstance(mid, str) and self.store.table.get(mid) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.store.table.mids(self.store.stored()))

    def __len__(self) -> int:
        return len(self.store.table)
