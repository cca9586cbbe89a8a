"""The index's rows in columns: what ordering and the head store need of each pending
message, in NumPy arrays by handle.

A row as a Python object cost ~370 bytes (a tuple, its ints, an entry tuple in its
bucket's run), a node over a million pending messages ~700 MB. Here a message costs its
id (a str, which every Raft command names it by), 42 bytes of columns and 5 to 16 of
the id table (`IdTable`). Handles of settled messages are reused; a token carries its
handle and the batch that stored it, so an entry naming a handle since reused is told
from the handle's new message: `token[handle] == token` says an entry is still its
message's (0: the handle is free).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from dejaq.broker.head_store import Segment
from dejaq.broker.id_table import IdTable

HANDLE_BITS = 32
HANDLE_MASK = (1 << HANDLE_BITS) - 1


class Row(NamedTuple):
    """One indexed message's fields, as a peek, a cancel or a reschedule asks them."""

    bucket: int
    sort_key: int  # the row's own: a nack or a reschedule overrides it in the Raft state
    partition: int
    offset: int
    ingested_at: int  # epoch ms


class Batch(NamedTuple):
    """Buffer rows of one bucket, in sort order, with their heads written: not yet stored."""

    mids: list[str]
    sort_key: np.ndarray  # int64
    partition: np.ndarray  # int32
    offset: np.ndarray  # int64
    ingested_at: np.ndarray  # int64, epoch ms
    segments: list[Segment]  # where each row's head is: (segments[i], position[i])
    position: np.ndarray  # int64


_COLUMNS = {
    "token": np.int64,  # the stored message's; 0 while the handle is free
    "bucket": np.int16,  # a topic has at most 4096
    "sort_key": np.int64,
    "partition": np.int32,
    "offset": np.int64,
    "ingested_at": np.int64,
    "position": np.int32,  # a head's place in its segment, of at most 64 MB
}


class RowStore:
    """Handles, their columns and the id table. The caller (`TopicIndex`) holds its lock
    around every call that changes them."""

    def __init__(self) -> None:
        self.ids: list[str] = []  # by handle; "" once free
        self.table = IdTable(self.ids)
        self.segments: list[Segment | None] = []  # by handle
        self.token = np.zeros(0, _COLUMNS["token"])
        self.bucket = np.zeros(0, _COLUMNS["bucket"])
        self.sort_key = np.zeros(0, _COLUMNS["sort_key"])
        self.partition = np.zeros(0, _COLUMNS["partition"])
        self.offset = np.zeros(0, _COLUMNS["offset"])
        self.ingested_at = np.zeros(0, _COLUMNS["ingested_at"])
        self.position = np.zeros(0, _COLUMNS["position"])
        self._free = array("q")
        self._batches = 0

    def add(self, bucket: int, batch: Batch, keep: np.ndarray) -> np.ndarray:
        """Store the rows `keep` (positions in `batch`) of `bucket`; returns their tokens.

        The caller has checked that no id in `keep` is stored already (`tokens`).
        """
        n = len(keep)
        reused = min(n, len(self._free))
        handles = np.empty(n, np.int64)
        handles[:reused] = self._free[len(self._free) - reused :]
        del self._free[len(self._free) - reused :]
        size = len(self.ids)
        handles[reused:] = np.arange(size, size + n - reused)
        self._grow(size + n - reused)
        self.bucket[handles] = bucket
        for name in ("sort_key", "partition", "offset", "ingested_at", "position"):
            getattr(self, name)[handles] = getattr(batch, name)[keep]
        if n == len(batch.mids):  # the usual case: every row is new
            mids, segments = batch.mids, batch.segments
        else:
            at = keep.tolist()
            mids = list(map(batch.mids.__getitem__, at))
            segments = list(map(batch.segments.__getitem__, at))
            del at  # before the tokens are made: ints freed between them would leave holes
        ids, segs = self.ids, self.segments
        for i, h in enumerate(handles[:reused].tolist()):
            ids[h], segs[h] = mids[i], segments[i]
        ids += mids[reused:]
        segs += segments[reused:]
        self._batches += 1
        tokens = handles + (self._batches << HANDLE_BITS)
        self.token[handles] = tokens
        self.table.insert(handles)
        return tokens

    def get(self, mid: str) -> int | None:
        """The token of a stored message."""
        h = self.table.get(mid)
        return None if h is None else int(self.token[h])

    def tokens(self, mids: list[str]) -> np.ndarray:
        """The token of each message, 0 for one not stored."""
        handles, _ = self.table.find(mids)
        return np.where(handles >= 0, self.token[np.maximum(handles, 0)], 0)

    def stored(self) -> np.ndarray:
        """The handles of every stored message."""
        return np.flatnonzero(self.token[: len(self.ids)])

    def forget(self, mids: list[str]) -> tuple[Counter[Segment], list[str]]:
        """Messages no longer indexed: their handles are free for reuse. Returns their
        heads to release, by segment, and the ids of `mids` that were not stored."""
        handles, slots = self.table.find(mids)
        hit = handles >= 0
        missing = [] if hit.all() else [m for m, h in zip(mids, hit.tolist(), strict=True) if not h]
        slots, first = np.unique(slots[hit], return_index=True)  # an id named twice
        handles = handles[hit][first]
        self.table.delete(slots)
        self.token[handles] = 0
        ids, segs = self.ids, self.segments
        freed = handles.tolist()
        released: Counter[Segment] = Counter(map(segs.__getitem__, freed))
        for h in freed:
            ids[h] = ""
            segs[h] = None
        self._free.extend(freed)
        return released, missing

    def reserve(self, n: int) -> None:
        """Room for `n` more rows, before adding them a bucket at a time: a first load's
        columns are then sized for the whole buffer, with nothing idle."""
        self._grow(len(self.ids) + max(0, n - len(self._free)))

    def _grow(self, size: int) -> None:
        """Columns for `size` handles: capacity grows by a quarter, so a load's appends
        copy each column a few times, not once per batch, and at most a fifth of it is
        unused (doubling would leave up to half of a large index's columns idle)."""
        capacity = len(self.sort_key)
        if size <= capacity:
            return
        capacity = max(size, capacity + capacity // 4, 1024)
        for name, dtype in _COLUMNS.items():
            column = np.zeros(capacity, dtype)
            old = getattr(self, name)
            column[: len(old)] = old
            setattr(self, name, column)

    def row(self, token: int) -> Row:
        h = token & HANDLE_MASK
        return Row(
            int(self.bucket[h]),
            int(self.sort_key[h]),
            int(self.partition[h]),
            int(self.offset[h]),
            int(self.ingested_at[h]),
        )

    def place(self, token: int) -> tuple[Segment, int]:
        h = token & HANDLE_MASK
        seg = self.segments[h]
        assert seg is not None, "a stored message has a head"
        return seg, int(self.position[h])

    def places(self, handles: np.ndarray) -> list[tuple[Segment, int]]:
        """(segment, position) of each handle's head, in order."""
        return list(
            zip(
                map(self.segments.__getitem__, handles.tolist()),
                self.position[handles].tolist(),
                strict=True,
            )
        )

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
        return map(self.store.ids.__getitem__, self.store.stored().tolist())

    def __len__(self) -> int:
        return len(self.store.table)
