"""Message ids by handle, and handles by id, in NumPy arrays.

An id as a Python str cost ~64 bytes per pending message (the object, ~49 bytes plus its
length, and its slot in a list by handle): the largest part of what a node holds per
message. Here the ids are one fixed-width bytes column (NumPy "S"), by handle: an id
costs the column's width, 8 bytes for ids of up to 8, the column widening in steps of 8
to the longest id it holds, at most WIDEST. An id longer than that, or ending in a NUL
byte (which the column cannot tell from its padding), is kept whole in `long`, by
handle, and in the column as an 8-byte digest of it.

Handles by id: an open-addressing hash table in one int32 array. A dict from id to token
cost ~60 bytes per message; here a message costs 5 to 16 bytes of int32 slots (the table
is a quarter to three quarters full). A slot holds a handle + 1 (0: empty, -1:
deleted), and matches an id when the column at its handle is equal (and, for an id in
`long`, the whole id is). Positions come from a hash of the column's bytes, computed for
many ids in one vectorised pass and seeded per process, so ids cannot be chosen ahead to
collide: the table is a node's own, rebuilt from its handles at start.

Linear probing. Look-ups run in the compiled core (`dejaq_core.find_slots`), which
hashes and probes each id as it reads it, with no array or bytes object per id, and so
do inserts and rebuilds (`dejaq_core.place_slots`); where
the table holds ids as digests, many ids walk their chains in vectorised steps, a slot
a step, until fewer than FEW are left, which are probed one at a time. Deleted slots
are reused only by a rebuild, when used slots would pass three quarters, into a table
at most half full. A rebuild over a million ids takes a fraction of a second:
`make_room` does it before an insert, outside the caller's lock.
"""

from __future__ import annotations

import hashlib
import os
import struct
from contextlib import AbstractContextManager
from itertools import compress
from typing import NamedTuple

import numpy as np
from dejaq_core import find_slots, place_slots, take_slots

EMPTY = 0
DELETED = -1
MIN_SLOTS = 1024
STEP = 8  # the column's width grows in words of 8 bytes, which the hash reads whole
WIDEST = 64
FEW = 8  # ids probed one at a time in Python: fewer than this cost more in NumPy calls
ASK = -2  # `find_slots`: an id the column holds as a digest, for Python to look up
ABSENT = -1  # `take`: an id not stored
AGAIN = -3  # `take`: an id named earlier in the same call
_SEED = int.from_bytes(os.urandom(8), "little")
_MIX = 0x9E3779B97F4A7C15
_FMIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)  # MurmurHash3's finaliser
_U64 = (1 << 64) - 1


class Encoded(NamedTuple):
    """Ids, as the column holds them (fixed-width bytes), and which of them are digests
    (kept whole in `long`)."""

    mids: list[str]
    keys: np.ndarray
    long: np.ndarray

    def kept(self, keep: np.ndarray) -> Encoded:
        """The ids where the mask `keep` is true."""
        return Encoded(list(compress(self.mids, keep.tolist())), self.keys[keep], self.long[keep])


class IdTable:
    """The id column and the table of handles by id; the row store grows the column with
    its other columns, and holds its lock around every call that changes either."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, f"S{STEP}")  # by handle; a freed handle keeps its old id
        self.long: dict[int, str] = {}  # ids the column holds as a digest, by handle
        self.slots = np.zeros(MIN_SLOTS, np.int32)
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
        """Room in the column for `capacity` handles."""
        column = np.zeros(capacity, self.ids.dtype)
        column[: len(self.ids)] = self.ids
        self.ids = column

    def mids(self, handles: np.ndarray) -> list[str]:
        """The id at each handle."""
        return decode(self.ids, self.long, handles)

    def encode(self, mids: list[str]) -> Encoded:
        """`mids` as `insert` stores them. A bytes object per id, 0.1-0.3 s a million
        ids: made before the caller takes the lock that `insert` runs under, by the one
        thread that inserts, which alone changes the column's width."""
        keys, long, _ = self._keys(mids, grow=True)
        return Encoded(mids, keys, long)

    def insert(self, handles: np.ndarray, encoded: Encoded) -> None:
        """Store the ids `encoded` at `handles`, none of them stored already, and index
        them."""
        mids, keys, long = encoded
        if keys.dtype.itemsize < self.ids.dtype.itemsize:  # encoded before a wider insert
            keys = keys.astype(self.ids.dtype)
        widened = keys.dtype != self.ids.dtype  # the positions of every id stored change
        if widened:
            self.ids = self.ids.astype(keys.dtype)
        if widened or self._full(len(handles)):
            self.slots = self._built(self.ids, self._stored(), len(handles))
            self.deleted = 0
        self.ids[handles] = keys
        for i in np.flatnonzero(long).tolist():
            self.long[int(handles[i])] = mids[i]
        _place(self.slots, self.ids, handles)
        self.live += len(handles)
        self.words += _words_of(keys, long)

    def _keys(
        self, mids: list[str], grow: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each id as the column holds it; which of them are in `long`; and which cannot
        be stored at the column's width (longer than it, not long). With `grow`, the
        width is the column's or the longest short id's, whichever is wider."""
        raw = [m.encode() for m in mids]
        lengths = np.fromiter(map(len, raw), np.int64, len(raw))
        long = lengths > WIDEST
        if b"\0" in b"".join(raw):
            long |= np.fromiter((r.endswith(b"\0") for r in raw), bool, len(raw))
        for i in np.flatnonzero(long).tolist():
            raw[i] = _digest(raw[i])
        width = self.ids.dtype.itemsize
        short = lengths[~long]
        if grow and len(short) and short.max() > width:
            width = -(-int(short.max()) // STEP) * STEP
        return np.array(raw, f"S{width}"), long, ~long & (lengths > width)

    # --- the table -------------------------------------------------------------------

    def get(self, mid: str) -> int | None:
        """The handle of `mid`, if stored."""
        slot = self._find_one(mid) if self.long else int(self._found([mid])[0][0])
        if slot == ASK:
            slot = self._find_one(mid)
        return None if slot < 0 else int(self.slots[slot]) - 1

    def _found(self, mids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The slot of each id, or -1, or ASK for one the column holds as a digest, and
        its handle, or -1: by the compiled core, for a table that holds no id as one."""
        width = self.ids.dtype.itemsize
        slots, handles = find_slots(mids, self.slots, self.ids.view(np.uint8), width, _SEED)
        return np.frombuffer(slots, np.int64), np.frombuffer(handles, np.int64)

    def _find_one(self, mid: str) -> int:
        """The slot of `mid`, or -1: one id, probed in Python, with no arrays made."""
        raw = mid.encode()
        width = self.ids.dtype.itemsize
        long = len(raw) > WIDEST or raw.endswith(b"\0")
        if long:  # as the column holds it: without the padding's NUL bytes
            raw = _digest(raw).rstrip(b"\0")
        elif len(raw) > width:
            return -1
        return self._slot(mid, raw, long, _position(raw, width))

    def _slot(self, mid: str, key: bytes, long: bool, position: int) -> int:
        """The slot of `mid` (as the column holds it: `key`) probing from `position`, or -1."""
        slots, ids = self.slots, self.ids
        mask = len(slots) - 1
        i = position & mask
        while True:
            s = int(slots[i])
            if s == EMPTY:
                return -1
            if s > 0 and ids[s - 1] == key and self._whole(s - 1, mid, long):
                return i
            i = (i + 1) & mask

    def _whole(self, handle: int, mid: str, long: bool) -> bool:
        """Whether an id whose key the column at `handle` matches is the one stored."""
        if long or handle in self.long:
            return self.long.get(handle) == mid
        return True

    def find(self, mids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(handle, slot) of each id; -1 for both where it is not stored."""
        if not self.long:
            found, handles = self._found(mids)
            asked = np.flatnonzero(found == ASK)
            if not len(asked):
                return handles, found
            found = found.copy()
            for i in asked.tolist():
                found[i] = self._find_one(mids[i])
        elif len(mids) < FEW:
            found = np.array([self._find_one(m) for m in mids], np.int64)
        else:
            found = self._find_many(mids)
        handles = np.where(found >= 0, self.slots[np.maximum(found, 0)].astype(np.int64) - 1, -1)
        return handles, found

    def _find_many(self, mids: list[str]) -> np.ndarray:
        """The slot of each id, or -1: probed a slot a step for all ids at once, each
        step for those still walking, down to the few left, probed one at a time.

        After many deletes most chains cross deleted slots: walking every id past its
        first slot in Python made this most of what forgetting a message costs."""
        keys, long, absent = self._keys(mids)
        slots, ids = self.slots, self.ids
        mask = len(slots) - 1
        whole = bool(self.long) or bool(long.any())
        found = np.full(len(mids), -1, np.int64)
        at = _positions(keys) & mask
        todo = np.flatnonzero(~absent)
        at = at[todo]
        while len(todo) >= FEW:
            s = slots[at].astype(np.int64)
            live = np.flatnonzero(s > 0)
            hit = np.zeros(len(todo), bool)
            hit[live] = ids[s[live] - 1] == keys[todo[live]]
            if whole:
                for j in np.flatnonzero(hit).tolist():
                    k = int(todo[j])
                    hit[j] = self._whole(int(s[j]) - 1, mids[k], bool(long[k]))
            found[todo[hit]] = at[hit]
            walk = ~hit & (s != EMPTY)
            todo, at = todo[walk], (at[walk] + 1) & mask
        for k, position in zip(todo.tolist(), at.tolist(), strict=True):
            found[k] = self._slot(mids[k], keys[k], bool(long[k]), position)
        return found

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
        self._rebuild(lock, kept, self.ids.dtype.itemsize, n)

    def narrow(self, lock: AbstractContextManager) -> int | None:
        """The column at the width its longest stored id needs, once the ids that made it
        wider are gone: a node's memory follows the ids pending, not the longest id it
        ever held. Called as `make_room` is; returns the new width, None if unchanged."""
        with lock:
            width = STEP * max(1, int(np.flatnonzero(self.words)[-1]) if self.words.any() else 1)
            if width >= self.ids.dtype.itemsize:
                return None
            kept = self._stored()
            self._deleting = []
        self._rebuild(lock, kept, width, 0)
        return width

    def _rebuild(
        self, lock: AbstractContextManager, kept: np.ndarray, width: int, more: int
    ) -> None:
        """A new table of `kept` (the handles stored when `_deleting` was opened) with
        room for `more`, its column at `width`, built outside `lock`: the handles
        deleted meanwhile are noted as they go, and deleted from it under the lock, as
        it replaces the old table. A narrower column cuts the ids of freed handles,
        which no slot names."""
        try:
            ids = self.ids if width == self.ids.dtype.itemsize else self.ids.astype(f"S{width}")
            slots = self._built(ids, kept, more)
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
            self.ids, self.slots = ids, slots
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
        self.slots = self._built(ids, np.arange(n), 0)
        self.live, self.deleted = n, 0

    def take(self, mids: list[str]) -> np.ndarray:
        """Delete the ids `mids`: the handle of each, ABSENT where it is not stored, AGAIN
        where `mids` named it before. Every node forgets each trim's ids: the compiled
        core empties each slot in the walk that finds it, and tallies the ids' widths as
        it goes (a `find`, then a `delete`, would read every slot and its id twice)."""
        if self.long:
            handles, slots = self.find(mids)
            hit = np.flatnonzero(handles >= 0)
            _, first = np.unique(slots[hit], return_index=True)
            codes = handles.copy()
            codes[hit] = AGAIN
            codes[hit[first]] = handles[hit[first]]
            self.delete(slots[hit[first]])
            return codes
        width = self.ids.dtype.itemsize
        found, words = take_slots(mids, self.slots, self.ids.view(np.uint8), width, _SEED)
        codes = np.frombuffer(found, np.int64)
        taken = codes[codes >= 0]
        if self._deleting is not None:  # a rebuild is under way
            self._deleting.append(taken)
        self.words -= np.array(words, np.int64)
        self.live -= len(taken)
        self.deleted += len(taken)
        return codes

    def delete(self, slots: np.ndarray) -> None:
        """Empty `slots` (as `find` returned them, each a stored id's)."""
        handles = self.slots[slots].astype(np.int64) - 1
        if self._deleting is not None:  # a rebuild is under way
            self._deleting.append(handles)
        long = (
            np.fromiter(map(self.long.__contains__, handles.tolist()), bool, len(handles))
            if self.long
            else np.zeros(len(handles), bool)
        )
        self.words -= _words_of(self.ids[handles], long)
        if self.long:
            for h in handles.tolist():
                self.long.pop(h, None)
        self.slots[slots] = DELETED
        self.live -= len(slots)
        self.deleted += len(slots)

    def _stored(self) -> np.ndarray:
        """The handles the table holds."""
        return self.slots[self.slots > 0].astype(np.int64) - 1

    @staticmethod
    def _built(ids: np.ndarray, handles: np.ndarray, more: int) -> np.ndarray:
        """A table of `handles` (ids in column `ids`) with room for `more`."""
        slots = np.zeros(_size_for(len(handles) + more), np.int32)
        _place(slots, ids, handles)
        return slots


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


def _positions(keys: np.ndarray) -> np.ndarray:
    """The hash of each key (a fixed-width bytes array whose width is a multiple of 8),
    word by word, then mixed so that its low bits, a table's position, depend on all."""
    words = np.ascontiguousarray(keys).view("<u8").reshape(len(keys), keys.dtype.itemsize // 8)
    h = np.full(len(keys), _SEED, np.uint64)
    for k in range(words.shape[1]):
        h ^= words[:, k]
        h *= np.uint64(_MIX)
    for c in _FMIX:
        h ^= h >> np.uint64(33)
        h *= np.uint64(c)
    h ^= h >> np.uint64(33)
    return (h >> np.uint64(1)).astype(np.int64)


def _position(key: bytes, width: int) -> int:
    """`_positions` of one key, in Python: a probe of one id makes no arrays."""
    h = _SEED
    for (word,) in struct.iter_unpack("<Q", key.ljust(width, b"\0")):
        h = ((h ^ word) * _MIX) & _U64
    for c in _FMIX:
        h = ((h ^ (h >> 33)) * c) & _U64
    return (h ^ (h >> 33)) >> 1


def _place(slots: np.ndarray, ids: np.ndarray, handles: np.ndarray) -> None:
    """Each handle into the first empty slot from its id's position, by the compiled
    core, which hashes as `_positions` does."""
    handles = np.ascontiguousarray(handles, np.int64)
    place_slots(slots, ids.view(np.uint8), ids.dtype.itemsize, _SEED, handles)


def _size_for(live: int) -> int:
    """Slots for `live` ids: a power of two at least twice as many."""
    size = MIN_SLOTS
    while size < 2 * live:
        size *= 2
    return size
