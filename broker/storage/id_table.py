"""Message ids by handle, and handles by id, in NumPy arrays.

An id as a Python str cost ~64 bytes per pending message (the object, ~49 bytes plus its
length, and its slot in a list by handle): the largest part of what a node holds per
message. Here the ids are one fixed-width bytes column (NumPy "S"), by handle: an id
costs the column's width, 8 bytes for ids of up to 8, the column widening in steps of 8
to the longest id it holds, at most WIDEST. An id longer than that, or ending in a NUL
byte (which the column cannot tell from its padding), is kept whole in `long`, by
handle, and in the column as an 8-byte digest of it.

Handles by message: an open-addressing hash table in one int32 array, and a tag per slot
in a uint8 array. A dict from id to token cost ~60 bytes per message; here a message
costs 5 to 16 bytes of int32 slots and 1 to 4 of tags (the table is a quarter to three
quarters full). A slot holds a handle + 1 (0: empty, -1: deleted). A message is found
by its id or by its message handle ("mh", `broker/state/handles.py`), by which the lease
state names messages: its position and tag are a mix of its mh with a seed drawn per
process (so ids cannot be chosen ahead to collide on a node: the mh alone anyone can
compute). A slot whose tag matches is confirmed, for a look-up by id, by its row's id
compared with the one asked for (exact); for a look-up by mh (each node's forget of a
trim, the leader's naming of a checkpoint's events), by its row's check: 64 bits of its
mh, in a uint64 column by handle (`checks`), grown and renumbered with the id column and
written wherever a row is placed (insert, rebuild, renumber). Hashing the row's id again
instead cost 0.13-0.15 µs a message. A false confirmation would need a row in the probe
chain with the same tag and the same 64 bits of another message's mh: about 2^-72 a
probe, by chance alone (BLAKE3 cannot be steered, and the position's mix is seeded).
The column costs 8 bytes per row of capacity. The id column's width is not in the
position: a wider or narrower column moves no slot.

Linear probing, in the compiled core (`dejaq_core.find_slots`, `take_slots`,
`place_slots`), which hashes and probes each message as it reads it, with no array or
bytes object per message. New ids are hashed once, as they are encoded (`encode`,
outside the caller's lock): the look-up that finds them new and the insert that places
them take those handles. Deleted slots are reused only by a rebuild, when used slots
would pass three quarters, into a table at most half full. A rebuild over a million
ids takes a fraction of a second, hashing them with the GIL released: `make_room` does
it before an insert, outside the caller's lock.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import AbstractContextManager
from itertools import compress
from typing import NamedTuple

import numpy as np
import pyarrow as pa
from dejaq_core import (
    PackedIds,
    arrow_ids,
    find_slots,
    message_handles,
    place_slots,
    take_slots,
)

EMPTY = 0
DELETED = -1
MIN_SLOTS = 1024
STEP = 8  # the column's width grows in words of 8 bytes
WIDEST = 64
ABSENT = -1  # `take`: an id not stored
AGAIN = -3  # `take`: an id named earlier in the same call
MH_WIDTH = 16  # bytes of a packed message handle
_SEED = int.from_bytes(os.urandom(8), "little")  # mixed into each position (module doc)


class Encoded(NamedTuple):
    """Ids, as the column holds them (fixed-width bytes), which of them are digests (kept
    whole in `long`), and their message handles, packed (`broker/state/handles.py`):
    hashed once, for the look-up that finds them new and the insert that places them."""

    mids: list[str]
    keys: np.ndarray
    long: np.ndarray
    mhs: bytes

    def kept(self, keep: np.ndarray) -> Encoded:
        """The ids where the mask `keep` is true."""
        mhs = np.frombuffer(self.mhs, np.uint8).reshape(-1, MH_WIDTH)[keep].tobytes()
        return Encoded(
            list(compress(self.mids, keep.tolist())), self.keys[keep], self.long[keep], mhs
        )


class IdTable:
    """The id column and the table of handles by id; the row store grows the column with
    its other columns, and holds its lock around every call that changes either."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, f"S{STEP}")  # by handle; a freed handle keeps its old id
        self.checks = np.zeros(0, np.uint64)  # by handle: 64 bits of its mh (module doc)
        self.long: dict[int, str] = {}  # ids the column holds as a digest, by handle
        self.slots = np.zeros(MIN_SLOTS, np.int32)
        self.tags = np.zeros(MIN_SLOTS, np.uint8)  # each slot's, read where it is used
        self.live = 0
        self.deleted = 0
        # Stored ids by the words of column they need (index 1..WIDEST // STEP): the
        # column narrows again once the ids that widened it are gone (`narrow`).
        self.words = np.zeros(WIDEST // STEP + 1, np.int64)
        self._deleting: list[np.ndarray] | None = None  # handles deleted during a rebuild

    def __len__(self) -> int:
        return self.live

    # --- the column ------------------------------------------------------------------

    def grow(self, capacity: int) -> None:
        """Room in the columns for `capacity` handles."""
        column = np.zeros(capacity, self.ids.dtype)
        column[: len(self.ids)] = self.ids
        self.ids = column
        checks = np.zeros(capacity, np.uint64)
        checks[: len(self.checks)] = self.checks
        self.checks = checks

    def mids(self, handles: np.ndarray) -> list[str]:
        """The id at each handle."""
        return decode(self.ids, self.long, handles)

    def arrow_ids(self, handles: np.ndarray) -> pa.StringArray:
        """The id at each handle as an Arrow string column, null where the handle is
        negative (`find` found no row): made from the column's bytes by the compiled
        core, with no str per id."""
        handles = np.ascontiguousarray(handles, np.int64)
        width = self.ids.dtype.itemsize
        offsets, data, valid, nulls = arrow_ids(handles, self.ids.view(np.uint8), width, self.long)
        bitmap = pa.py_buffer(valid) if nulls else None
        buffers = [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)]
        return pa.Array.from_buffers(pa.string(), len(handles), buffers, nulls)

    def encode(self, mids: list[str]) -> Encoded:
        """`mids` as `insert` stores them, and hashed. A bytes object per id, 0.1-0.3 s a
        million ids: made before the caller takes the lock that `insert` runs under, by
        the one thread that inserts, which alone changes the column's width."""
        keys, long = self._keys(mids)
        return Encoded(mids, keys, long, message_handles(mids))

    def insert(self, handles: np.ndarray, encoded: Encoded) -> None:
        """Store the ids `encoded` at `handles`, none of them stored already, and index
        them."""
        mids, keys, long, mhs = encoded
        if keys.dtype.itemsize < self.ids.dtype.itemsize:  # encoded before a wider insert
            keys = keys.astype(self.ids.dtype)
        if keys.dtype != self.ids.dtype:  # wider: no position changes (module doc)
            self.ids = self.ids.astype(keys.dtype)
        if self._full(len(handles)):
            self.slots, self.tags = self._built(self.ids, self._stored(), len(handles))
            self.deleted = 0
        self.ids[handles] = keys
        for i in np.flatnonzero(long).tolist():
            self.long[int(handles[i])] = mids[i]
        self._place(self.slots, self.tags, self.ids, handles, mhs)
        self.live += len(handles)
        self.words += _words_of(keys, long)

    def _keys(self, mids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each id as the column holds it, at the column's width or the longest short
        id's, whichever is wider; and which of them are in `long`."""
        raw = [m.encode() for m in mids]
        lengths = np.fromiter(map(len, raw), np.int64, len(raw))
        long = lengths > WIDEST
        if b"\0" in b"".join(raw):
            long |= np.fromiter((r.endswith(b"\0") for r in raw), bool, len(raw))
        for i in np.flatnonzero(long).tolist():
            raw[i] = _digest(raw[i])
        width = self.ids.dtype.itemsize
        short = lengths[~long]
        if len(short) and short.max() > width:
            width = -(-int(short.max()) // STEP) * STEP
        return np.array(raw, f"S{width}"), long

    # --- the table -------------------------------------------------------------------

    def get(self, mid: str) -> int | None:
        """The handle of `mid`, if stored."""
        h = int(self.find([mid])[0][0])
        return None if h < 0 else h

    def find(
        self, mids: list[str] | PackedIds, mhs: bytes | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(handle, slot) of each id; -1 for both where it is not stored. `mhs`: their
        message handles packed, if hashed already (`Encoded.mhs`)."""
        return self._found(mids, mhs)

    def find_mh(self, mhs: bytes) -> tuple[np.ndarray, np.ndarray]:
        """(handle, slot) of each message whose handle `mhs` packs (16 bytes each,
        `broker/state/handles.py`); -1 for both where it is not stored."""
        return self._found(mhs)

    def _found(
        self, asked: list[str] | PackedIds | bytes, mhs: bytes | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        width = self.ids.dtype.itemsize
        ids = self.ids.view(np.uint8)
        slots, handles = find_slots(
            asked, self.slots, self.tags, self.checks, ids, width, self.long, _SEED, mhs
        )
        return np.frombuffer(handles, np.int64), np.frombuffer(slots, np.int64)

    def _full(self, n: int) -> bool:
        return 4 * (self.live + self.deleted + n) > 3 * len(self.slots)

    def make_room(self, n: int, lock: AbstractContextManager) -> None:
        """Room for `n` inserts, by a rebuild if need be, called outside `lock` (which
        every other call to this table is made under) by the one thread that inserts."""
        with lock:
            if not self._full(n):
                return
            kept = self._stored()
            self._deleting = []
        self._rebuild(lock, kept, n)

    def narrow(self, lock: AbstractContextManager) -> int | None:
        """The column at the width its longest stored id needs, once the ids that made it
        wider are gone: a node's memory follows the ids pending, not the longest id it
        ever held. A narrower column cuts the ids of freed handles, which no slot names,
        and moves no slot. Called as `make_room` is; returns the new width, None if
        unchanged."""
        with lock:
            width = STEP * max(1, int(np.flatnonzero(self.words)[-1]) if self.words.any() else 1)
            if width >= self.ids.dtype.itemsize:
                return None
            self.ids = self.ids.astype(f"S{width}")
        return width

    def _rebuild(self, lock: AbstractContextManager, kept: np.ndarray, more: int) -> None:
        """A new table of `kept` (the handles stored when `_deleting` was opened) with
        room for `more`, built outside `lock`: the handles deleted meanwhile are noted
        as they go, and deleted from it under the lock, as it replaces the old table."""
        try:
            slots, tags = self._built(self.ids, kept, more)
        except BaseException:
            with lock:
                self._deleting = None
            raise
        with lock:
            deleting, self._deleting = self._deleting or [], None
            if deleting:
                used = np.flatnonzero(slots > 0)
                gone = np.isin(slots[used] - 1, np.concatenate(deleting))
                slots[used[gone]] = DELETED
            deleted = sum(map(len, deleting))
            self.slots, self.tags = slots, tags
            self.live, self.deleted = len(kept) - deleted, deleted

    def renumber(self, handles: np.ndarray, capacity: int) -> None:
        """The ids at `handles` (every stored one, ascending) at handles 0 to n - 1, in
        a column of `capacity` and a table sized for them: `RowStore.shrink`, under the
        lock, by the thread that inserts (so no rebuild is under way)."""
        n = len(handles)
        ids = np.zeros(capacity, self.ids.dtype)
        ids[:n] = self.ids[handles]
        if self.long:
            at = dict(zip(handles.tolist(), range(n), strict=True))
            self.long = {at[h]: mid for h, mid in self.long.items()}
        self.ids = ids
        self.checks = np.zeros(capacity, np.uint64)  # written as the rows are placed
        self.slots, self.tags = self._built(ids, np.arange(n), 0)
        self.live, self.deleted = n, 0

    def take(self, mids: list[str] | PackedIds) -> np.ndarray:
        """Delete the ids `mids`: the handle of each, ABSENT where it is not stored, AGAIN
        where `mids` named it before. Every node forgets each trim's ids: the compiled
        core empties each slot in the walk that finds it, and tallies the ids' widths as
        it goes (a `find`, then a delete, would read every slot and its id twice)."""
        return self._taken(mids)

    def take_mh(self, mhs: bytes) -> np.ndarray:
        """`take` of the messages whose handles `mhs` packs (16 bytes each)."""
        return self._taken(mhs)

    def _taken(self, asked: list[str] | PackedIds | bytes) -> np.ndarray:
        width = self.ids.dtype.itemsize
        ids = self.ids.view(np.uint8)
        found, words = take_slots(
            asked, self.slots, self.tags, self.checks, ids, width, self.long, _SEED
        )
        codes = np.frombuffer(found, np.int64)
        taken = codes[codes >= 0]
        if self._deleting is not None:  # a rebuild is under way
            self._deleting.append(taken)
        self.words -= np.array(words, np.int64)
        self.live -= len(taken)
        self.deleted += len(taken)
        return codes

    def _stored(self) -> np.ndarray:
        """The handles the table holds."""
        return self.slots[self.slots > 0].astype(np.int64) - 1

    def _built(
        self, ids: np.ndarray, handles: np.ndarray, more: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """A table and its tags of `handles` (ids in column `ids`, or in `long`) with
        room for `more`."""
        size = _size_for(len(handles) + more)
        slots, tags = np.zeros(size, np.int32), np.zeros(size, np.uint8)
        self._place(slots, tags, ids, handles)
        return slots, tags

    def _place(
        self,
        slots: np.ndarray,
        tags: np.ndarray,
        ids: np.ndarray,
        handles: np.ndarray,
        mhs: bytes | None = None,
    ) -> None:
        """Each handle into the first empty slot from its position, by the compiled core,
        at its message handle in `mhs` (an insert's, hashed as it was encoded), or
        hashing each row's id again for it (a rebuild's); and its check into `checks`.
        A rebuild outside the lock writes the checks its rows hold already: their ids
        are unchanged, and only the thread that rebuilds inserts."""
        handles = np.ascontiguousarray(handles, np.int64)
        width = ids.dtype.itemsize
        place_slots(
            slots, tags, self.checks, ids.view(np.uint8), width, self.long, _SEED, handles, mhs
        )


def _digest(raw: bytes) -> bytes:
    """What the column holds of an id it does not hold whole."""
    return hashlib.blake2b(raw, digest_size=STEP).digest()


def _words_of(keys: np.ndarray, long: np.ndarray) -> np.ndarray:
    """How many ids of `keys` (as the column holds them) need each count of words: an
    id in `long` needs its digest's one."""
    words = np.maximum(-(-np.char.str_len(keys) // STEP), 1)
    words[long] = 1
    return np.bincount(words, minlength=WIDEST // STEP + 1)


def decode(ids: np.ndarray, long: dict[int, str], handles: np.ndarray) -> list[str]:
    """The id at each handle of a column (`IdTable.ids`, or a copy of it with `long`)."""
    keys = ids[handles].tolist()
    if not long:
        return list(map(bytes.decode, keys))
    return [
        long[h] if h in long else key.decode()
        for h, key in zip(handles.tolist(), keys, strict=True)
    ]


def _size_for(live: int) -> int:
    """Slots for `live` ids: a power of two at least twice as many."""
    size = MIN_SLOTS
    while size < 2 * live:
        size *= 2
    return size
